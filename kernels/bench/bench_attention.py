#!/usr/bin/env python3
"""Times attnd's kernels against torch SDPA (FLASH_ATTENTION = FA2, CUDNN_ATTENTION) on the same inputs.

One process, one GPU: our kernel through libattnd_kernels_c.so (ctypes, plan once per input set, launch on
torch's current stream) and torch.nn.functional.scaled_dot_product_attention with one backend forced via
torch.nn.attention.sdpa_kernel. Inputs are [B, S, H, D] bf16 tensors; torch gets their [B, H, S, D]
transposed views. Timing: CUDA events around every call, warm-up first, the stream held by a sleep kernel
while the calls are queued (so host overhead does not leak into the events), input sets rotated so repeated
calls do not run out of L2, median reported. TFLOP/s count 4*B*Hq*Sq*Skv*D, halved for causal.

  python3 kernels/bench/bench_attention.py --lib .carry/libattnd_kernels_c.so [--tables mma_sync,fa3,gqa]
      [--configs mma_sync|all|name,name] [--json out.json]
"""
import argparse
import ctypes
import json
import math
import os
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

L2_BYTES = 60 << 20


class Attnd:
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        L = self.lib
        L.attnd_kernels_plan_create.restype = ctypes.c_int
        L.attnd_kernels_plan_create.argtypes = [
            ctypes.POINTER(ctypes.c_int64), ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.POINTER(ctypes.c_int64),
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p,
            ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_size_t]
        L.attnd_kernels_plan_launch.restype = ctypes.c_int
        L.attnd_kernels_plan_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
        L.attnd_kernels_plan_config.restype = ctypes.c_char_p
        L.attnd_kernels_plan_config.argtypes = [ctypes.c_void_p]
        L.attnd_kernels_plan_destroy.argtypes = [ctypes.c_void_p]
        L.attnd_kernels_config_count.restype = ctypes.c_int
        L.attnd_kernels_config_name.restype = ctypes.c_char_p
        L.attnd_kernels_config_name.argtypes = [ctypes.c_int]
        self.err = ctypes.create_string_buffer(1024)

    def configs(self):
        return [self.lib.attnd_kernels_config_name(i).decode() for i in range(self.lib.attnd_kernels_config_count())]

    def plan(self, q, k, v, o, causal, config, lse=None):
        B, Sq, Hq, D = q.shape
        Skv, Hkv = k.shape[1], k.shape[2]
        shape = (ctypes.c_int64 * 6)(B, Sq, Skv, Hq, Hkv, D)
        st = []
        for t in (q, k, v, o):
            st += [t.stride(0), t.stride(1), t.stride(2)]
        strides = (ctypes.c_int64 * 12)(*st)
        out = ctypes.c_void_p()
        rc = self.lib.attnd_kernels_plan_create(
            shape, 0 if q.dtype == torch.bfloat16 else 1, 1 if causal else 0, 1.0 / math.sqrt(D), strides,
            q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr() if lse is not None else None,
            (config or "").encode(), ctypes.byref(out), self.err, len(self.err))
        if rc != 0:
            raise RuntimeError(self.err.value.decode())
        return out

    def launch(self, plan, stream):
        rc = self.lib.attnd_kernels_plan_launch(plan, stream, self.err, len(self.err))
        if rc != 0:
            raise RuntimeError(self.err.value.decode())

    def plan_config(self, plan):
        return self.lib.attnd_kernels_plan_config(plan).decode()


def time_calls(fn, n_sets, reps, warmup=3):
    """Median milliseconds of fn(i) over `reps` calls, i rotating over the input sets."""
    for i in range(warmup):
        fn(i % n_sets)
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda._sleep(int(2e5 * reps))  # ~0.1 ms per call queued: the GPU waits until all are enqueued
    for r in range(reps):
        starts[r].record()
        fn(r % n_sets)
        ends[r].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def flops(B, Hq, Sq, Skv, D, causal):
    f = 4.0 * B * Hq * Sq * Skv * D
    return f / 2 if causal else f


def run_row(attnd, B, S, Hq, Hkv, D, causal, configs, check=True):
    set_bytes = 2 * B * S * D * (2 * Hq + 2 * Hkv)
    n_sets = max(2, min(8, math.ceil(3 * L2_BYTES / set_bytes)))
    sets = []
    for _ in range(n_sets):
        q = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16)
        o = torch.empty_like(q)
        sets.append((q, k, v, o))
    fl = flops(B, Hq, S, S, D, causal)
    est_ms = fl / 300e12 * 1e3
    reps = int(min(200, max(10, 150.0 / max(est_ms, 1e-3))))
    stream = torch.cuda.current_stream().cuda_stream
    row = {"B": B, "S": S, "Hq": Hq, "Hkv": Hkv, "D": D, "causal": causal, "reps": reps, "sets": n_sets,
           "ours": {}, "peers": {}}

    for cfg in configs:
        try:
            plans = [attnd.plan(q, k, v, o, causal, cfg) for (q, k, v, o) in sets]
        except RuntimeError as e:
            row["ours"][cfg] = {"error": str(e)[:200]}
            continue
        name = attnd.plan_config(plans[0])
        ms = time_calls(lambda i: attnd.launch(plans[i], stream), n_sets, reps)
        row["ours"][cfg] = {"config": name, "ms": ms, "tflops": fl / ms / 1e9}
        for p in plans:
            attnd.lib.attnd_kernels_plan_destroy(p)

    views = [(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)) for (q, k, v, o) in sets]
    gqa = Hq != Hkv
    for label, backend in (("fa2", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        def call(i, backend=backend):
            q, k, v = views[i]
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        try:
            ref = call(0)
            torch.cuda.synchronize()
        except Exception as e:  # the backend refuses this shape
            row["peers"][label] = {"error": str(e).splitlines()[0][:200]}
            continue
        ms = time_calls(call, n_sets, reps)
        entry = {"ms": ms, "tflops": fl / ms / 1e9}
        if check and configs:
            # Same inputs, our output against the peer's (both bf16): a sanity check, not the test suite.
            q, k, v, o = sets[0]
            plan = attnd.plan(q, k, v, o, causal, configs[0])
            attnd.launch(plan, stream)
            torch.cuda.synchronize()
            attnd.lib.attnd_kernels_plan_destroy(plan)
            entry["max_abs_diff_vs_ours"] = (o.float() - ref.transpose(1, 2).float()).abs().max().item()
        row["peers"][label] = entry
    del sets, views
    torch.cuda.empty_cache()
    return row


def fmt_row(row, configs):
    ours = [row["ours"].get(c, {}) for c in configs]
    fa2 = row["peers"].get("fa2", {})
    cud = row["peers"].get("cudnn", {})
    cells = [str(row["B"]), str(row["S"]), f'{row["Hq"]}:{row["Hkv"]}', str(row["D"]), "yes" if row["causal"] else "no"]
    best = None
    for o in ours:
        if "tflops" in o:
            cells.append(f'{o["tflops"]:.1f}')
            best = o if best is None or o["tflops"] > best["tflops"] else best
        else:
            cells.append("err")
    cells.append(f'{fa2["tflops"]:.1f}' if "tflops" in fa2 else "n/a")
    cells.append(f'{cud["tflops"]:.1f}' if "tflops" in cud else "n/a")
    first = ours[0] if ours and "tflops" in ours[0] else None
    cells.append(f'{first["tflops"] / fa2["tflops"]:.2f}' if first and "tflops" in fa2 else "n/a")
    cells.append(f'{first["tflops"] / cud["tflops"]:.2f}' if first and "tflops" in cud else "n/a")
    return "| " + " | ".join(cells) + " |"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default=".carry/libattnd_kernels_c.so")
    ap.add_argument("--tables", default="mma_sync,fa3,gqa")
    ap.add_argument("--configs", default="mma_sync",
                    help="mma_sync (that family's tuned choice), all (that plus every mma_sync shape of the "
                         "head_dim), or a comma-separated list of names / auto / mma_sync / hopper")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    torch.manual_seed(0)
    attnd = Attnd(os.path.abspath(args.lib))
    all_cfgs = attnd.configs()

    dev = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True).stdout.strip()
    except OSError:
        driver = "?"
    env = {"device": dev.name, "sms": dev.multi_processor_count, "driver": driver, "torch": torch.__version__,
           "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}
    print("# env:", json.dumps(env), flush=True)

    def cfgs_for(D):
        if args.configs == "mma_sync":
            return ["mma_sync"]
        if args.configs == "all":  # every mma_sync shape of this head_dim (tuning)
            return ["mma_sync"] + [c for c in all_cfgs if f"_d{D}_" in c and c.startswith("mma_sync_")]
        return [c for c in args.configs.split(",") if f"_d{D}_" in c or c in ("auto", "mma_sync", "hopper")]

    tables = []
    want = args.tables.split(",")
    if "mma_sync" in want:
        tables.append(("mma_sync: B=1, H=32, D=128, causal", [(1, S, 32, 32, 128, True) for S in (512, 1024, 2048, 4096, 8192, 16384)]))
    if "fa3" in want:
        for D, H in ((128, 16), (64, 32)):
            for causal in (False, True):
                tables.append((f"FA3 convention: B*S=16k, H={H}, D={D}, causal={causal}",
                               [(16384 // S, S, H, H, D, causal) for S in (512, 1024, 2048, 4096, 8192, 16384)]))
    if "d256" in want:
        for causal in (False, True):
            tables.append((f"D=256, H=16, B*S=16k, causal={causal}",
                           [(16384 // S, S, 16, 16, 256, causal) for S in (1024, 4096, 16384)]))
    if "gqa" in want:
        for hq in (32, 64):
            tables.append((f"GQA {hq}:8, D=128, B*S=16k, causal",
                           [(16384 // S, S, hq, 8, 128, True) for S in (1024, 4096, 16384)]))
    results = []
    for title, rows in tables:
        D = rows[0][4]
        configs = cfgs_for(D)
        print(f"\n### {title}\n", flush=True)
        head = "| B | S | Hq:Hkv | D | causal | " + " | ".join(f"attnd {c}" for c in configs) + \
            " | FA2 | cuDNN | attnd/FA2 | attnd/cuDNN |"
        print(head)
        print("|" + "---|" * (head.count("|") - 1))
        for (B, S, Hq, Hkv, D, causal) in rows:
            row = run_row(attnd, B, S, Hq, Hkv, D, causal, configs)
            row["table"] = title
            results.append(row)
            print(fmt_row(row, configs), flush=True)
            for c, o in row["ours"].items():
                if "error" in o:
                    print("   ", c, "error:", o["error"], flush=True)
            for k, p in row["peers"].items():
                if "error" in p:
                    print("   ", k, "error:", p["error"], flush=True)
                elif "max_abs_diff_vs_ours" in p and p["max_abs_diff_vs_ours"] > 0.05:
                    print("    WARNING: max |ours - %s| = %.4f" % (k, p["max_abs_diff_vs_ours"]), flush=True)
    print("\n(TFLOP/s, median of per-call CUDA-event times; ratios use the first attnd column)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "rows": results}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())

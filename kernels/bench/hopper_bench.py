#!/usr/bin/env python3
"""Times attnd's kernels (through libattnd_kernels_c.so) against torch SDPA's CUDNN_ATTENTION and
FLASH_ATTENTION backends on the same inputs, in one process, and prints a table.

Rows follow FlashAttention-3's convention (batch x seq = 16k tokens, hidden 2048, heads = 2048 / head_dim)
plus GQA rows. All tensors are stored [batch, seq, heads, head_dim] (attnd's layout); SDPA gets transposed
views of the same storage. Inputs are random normal (never zeros); attnd's output is checked against cuDNN's
on every row (max abs difference) before it is timed. Timing: triton.testing.do_bench (CUDA events, L2
flushed between runs), median.

  python3 hopper_bench.py --lib path/libattnd_kernels_c.so --configs hopper,mma_sync [--quick] [--json out.json]

Order and clocks: under the H200's 700 W cap a column's figure depends on what ran just before it (the first attnd
column of a process can run ~10% faster than the second, and the bias is larger with the peers first). --peers_last
times attnd's columns before the peers in each row; --settle_ms runs each column back to back before its timing, so
that every figure starts from its own steady clocks. For A/Bs, pass --peers_last in every process and alternate only
the order of the attnd columns. For a table against the peers, --order rotates every column through every position
over as many processes as there are columns.

A/B of two builds in one process: --base_lib other/libattnd_kernels_c.so and configs named base:CONFIG run
CONFIG through that library (its column is base:CONFIG), so both builds see the same inputs, clocks and peers.

Schedule sweeps: --hopper max_blocks=3,split_tail=always,... sets the hopper family's schedule options of --lib's
plans (attnd_kernels_hopper_options; the rest keep their defaults). --base_lib's plans always run the defaults.
"""
import argparse
import ctypes
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import triton.testing


class HopperOptions(ctypes.Structure):
    """attnd_kernels_hopper_options (attention_c.h)."""
    _fields_ = [("max_blocks", ctypes.c_int32), ("split_tail", ctypes.c_int32), ("causal_order", ctypes.c_int32),
                ("max_paired_q_tiles", ctypes.c_int32), ("l2_section_bytes", ctypes.c_int64),
                ("paired_kv_bytes", ctypes.c_int64), ("tail_tiles_per_block", ctypes.c_int32),
                ("dynamic_min_tiles_per_block", ctypes.c_int32)]


# --hopper keys: the struct's fields, the byte sizes also in MiB, and the enums by name.
HOPPER_ENUMS = {"split_tail": {"off": 0, "auto": 1, "always": 2}, "causal_order": {"dynamic": 0, "static": 1}}
HOPPER_MB = {"l2_section_mb": "l2_section_bytes", "paired_kv_mb": "paired_kv_bytes"}


def parse_hopper(spec):
    """'max_blocks=3,split_tail=always' -> {field: int}."""
    out = {}
    fields = {f for f, _ in HopperOptions._fields_}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key in HOPPER_ENUMS:
            out[key] = HOPPER_ENUMS[key][value]
        elif key in HOPPER_MB:
            out[HOPPER_MB[key]] = int(value) << 20
        elif key in fields:
            out[key] = int(value)
        else:
            raise ValueError(f"--hopper: unknown option {key!r}")
    return out


class Attnd:
    def __init__(self, path, hopper=None):
        self.lib = ctypes.CDLL(path)
        L = self.lib
        self.options = None
        if hopper:
            if not hasattr(L, "attnd_kernels_plan_create_with_options"):
                raise RuntimeError(f"{path} has no attnd_kernels_plan_create_with_options: --hopper needs a newer build")
            self.options = HopperOptions()
            L.attnd_kernels_hopper_options_default(ctypes.byref(self.options))
            for key, value in hopper.items():
                setattr(self.options, key, value)
            L.attnd_kernels_plan_create_with_options.restype = ctypes.c_int
            L.attnd_kernels_plan_create_with_options.argtypes = [
                ctypes.POINTER(ctypes.c_int64), ctypes.c_int, ctypes.c_int, ctypes.c_float,
                ctypes.POINTER(ctypes.c_int64), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(HopperOptions), ctypes.c_int,
                ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_size_t]
        L.attnd_kernels_plan_create.restype = ctypes.c_int
        L.attnd_kernels_plan_create.argtypes = [
            ctypes.POINTER(ctypes.c_int64), ctypes.c_int, ctypes.c_int, ctypes.c_float,
            ctypes.POINTER(ctypes.c_int64), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_size_t]
        L.attnd_kernels_plan_launch.restype = ctypes.c_int
        L.attnd_kernels_plan_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
        L.attnd_kernels_plan_config.restype = ctypes.c_char_p
        L.attnd_kernels_plan_config.argtypes = [ctypes.c_void_p]
        L.attnd_kernels_plan_destroy.argtypes = [ctypes.c_void_p]

    def plan(self, q, k, v, o, causal, config):
        b, sq, hq, d = q.shape
        skv, hkv = k.shape[1], k.shape[2]
        shape = (ctypes.c_int64 * 6)(b, sq, skv, hq, hkv, d)
        strides = (ctypes.c_int64 * 12)(*[s for t in (q, k, v, o) for s in (t.stride(0), t.stride(1), t.stride(2))])
        out = ctypes.c_void_p()
        err = ctypes.create_string_buffer(512)
        args = (shape, 0, 1 if causal else 0, d ** -0.5, strides, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                o.data_ptr(), None, config.encode())
        if self.options is not None:  # the plan owns its workspace (1), as plan_create's do
            rc = self.lib.attnd_kernels_plan_create_with_options(*args, ctypes.byref(self.options), 1,
                                                                 ctypes.byref(out), err, 512)
        else:
            rc = self.lib.attnd_kernels_plan_create(*args, ctypes.byref(out), err, 512)
        if rc != 0:
            raise RuntimeError(f"plan_create({config}): {err.value.decode()}")
        name = self.lib.attnd_kernels_plan_config(out).decode()
        return out, name

    def launch(self, plan):
        err = ctypes.create_string_buffer(256)
        rc = self.lib.attnd_kernels_plan_launch(plan, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream), err,
                                                256)
        if rc != 0:
            raise RuntimeError(err.value.decode())


def rows(args):
    out = []
    seqs = [1024, 4096, 16384] if args.quick else [512, 1024, 2048, 4096, 8192, 16384]
    if args.seqs:
        seqs = [int(x) for x in args.seqs.split(",")]
    masks = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]
    batches = [int(x) for x in args.batches.split(",") if x]
    for d in (int(x) for x in args.head_dims.split(",")):
        for causal in masks:
            for s in seqs:
                for b in batches or [16384 // s]:
                    out.append(dict(batch=b, seq=s, hq=2048 // d, hkv=2048 // d, d=d, causal=causal))
    if args.gqa and "128" in args.head_dims.split(","):
        for causal in masks:  # GQA: 16 query heads over 2 kv heads (Llama-style group of 8)
            for s in ([4096, 16384] if args.quick else [1024, 4096, 16384]):
                if not args.seqs or s in seqs:
                    out.append(dict(batch=16384 // s, seq=s, hq=16, hkv=2, d=128, causal=causal))
    return out


def settle(fn, ms):
    """Runs fn back to back for about ms milliseconds, so that its timing starts from the clocks and power its own
    load settles at rather than from whatever ran before it."""
    if ms <= 0:
        return
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        for _ in range(4):
            fn()
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--configs", default="hopper,mma_sync", help="attnd configs/families, comma-separated")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default="")
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    ap.add_argument("--hopper", default="",
                    help="hopper schedule options of --lib's plans, e.g. max_blocks=3,split_tail=always,"
                         "causal_order=static,l2_section_mb=0,paired_kv_mb=64,max_paired_q_tiles=8,"
                         "tail_tiles_per_block=4,dynamic_min_tiles_per_block=6")
    # Narrowing, for sweeps that need a few rows in many processes (e.g. one per L2 section size).
    ap.add_argument("--head_dims", default="64,128,256")
    ap.add_argument("--causal", choices=("both", "no", "yes"), default="both")
    ap.add_argument("--seqs", default="", help="comma-separated; default: the full (or --quick) list")
    ap.add_argument("--gqa", action=argparse.BooleanOptionalAction, default=True)
    # Every FA3 row has 16k tokens, so at one head_dim all its rows have the same number of q tiles: a cost paid once
    # per launch and one paid per tile scale alike along --seqs. Several batches at one seq tell them apart.
    ap.add_argument("--batches", default="",
                    help="comma-separated batch sizes timed at every seq instead of FA3's 16k tokens (GQA rows keep it)")
    ap.add_argument("--peers", default="cudnn,fa2", help="torch SDPA backends timed beside attnd (cudnn, fa2)")
    ap.add_argument("--base_lib", default="", help="a second build, for configs named base:CONFIG")
    ap.add_argument("--peers_last", action="store_true",
                    help="time attnd's columns before the peers in each row (default: the peers first)")
    ap.add_argument("--order", default="",
                    help="the timing order of the columns in every row, comma-separated (attnd configs and peers; "
                         "overrides --peers_last); a column left out is timed after those named")
    ap.add_argument("--settle_ms", type=float, default=0,
                    help="run each column back to back this long right before timing it (default 0: as before)")
    args = ap.parse_args()
    attnd = Attnd(args.lib, parse_hopper(args.hopper))
    # ctypes loads with RTLD_LOCAL: each library keeps its own symbols and kernels.
    attnd_base = Attnd(args.base_lib) if args.base_lib else None
    configs = [c for c in args.configs.split(",") if c]
    peers = [x for x in args.peers.split(",") if x]
    order = [c for c in args.order.split(",") if c]
    unknown = [c for c in order if c not in configs and c not in peers]
    if unknown:
        ap.error(f"--order names columns that are not timed: {unknown}")
    torch.manual_seed(0)
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, cudnn {torch.backends.cudnn.version()}",
          flush=True)
    results = []
    header = f"{'d':>4} {'causal':>6} {'batch':>5} {'seq':>6} {'hq/hkv':>7} {'cuDNN':>7} {'FA2':>7}"
    for c in configs:
        header += f" {c[:18]:>18}"
    header += "  (TFLOP/s)   vs cuDNN"
    lines = [header]
    print(header, flush=True)
    for r in rows(args):
        b, s, hq, hkv, d, causal = r["batch"], r["seq"], r["hq"], r["hkv"], r["d"], r["causal"]
        q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16)
        flops = 4.0 * b * hq * s * s * d * (0.5 if causal else 1.0)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        gqa = hq != hkv
        res = dict(r)

        def sdpa(backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa)

        ref = None
        # Every column's output is checked first; the timings follow, in one order for the whole row (see
        # --peers_last and --settle_ms).
        peer_timers, attnd_timers, plans = [], [], []
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)):
            res[name] = None
            try:
                o = sdpa(backend)
                if ref is None:
                    ref = o.transpose(1, 2).float()
                if name in peers:
                    peer_timers.append((name, lambda backend=backend: sdpa(backend)))
            except Exception as e:  # a backend that refuses the shape (e.g. GQA) is reported, not fatal
                res[name + "_error"] = str(e).splitlines()[0][:200]
        if ref is None:
            ref = torch.nn.functional.scaled_dot_product_attention(qt.float(), kt.float(), vt.float(),
                                                                   is_causal=causal, enable_gqa=gqa).transpose(1, 2)
        for c in configs:
            lib, cname = (attnd_base, c[len("base:"):]) if c.startswith("base:") else (attnd, c)
            if "_d" in cname and f"_d{d}_" not in cname:  # a named configuration of another head_dim
                res[c] = None
                continue
            o = torch.full_like(q, float("nan"))
            try:
                if lib is None:
                    raise RuntimeError("base: configs need --base_lib")
                plan, name = lib.plan(q, k, v, o, causal, cname)
            except RuntimeError as e:
                res[c] = None
                res[c + "_error"] = str(e)[:200]
                continue
            lib.launch(plan)
            torch.cuda.synchronize()
            err = (o.float() - ref).abs().max().item()
            res[c + "_config"] = name
            res[c + "_maxdiff_vs_ref"] = err
            plans.append((lib, plan, o))  # o stays alive while its plan (which writes it) is timed
            res[c] = None
            if not (err < 0.05):
                res[c + "_error"] = f"max |O - ref| = {err}"
            else:
                attnd_timers.append((c, lambda lib=lib, plan=plan: lib.launch(plan)))
        timers = attnd_timers + peer_timers if args.peers_last else peer_timers + attnd_timers
        if order:  # stable: columns not named keep their relative order after the named ones
            timers.sort(key=lambda t: order.index(t[0]) if t[0] in order else len(order))
        res["timing_order"] = [col for col, _ in timers]
        for col, fn in timers:
            try:
                settle(fn, args.settle_ms)
                ms = triton.testing.do_bench(fn, rep=args.rep, return_mode="median")
                res[col] = flops / ms / 1e9
            except Exception as e:
                res[col] = None
                res[col + "_error"] = str(e).splitlines()[0][:200]
        for lib, plan, _ in plans:
            lib.lib.attnd_kernels_plan_destroy(plan)
        results.append(res)

        def f(x):
            return f"{x:7.1f}" if x is not None else "    n/a"

        line = f"{d:>4} {str(causal):>6} {b:>5} {s:>6} {f'{hq}/{hkv}':>7} {f(res['cudnn'])} {f(res['fa2'])}"
        for c in configs:
            x = res.get(c)
            failed = (c + "_error") in res
            line += f" {(f'{x:18.1f}' if x is not None else ('FAIL' if failed else '-').rjust(18))}"
        if res.get("cudnn") and res.get(configs[0]):
            line += f"   {res[configs[0]] / res['cudnn']:.2f}x"
        lines.append(line)
        print(line, flush=True)
        del q, k, v
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())

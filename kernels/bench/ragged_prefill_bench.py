#!/usr/bin/env python3
"""Times a ragged prefill into a paged KV cache the way the CUDA backend runs it, against the same prefill
kernels on contiguous K/V (the same total work), in one process on one GPU.

The batch: 16 sequences of 128 to 8,192 tokens (log-spaced), 32 q heads : 8 kv heads, head_dim 128, bf16. Each
sequence holds a cached prefix (the first half of its tokens, in pages of --page-sizes tokens placed in random
order in the pool) and prefills the second half as one chunk, which attends to its prefix and to itself
(bottom-right causal). The paged path is what a Step with those chunks costs on the GPU: the new K/V rows
appended into their pages (libattnd_decode_c.so), each sequence's keys gathered out of its pages into a
contiguous scratch (the prefill kernels' TMA boxes read one contiguous tensor), and the prefill kernel
(libattnd_kernels_c.so, bottom-right causal) per sequence. The contiguous path runs the same prefill kernels on
K/V already contiguous. Before timing, every paged output is compared with the contiguous one (the same kernel
on the same keys: equal) and the shortest and longest sequences with an fp32 reference in torch. Timing:
triton.testing.do_bench medians (L2 flushed between runs). TFLOP/s count 4 * D per visible (query, key) pair.

  python3 kernels/bench/ragged_prefill_bench.py --lib-dir build/kernels/cuda [--page-sizes 16,64] [--json out.json]
"""
import argparse
import ctypes
import json
import math
import os
import random
import sys

import torch
import triton.testing

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_bench import Layout  # noqa: E402  (the decode C ABI's layout struct)

HQ, HKV, D = 32, 8, 128
SEQS = 16
MIN_LEN, MAX_LEN = 128, 8192


def lengths():
    # Log-spaced from MIN_LEN to MAX_LEN, multiples of 16 so that every chunk is a whole number of rows.
    out = []
    for i in range(SEQS):
        x = MIN_LEN * (MAX_LEN / MIN_LEN) ** (i / (SEQS - 1))
        out.append(int(round(x / 16)) * 16)
    return out


class Libs:
    def __init__(self, lib_dir):
        self.k = ctypes.CDLL(os.path.join(lib_dir, "libattnd_kernels_c.so"))
        self.d = ctypes.CDLL(os.path.join(lib_dir, "libattnd_decode_c.so"))
        vp, i32p, i64p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int64)
        K = self.k
        K.attnd_kernels_plan_create.restype = ctypes.c_int
        K.attnd_kernels_plan_create.argtypes = [i64p, ctypes.c_int, ctypes.c_int, ctypes.c_float, i64p, vp, vp, vp,
                                                vp, vp, ctypes.c_char_p, ctypes.POINTER(vp), ctypes.c_char_p,
                                                ctypes.c_size_t]
        K.attnd_kernels_plan_launch.restype = ctypes.c_int
        K.attnd_kernels_plan_launch.argtypes = [vp, vp, ctypes.c_char_p, ctypes.c_size_t]
        K.attnd_kernels_plan_config.restype = ctypes.c_char_p
        K.attnd_kernels_plan_config.argtypes = [vp]
        K.attnd_kernels_plan_destroy.argtypes = [vp]
        Dl = self.d
        common = [ctypes.POINTER(Layout), ctypes.c_int, i32p, i32p, vp, vp, vp, vp, i32p, i32p, vp, vp, vp,
                  ctypes.c_char_p, ctypes.c_size_t]  # ..., kv_lens, block_table, k/v descales (16-bit: None), stream
        Dl.attnd_decode_append.restype = ctypes.c_int
        Dl.attnd_decode_append.argtypes = common
        Dl.attnd_decode_gather.restype = ctypes.c_int
        Dl.attnd_decode_gather.argtypes = common
        self.err = ctypes.create_string_buffer(512)

    def check(self, rc, what):
        if rc != 0:
            raise RuntimeError(f"{what}: {self.err.value.decode()}")

    def prefill_plan(self, q, k, v, o, kv_len):
        """Bottom-right causal prefill of q [1, C, HQ, D] over the first kv_len rows of k / v."""
        shape = (ctypes.c_int64 * 6)(1, q.shape[1], kv_len, HQ, HKV, D)
        strides = (ctypes.c_int64 * 12)(*[s for t in (q, k, v, o) for s in (t.stride(0), t.stride(1), t.stride(2))])
        out = ctypes.c_void_p()
        self.check(self.k.attnd_kernels_plan_create(shape, 0, 2, D ** -0.5, strides, q.data_ptr(), k.data_ptr(),
                                                    v.data_ptr(), o.data_ptr(), None, b"", ctypes.byref(out),
                                                    self.err, 512), "prefill plan")
        return out

    def launch(self, plan, stream):
        self.check(self.k.attnd_kernels_plan_launch(plan, stream, self.err, 512), "prefill launch")


def reference(q, k, v, prefix):
    """fp32 bottom-right causal attention of q [C, HQ, D] over k, v [L, HKV, D]."""
    c, L = q.shape[0], k.shape[0]
    qf = q.float().transpose(0, 1)                                    # [HQ, C, D]
    kf = k.float().repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)  # [HQ, L, D]
    vf = v.float().repeat_interleave(HQ // HKV, dim=1).transpose(0, 1)
    s = qf @ kf.transpose(1, 2) * D ** -0.5
    rows = torch.arange(c, device=q.device)[:, None]
    cols = torch.arange(L, device=q.device)[None, :]
    s = s.masked_fill(cols > prefix + rows, float("-inf"))
    return (torch.softmax(s, dim=-1) @ vf).transpose(0, 1)            # [C, HQ, D]


def run(libs, page, lens, stream_ptr):
    torch.manual_seed(0)
    rng = random.Random(1)
    dev = "cuda"
    chunks = [L // 2 for L in lens]
    prefixes = [L - c for L, c in zip(lens, chunks)]
    pages_of = [math.ceil(L / page) for L in lens]
    max_pages = max(pages_of)
    num_pages = sum(pages_of)
    order = list(range(num_pages))
    rng.shuffle(order)
    k_pool = torch.randn(num_pages, page, HKV, D, device=dev, dtype=torch.bfloat16)
    v_pool = torch.randn_like(k_pool)
    table = torch.zeros(SEQS, max_pages, dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages_of):
        table[b, :n] = torch.tensor(order[at:at + n], dtype=torch.int32)
        at += n
    d_table = table.to(dev)
    d_prefix = torch.tensor(prefixes, dtype=torch.int32, device=dev)
    d_lens = torch.tensor(lens, dtype=torch.int32, device=dev)

    ks, vs, qs, new_ks, new_vs, o_contig, o_paged = [], [], [], [], [], [], []
    for b, L in enumerate(lens):
        k = torch.randn(1, L, HKV, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        # Large logits on a few rows and channels, so that the softmax's max handling is exercised.
        k[:, ::97, :, :4] *= 8
        ks.append(k)
        vs.append(v)
        qs.append(torch.randn(1, chunks[b], HQ, D, device=dev, dtype=torch.bfloat16))
        new_ks.append(k[:, prefixes[b]:].contiguous())
        new_vs.append(v[:, prefixes[b]:].contiguous())
        o_contig.append(torch.full((1, chunks[b], HQ, D), float("nan"), device=dev, dtype=torch.bfloat16))
        o_paged.append(torch.full((1, chunks[b], HQ, D), float("nan"), device=dev, dtype=torch.bfloat16))
        # The cached prefix, written into its pages (untimed).
        rows = torch.arange(prefixes[b], device=dev)
        slots = d_table[b].long()[rows // page]
        k_pool[slots, rows % page] = k[0, :prefixes[b]]
        v_pool[slots, rows % page] = v[0, :prefixes[b]]
    gk = torch.empty(1, max(lens), HKV, D, device=dev, dtype=torch.bfloat16)
    gv = torch.empty_like(gk)

    def layout_for(b):
        l = Layout()
        l.batch, l.q_len, l.q_heads, l.kv_heads, l.head_dim, l.dtype = 1, 1, HKV, HKV, D, 0
        l.causal, l.want_lse, l.scale = 0, 0, D ** -0.5
        l.q_strides[:] = [HKV * D, HKV * D, D]
        l.o_strides[:] = [HKV * D, HKV * D, D]
        l.k_strides[:] = list(k_pool.stride()[:3])
        l.v_strides[:] = list(v_pool.stride()[:3])
        l.paged, l.kv_capacity, l.page_size, l.num_pages, l.max_pages_per_seq = 1, 0, page, num_pages, max_pages
        return l

    layouts = [layout_for(b) for b in range(SEQS)]
    i32p = ctypes.POINTER(ctypes.c_int32)
    host_table = [(ctypes.c_int32 * max_pages)(*table[b].tolist()) for b in range(SEQS)]
    host_prefix = [(ctypes.c_int32 * 1)(p) for p in prefixes]
    host_len = [(ctypes.c_int32 * 1)(L) for L in lens]
    row_ptr = lambda t, b: ctypes.cast(t.data_ptr() + b * t.stride(0) * t.element_size(), i32p)
    paged_plans = [libs.prefill_plan(qs[b], gk, gv, o_paged[b], lens[b]) for b in range(SEQS)]
    contig_plans = [libs.prefill_plan(qs[b], ks[b], vs[b], o_contig[b], lens[b]) for b in range(SEQS)]
    config = libs.k.attnd_kernels_plan_config(contig_plans[-1]).decode()
    err = libs.err

    def append_all():
        for b in range(SEQS):
            libs.check(libs.d.attnd_decode_append(ctypes.byref(layouts[b]), chunks[b], host_prefix[b], host_table[b],
                                                  new_ks[b].data_ptr(), new_vs[b].data_ptr(), k_pool.data_ptr(),
                                                  v_pool.data_ptr(), row_ptr(d_prefix, b), row_ptr(d_table, b),
                                                  None, None, stream_ptr, err, 512), "append")

    def gather(b):
        libs.check(libs.d.attnd_decode_gather(ctypes.byref(layouts[b]), max(lens), host_len[b], host_table[b],
                                              k_pool.data_ptr(), v_pool.data_ptr(), gk.data_ptr(), gv.data_ptr(),
                                              row_ptr(d_lens, b), row_ptr(d_table, b), None, None, stream_ptr, err,
                                              512),
                   "gather")

    def paged():
        append_all()
        for b in range(SEQS):
            gather(b)
            libs.launch(paged_plans[b], stream_ptr)

    def gathers_only():
        for b in range(SEQS):
            gather(b)

    def contiguous():
        for b in range(SEQS):
            libs.launch(contig_plans[b], stream_ptr)

    paged()
    contiguous()
    torch.cuda.synchronize()
    worst = 0.0
    for b in range(SEQS):
        if not torch.equal(o_paged[b], o_contig[b]):
            diff = (o_paged[b].float() - o_contig[b].float()).abs().max().item()
            raise RuntimeError(f"sequence {b} (len {lens[b]}): paged output differs from contiguous by {diff}")
    for b in (0, SEQS - 1):
        ref = reference(qs[b][0], ks[b][0], vs[b][0], prefixes[b])
        worst = max(worst, (o_paged[b][0].float() - ref).abs().max().item())
    if not math.isfinite(worst) or worst > 2e-2:
        raise RuntimeError(f"paged output differs from the fp32 reference by {worst}")

    flops = sum(4.0 * D * HQ * sum(p + i + 1 for i in range(c)) for p, c in zip(prefixes, chunks))
    t_paged = triton.testing.do_bench(paged, return_mode="median")
    t_contig = triton.testing.do_bench(contiguous, return_mode="median")
    t_append = triton.testing.do_bench(append_all, return_mode="median")
    t_gather = triton.testing.do_bench(gathers_only, return_mode="median")
    for p in paged_plans + contig_plans:
        libs.k.attnd_kernels_plan_destroy(p)
    return {
        "page_size": page, "lens": lens, "config": config, "max_abs_diff_vs_fp32": worst,
        "paged_ms": t_paged, "contiguous_ms": t_contig, "append_ms": t_append, "gathers_ms": t_gather,
        "paged_tflops": flops / t_paged / 1e9, "contiguous_tflops": flops / t_contig / 1e9,
        "x_contiguous": t_contig / t_paged,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib-dir", default="build/kernels/cuda")
    ap.add_argument("--page-sizes", default="16,64")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    libs = Libs(args.lib_dir)
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    lens = lengths()
    print(f"# {torch.cuda.get_device_name()}, {SEQS} sequences, lengths {lens}, {HQ}:{HKV} heads, d{D}, bf16; "
          "each prefills its second half over its first (bottom-right causal)")
    print("| KV | pages | attnd paged ms | TFLOP/s | append ms | gathers ms | contiguous ms | TFLOP/s | paged / contiguous |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for page in [int(x) for x in args.page_sizes.split(",")]:
        r = run(libs, page, lens, stream)
        rows.append(r)
        print(f"| paged | {page} | {r['paged_ms']:.3f} | {r['paged_tflops']:.0f} | {r['append_ms']:.3f} | "
              f"{r['gathers_ms']:.3f} | {r['contiguous_ms']:.3f} | {r['contiguous_tflops']:.0f} | "
              f"{r['x_contiguous']:.2f} |", flush=True)
    print(f"# prefill configuration of the longest sequence: {rows[-1]['config']}; outputs equal to contiguous, "
          f"within {max(r['max_abs_diff_vs_fp32'] for r in rows):.4f} of fp32 on the shortest and longest")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

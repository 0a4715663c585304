#!/usr/bin/env python3
"""Times attnd's decode kernels (contiguous and paged KV) against torch SDPA's cuDNN and FLASH backends and a
read-only pass over the same K/V bytes (the bandwidth ceiling), all in one process on one GPU.

With --kv-formats bf16,fp8 each storage is also timed over an e4m3 copy of the same K/V (per-kv-head descales
amax / 448), checked against the fp32 reference over the values its codes stand for, its GB/s and ceiling counted in
the bytes it reads (half).

Each row: batch x kv_len with 32 q heads : 8 kv heads (64 : 8 for 128 x 8k; any BxL:Hq:Hkv as --rows), head_dim 128
(--head-dim), bf16, each q_len of --q-lens (bottom-right causal when > 1). Our kernels run through
libattnd_decode_c.so (ctypes; plan once, launch on torch's current stream); the peers get the same data as
[B, H, S, D] views of contiguous KV, with GQA. Before timing, every output is checked against an fp32 reference in
torch on the same inputs. Timing is triton.testing.do_bench's median (it flushes the L2 between calls). GB/s count
the K and V bytes read once.

do_bench flushes by writing 256 MB, which leaves the L2 full of dirty lines: the timed call then also writes back
what its reads evict (about 11 MB for a 34 MB read on the H100), a cost every column pays and that weighs most on the
small rows. `--l2 clean` flushes by reading 256 MB instead (each call then starts from clean lines), to tell the two
apart; the tables in docs/benchmarks.md use the default.

  python3 kernels/bench/decode_bench.py --lib build/kernels/cuda/libattnd_decode_c.so [--q-lens 1,4,16]
      [--storages contig,paged16,paged64] [--rows 64x4k,1x32k,16x32k:8:1] [--json out.json]
"""
import argparse
import ctypes
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

# batch, kv_len, q_heads, kv_heads: the rows of the decode table in docs/benchmarks.md.
ROWS = {
    "64x4k": (64, 4096, 32, 8),
    "128x8k": (128, 8192, 64, 8),
    "8x32k": (8, 32768, 32, 8),
    "2x128k": (2, 131072, 32, 8),
    "1x4k": (1, 4096, 32, 8),
    "1x8k": (1, 8192, 32, 8),
    "1x32k": (1, 32768, 32, 8),
    "16x4k": (16, 4096, 32, 8),
}
HEAD_DIM = 128  # --head-dim
TABLE_ORDER = "random"  # --table-order


def parse_row(name):
    """A row of ROWS, or any BxL[:Hq:Hkv] (L in tokens, k = 1024, a multiple of 64 so that every page size divides
    it; 32:8 heads by default), e.g. 16x32k:8:1."""
    if name in ROWS:
        return ROWS[name]
    shape, _, heads = name.partition(":")
    try:
        b, _, l = shape.partition("x")
        kv_len = int(l[:-1]) * 1024 if l.endswith("k") else int(l)
        hq, hkv = (int(h) for h in heads.split(":")) if heads else (32, 8)
        if int(b) < 1 or kv_len < 64 or kv_len % 64 or hkv < 1 or hq % hkv:
            raise ValueError
        return int(b), kv_len, hq, hkv
    except ValueError:
        raise SystemExit(f"--rows: {name!r} is neither a named row ({', '.join(ROWS)}) nor BxL[:Hq:Hkv] "
                         "(L a multiple of 64, Hq of Hkv)") from None


class Layout(ctypes.Structure):
    _fields_ = [
        ("batch", ctypes.c_int32), ("q_len", ctypes.c_int32), ("q_heads", ctypes.c_int32),
        ("kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32), ("dtype", ctypes.c_int32),
        ("causal", ctypes.c_int32), ("want_lse", ctypes.c_int32), ("scale", ctypes.c_float),
        ("q_strides", ctypes.c_int64 * 3), ("o_strides", ctypes.c_int64 * 3), ("k_strides", ctypes.c_int64 * 3),
        ("v_strides", ctypes.c_int64 * 3), ("paged", ctypes.c_int32), ("kv_capacity", ctypes.c_int32),
        ("page_size", ctypes.c_int32), ("num_pages", ctypes.c_int32), ("max_pages_per_seq", ctypes.c_int32),
        ("kv_format", ctypes.c_int32),
    ]


class Decode:
    def __init__(self, path):
        L = self.lib = ctypes.CDLL(path)
        vp, i32p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32)
        L.attnd_decode_plan_create.restype = ctypes.c_int
        L.attnd_decode_plan_create.argtypes = [ctypes.POINTER(Layout), i32p, i32p, ctypes.c_int, ctypes.c_int,
                                               ctypes.POINTER(vp), ctypes.c_char_p, ctypes.c_size_t]
        L.attnd_decode_plan_workspace_bytes.restype = ctypes.c_size_t
        L.attnd_decode_plan_workspace_bytes.argtypes = [vp]
        L.attnd_decode_plan_counter_bytes.restype = ctypes.c_size_t
        L.attnd_decode_plan_counter_bytes.argtypes = [vp]
        L.attnd_decode_plan_num_splits.restype = ctypes.c_int
        L.attnd_decode_plan_num_splits.argtypes = [vp]
        L.attnd_decode_launch.restype = ctypes.c_int
        L.attnd_decode_launch.argtypes = [vp] * 10 + [vp, vp, vp, ctypes.c_char_p, ctypes.c_size_t]
        L.attnd_decode_plan_destroy.argtypes = [vp]
        self.err = ctypes.create_string_buffer(1024)

    def plan(self, layout, lens_host, table_host, num_splits=0):
        lens = (ctypes.c_int32 * len(lens_host))(*lens_host)
        table = (ctypes.c_int32 * len(table_host))(*table_host) if table_host else None
        out = ctypes.c_void_p()
        rc = self.lib.attnd_decode_plan_create(ctypes.byref(layout), lens, table, num_splits, 0, ctypes.byref(out),
                                               self.err, len(self.err))
        if rc != 0:
            raise RuntimeError(self.err.value.decode())
        return out

    def launch(self, plan, q, k, v, o, lens, table, ws, counters, stream, descales=None):
        ptr = lambda t: t.data_ptr() if t is not None else None
        kd, vd = descales if descales is not None else (None, None)
        rc = self.lib.attnd_decode_launch(plan, q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), None,
                                          lens.data_ptr(), ptr(table), ptr(kd), ptr(vd), ptr(ws), ptr(counters),
                                          stream, self.err, len(self.err))
        if rc != 0:
            raise RuntimeError(self.err.value.decode())


@triton.jit
def _read_only_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    # Each program reads one block of int32 words and stores their sum: a pure read of the buffer, spread over
    # enough programs to fill the GPU even for the smallest rows.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0, cache_modifier=".cg")
    tl.store(out_ptr + tl.program_id(0), tl.sum(x, axis=0))


L2_FLUSH = "dirty"  # --l2
_CLEAN_FLUSH = []  # the read pass --l2 clean flushes with, made once


def read_pass(nbytes):
    """A call that reads nbytes of a buffer of its own with _read_only_kernel (the buffer lives as long as the call)."""
    words = nbytes // 4
    x = torch.empty(words, dtype=torch.int32, device="cuda")
    grid = triton.cdiv(words, 4096)
    out = torch.empty(grid, dtype=torch.int32, device="cuda")
    return lambda: _read_only_kernel[(grid,)](x, out, words, BLOCK=4096, num_warps=8)


def time_ms(fn, rep_ms=100):
    """Median ms of fn: do_bench's, or with --l2 clean the same protocol (events around each call after a flush,
    about rep_ms of calls) with the flush by reading."""
    if L2_FLUSH == "dirty":
        return triton.testing.do_bench(fn, return_mode="median")
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    torch.cuda.synchronize()
    n = max(10, min(1000, int(rep_ms / max(start.elapsed_time(end) / 5, 1e-3))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    if not _CLEAN_FLUSH:
        _CLEAN_FLUSH.append(read_pass(256 << 20))  # evicts the L2, leaving it full of clean lines
    for s, e in events:
        _CLEAN_FLUSH[0]()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in events)
    return times[len(times) // 2]


def read_only_ms(nbytes):
    return time_ms(read_pass(nbytes))


def reference(q, k, v, causal):
    """fp32 attention with GQA and bottom-right causal, in batch chunks (bounded memory), as [B, q_len, Hq, D]."""
    B, q_len, Hq, D = q.shape
    L, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    out = torch.empty(B, q_len, Hq, D, device="cuda", dtype=torch.float32)
    chunk = max(1, (1 << 29) // (Hkv * G * q_len * L + Hkv * L * D))
    scale = 1.0 / math.sqrt(D)
    pos = torch.arange(q_len, device="cuda").repeat(G)  # row r = h * q_len + i
    keep = torch.arange(L, device="cuda")[None, :] <= pos[:, None] + (L - q_len)
    for b0 in range(0, B, chunk):
        b1 = min(B, b0 + chunk)
        n = b1 - b0
        qg = q[b0:b1].view(n, q_len, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(n, Hkv, G * q_len, D).float()
        s = qg @ k[b0:b1].permute(0, 2, 3, 1).float() * scale
        if causal:
            s = s.masked_fill(~keep, float("-inf"))
        o = torch.softmax(s, dim=-1) @ v[b0:b1].permute(0, 2, 1, 3).float()
        out[b0:b1] = o.view(n, Hkv, G, q_len, D).permute(0, 3, 1, 2, 4).reshape(n, q_len, Hq, D)
    return out


def quantize_fp8(x):
    """Per-kv-head e4m3 codes of x [B, L, Hkv, D] with descale amax / 448, and the values they stand for."""
    descale = (x.float().abs().amax(dim=(0, 1, 3)) / 448.0).contiguous()
    codes = (x.float() / descale[None, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return codes, descale, codes.float() * descale[None, None, :, None]


def run_case(dec, name, B, L, Hq, Hkv, q_len, storages, num_splits, formats=("bf16",)):
    D = HEAD_DIM
    dtype = torch.bfloat16
    torch.manual_seed(0)
    q = torch.randn(B, q_len, Hq, D, device="cuda", dtype=dtype)
    k = torch.randn(B, L, Hkv, D, device="cuda", dtype=dtype)
    v = torch.randn(B, L, Hkv, D, device="cuda", dtype=dtype)
    causal = q_len > 1
    kv_bytes = 2 * k.numel() * k.element_size()
    stream = torch.cuda.current_stream().cuda_stream
    lens_host = [L] * B
    lens = torch.tensor(lens_host, dtype=torch.int32, device="cuda")

    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    ref = reference(q, k, v, causal)
    row = {"row": name, "B": B, "kv_len": L, "Hq": Hq, "Hkv": Hkv, "q_len": q_len, "kv_bytes": kv_bytes,
           "ceiling_ms": read_only_ms(kv_bytes), "peers": {}, "ours": {}}
    fp8 = {}
    if "fp8" in formats:
        k8, kd, kq = quantize_fp8(k)
        v8, vd, vq = quantize_fp8(v)
        fp8 = {"k": k8, "v": v8, "descales": (kd, vd), "ref": reference(q, kq, vq, causal)}
        del kq, vq
        row["ceiling8_ms"] = read_only_ms(kv_bytes // 2)

    for label, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        # Bottom-right causal as the peers take it: torch's lower-right causal bias. A backend that refuses the
        # bias is timed without a mask (a mask changes little of a decode's time) and its row says so.
        attempts = [{"enable_gqa": True}]
        if causal:
            from torch.nn.attention.bias import causal_lower_right
            attempts.insert(0, {"enable_gqa": True, "attn_mask": causal_lower_right(q_len, L)})
        errors = []
        for kwargs in attempts:
            def call(backend=backend, kwargs=kwargs):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qt, kt, vt, **kwargs)
            try:
                out = call()
                torch.cuda.synchronize()
            except Exception as e:  # the backend refuses this shape or mask
                errors.append(str(e).splitlines()[0][:160])
                continue
            entry = {"ms": time_ms(call),
                     "max_abs_diff": (out.transpose(1, 2).float() - ref).abs().max().item()}
            if causal and "attn_mask" not in kwargs:
                entry["mask"] = "none"
            row["peers"][label] = entry
            break
        else:
            row["peers"][label] = {"error": "; ".join(errors)}

    for storage, fmt_ in [(s, f) for s in storages for f in formats]:
        key = storage if fmt_ == "bf16" else storage + "/fp8"
        src_k, src_v = (k, v) if fmt_ == "bf16" else (fp8["k"], fp8["v"])
        layout = Layout()
        layout.kv_format = 1 if fmt_ == "fp8" else 0
        layout.batch, layout.q_len, layout.q_heads, layout.kv_heads, layout.head_dim = B, q_len, Hq, Hkv, D
        layout.dtype, layout.causal, layout.want_lse, layout.scale = 0, int(causal), 0, 1.0 / math.sqrt(D)
        layout.q_strides[:] = list(q.stride()[:3])
        o = torch.full_like(q, float("nan"))
        layout.o_strides[:] = list(o.stride()[:3])
        table_host, table = [], None
        if storage == "contig":
            kk, vv = src_k, src_v
            layout.paged, layout.kv_capacity = 0, L
        else:
            ps = int(storage[len("paged"):])
            npp = L // ps
            # Pages in a random order (a pool after churn), or each sequence's pages adjacent (a pool that handed
            # them out in order).
            perm = (torch.randperm(B * npp, device="cuda") if TABLE_ORDER == "random"
                    else torch.arange(B * npp, device="cuda"))
            kk = torch.empty(B * npp, ps, Hkv, D, device="cuda", dtype=src_k.dtype)
            vv = torch.empty_like(kk)
            kk.view(torch.uint8 if fmt_ == "fp8" else dtype)[perm] = (
                src_k.reshape(B * npp, ps, Hkv, D).view(torch.uint8 if fmt_ == "fp8" else dtype))
            vv.view(torch.uint8 if fmt_ == "fp8" else dtype)[perm] = (
                src_v.reshape(B * npp, ps, Hkv, D).view(torch.uint8 if fmt_ == "fp8" else dtype))
            table = perm.to(torch.int32).reshape(B, npp).contiguous()
            table_host = table.flatten().tolist()
            layout.paged, layout.page_size, layout.num_pages, layout.max_pages_per_seq = 1, ps, B * npp, npp
        layout.k_strides[:] = list(kk.stride()[:3])
        layout.v_strides[:] = list(vv.stride()[:3])
        try:
            plan = dec.plan(layout, lens_host, table_host, num_splits)
        except RuntimeError as e:
            row["ours"][key] = {"error": str(e)[:160]}
            continue
        ws_bytes = dec.lib.attnd_decode_plan_workspace_bytes(plan)
        ws = torch.empty(max(ws_bytes, 16), dtype=torch.uint8, device="cuda") if ws_bytes else None
        counter_bytes = dec.lib.attnd_decode_plan_counter_bytes(plan)
        # Zeroed once: every launch leaves its split counters zero.
        counters = torch.zeros(counter_bytes // 4, dtype=torch.int32, device="cuda") if counter_bytes else None
        descales = fp8["descales"] if fmt_ == "fp8" else None
        fn = lambda: dec.launch(plan, q, kk, vv, o, lens, table, ws, counters, stream, descales)
        fn()
        torch.cuda.synchronize()
        # Float8 against the reference over the values its codes stand for.
        diff = (o.float() - (fp8["ref"] if fmt_ == "fp8" else ref)).abs().max().item()
        entry = {"splits": dec.lib.attnd_decode_plan_num_splits(plan), "max_abs_diff": diff}
        if not math.isfinite(diff) or diff > 2e-2:
            entry["error"] = f"output differs from the fp32 reference by {diff}"
        else:
            entry["ms"] = time_ms(fn)
        row["ours"][key] = entry
        dec.lib.attnd_decode_plan_destroy(plan)
        del kk, vv, ws, counters
    del q, k, v, ref, fp8
    torch.cuda.empty_cache()
    return row


def fmt(row, storages, formats=("bf16",)):
    peer = {k: p.get("ms") for k, p in row["peers"].items()}
    lines = []
    for s, f in [(s, f) for s in storages for f in formats]:
        fp8 = f == "fp8"
        key = s + "/fp8" if fp8 else s
        # GB/s of the bytes this format reads, against the read-only pass over as many bytes.
        nbytes = row["kv_bytes"] // 2 if fp8 else row["kv_bytes"]
        gbs = lambda ms: nbytes / (ms * 1e-3) / 1e9
        ceil_gbs = gbs(row["ceiling8_ms"] if fp8 else row["ceiling_ms"])
        contig_ms = row["ours"].get("contig/fp8" if fp8 else "contig", {}).get("ms")
        e = row["ours"].get(key, {})
        ms = e.get("ms")
        cells = [row["row"], f'{row["Hq"]}:{row["Hkv"]}', str(row["q_len"]), key]
        if ms is None:
            cells += ["err: " + e.get("error", "?")] + ["n/a"] * (9 if len(formats) > 1 else 8)
        else:
            cells += [f"{ms * 1e3:.1f}", f"{gbs(ms):,.0f}", f"{ceil_gbs:,.0f}", f"{gbs(ms) / ceil_gbs:.2f}"]
            for label in ("cudnn", "flash"):
                unmasked = "*" if row["peers"].get(label, {}).get("mask") == "none" else ""
                cells.append(f"{peer[label] * 1e3:.1f}{unmasked}" if peer.get(label) else "n/a")
            for label in ("cudnn", "flash"):
                cells.append(f"{peer[label] / ms:.2f}" if peer.get(label) else "n/a")
            cells.append(f"{contig_ms / ms:.2f}" if contig_ms and s != "contig" else "")
            if len(formats) > 1:  # float8's speed-up over the same storage in bf16
                bf16_ms = row["ours"].get(s, {}).get("ms")
                cells.append(f"{bf16_ms / ms:.2f}" if fp8 and bf16_ms else "")
        cells.append(str(e.get("splits", "")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default="build/kernels/cuda/libattnd_decode_c.so")
    ap.add_argument("--rows", default=",".join(ROWS), help="named rows or BxL[:Hq:Hkv], e.g. 16x32k:8:1")
    ap.add_argument("--q-lens", default="1,4,16")
    ap.add_argument("--storages", default="contig,paged16,paged64")
    ap.add_argument("--num-splits", type=int, default=0, help="0: the plan's heuristic")
    ap.add_argument("--table-order", choices=("random", "sequential"), default="random",
                    help="paged KV: page order in the pool")
    ap.add_argument("--head-dim", type=int, choices=(64, 128, 256), default=128,
                    help="every row's head_dim (the table in docs/benchmarks.md is at 128)")
    ap.add_argument("--kv-formats", default="bf16",
                    help="bf16 and/or fp8 (e4m3 K/V, per-kv-head descales; each row then also its fp8 / bf16 speed-up)")
    ap.add_argument("--l2", choices=("dirty", "clean"), default="dirty",
                    help="the L2 flush before each timed call: do_bench's write (dirty lines) or a read (clean)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    formats = tuple(args.kv_formats.split(","))
    global TABLE_ORDER, HEAD_DIM, L2_FLUSH
    TABLE_ORDER = args.table_order
    L2_FLUSH = args.l2
    HEAD_DIM = args.head_dim
    dec = Decode(os.path.abspath(args.lib))
    storages = args.storages.split(",")
    dev = torch.cuda.get_device_properties(0)
    print("# env:", json.dumps({"device": dev.name, "sms": dev.multi_processor_count, "torch": torch.__version__,
                                "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
                                "triton": triton.__version__, "l2_flush": L2_FLUSH}), flush=True)
    extra = " x bf16 |" if len(formats) > 1 else ""
    print("| B x kv_len | Hq:Hkv | q_len | KV | attnd µs | GB/s | ceiling GB/s | x ceiling | cuDNN µs | FLASH µs"
          " | x cuDNN | x FLASH | paged / contig |" + extra + " splits |")
    print("|---" * (14 + (len(formats) > 1)) + "|", flush=True)
    rows = []
    for name in args.rows.split(","):
        B, L, Hq, Hkv = parse_row(name)
        for q_len in (int(x) for x in args.q_lens.split(",")):
            row = run_case(dec, name, B, L, Hq, Hkv, q_len, storages, args.num_splits, formats)
            rows.append(row)
            print(fmt(row, storages, formats), flush=True)
    print("# * : the peer refused the bottom-right causal bias and ran without a mask", flush=True)
    for row in rows:
        for label, p in row["peers"].items():
            if "error" in p:
                print(f"#   {row['row']} q_len {row['q_len']} {label}: {p['error']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

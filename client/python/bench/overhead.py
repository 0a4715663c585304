#!/usr/bin/env python3
"""Per-call latency of the Python client against a running attnd, for comparison with the C++ tools on the same
server and shape (scripts/device.sh service pyoverhead runs both side by side):

- forward: torch CUDA tensors by CUDA IPC over the shared-memory channel, batch 1, seq S, 32 heads, head_dim 128,
  causal, bf16, O into a preallocated tensor (`ipc_peer bench --transport=shm` times the same call in C++);
- step: a KV-sequence decode step over the shared-memory channel, one sequence, 32 q : 8 kv heads, head_dim 128,
  kv 4k, NumPy inputs, O into a preallocated array (`attn bench --workload=decode --transport=shm` times the
  same step in C++).

"Outside the channel call" is each call's time less the C++ client's own latency of the shared-memory exchange
(ForwardInfo.latency_us, about the span ipc_peer and attn bench time): what the Python layer and the C ABI add.

  python3 client/python/bench/overhead.py --target unix:/tmp/attnd.sock --shm-socket /tmp/attnd_shm.sock
"""
import argparse
import statistics
import time

import numpy as np

import attnd


def percentile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def report(name, lat_us, extra=""):
    print(f"{name}: calls {len(lat_us)}, p50 {statistics.median(lat_us):.1f} us, p90 {percentile(lat_us, 90):.1f} us,"
          f" p99 {percentile(lat_us, 99):.1f} us{extra}")


def bench_forward(client, seq, iters):
    import torch
    shape = (1, seq, 32, 128)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    o = torch.empty_like(q)
    torch.cuda.synchronize()
    for _ in range(50):
        client.attention(q, k, v, causal=True, out=o)
    lat, srv, outside = [], [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        client.attention(q, k, v, causal=True, out=o)
        lat.append((time.perf_counter() - t0) * 1e6)
        srv.append(client.last_info.total_us)
        outside.append(lat[-1] - client.last_info.latency_us)
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           is_causal=True).transpose(1, 2)
    err = (o.float() - ref.float()).abs().max().item()
    report(f"python forward ipc shm seq {seq}", lat, f"; server total mean {statistics.mean(srv):.1f} us; "
           f"outside the channel call p50 {statistics.median(outside):.1f} us; max |O - torch| {err:.4f}")


def bench_step(client, context, iters):
    rng = np.random.default_rng(1)
    seq = client.open_sequence(layers=1, kv_heads=8, head_dim=128)

    def rows(n, heads):
        return rng.standard_normal((n, heads, 128)).astype(np.float32).view(np.uint32).__rshift__(16).astype(np.uint16)

    for start in range(0, context, 1024):
        n = min(1024, context - start)
        client.step(0, [seq], q=None, k=rows(n, 8), v=rows(n, 8), dtype="bf16")
    q, k, v = rows(1, 32), rows(1, 8), rows(1, 8)
    o = np.empty_like(q)
    for _ in range(20):
        client.step(0, [seq], q=q, k=k, v=v, q_heads=32, dtype="bf16", out=o)
    lat, outside = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        client.step(0, [seq], q=q, k=k, v=v, q_heads=32, dtype="bf16", out=o)
        lat.append((time.perf_counter() - t0) * 1e6)
        outside.append(lat[-1] - client.last_info.latency_us)
    seq.close()
    report(f"python step shm kv {context}", lat, f"; outside the channel call p50 {statistics.median(outside):.1f} us")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--shm-socket", required=True)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--what", default="forward,step")
    a = ap.parse_args()
    client = attnd.Client(a.target, transport="shm", shm_socket=a.shm_socket)
    if "forward" in a.what:
        bench_forward(client, a.seq, a.iters)
    if "step" in a.what:
        bench_step(client, a.context, a.iters)


if __name__ == "__main__":
    main()

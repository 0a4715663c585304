#!/usr/bin/env python3
"""Decode steps from a PyTorch caller with torch CUDA tensors, against a running attnd on this host (CUDA backend,
--enable_cuda_ipc, --shm_socket), beside the server's own kernel time for the same steps (docs/benchmarks.md,
"KV sequences from PyTorch"). 32 q : 8 kv heads, head_dim 128, bf16, kv 4k (--context).

- one sequence: a dependent chain as in decoding, each step's Q produced on the stream from the previous step's O
  (a copy kernel), then the step, ordered on the stream. The step time is the interval between consecutive steps'
  completions on the GPU (CUDA events recorded after each step), so it includes everything a step costs the
  engine's stream: the producer, the round trip to the server and its enqueue, the waits and the kernels. The
  kernel alone is the server's kernel_us of the same steps with NumPy inputs (host order).
- N sequences (--sequences, 64) in one StepBatch from one caller, and from two caller processes of N/2 each: decode
  tokens per second against the kernel-only rate (N / the kernel time of one step of all N).

Each is run twice: with steps that return after they ran ("wait", StepBatch wait=True) and with steps that return
before ("submit", wait=False: the stream waits for the step on the GPU, the host runs ahead).

Every step appends a key, and the kernel's time grows with the keys: each measurement starts from sequences cut back to
--context keys (TruncateSequence), and the kernel-only reference is taken over the same steps from the same keys (its
warm-up steps too), so that both sides do the same work.

  python3 client/python/bench/cuda_steps.py --target unix:/tmp/attnd.sock --shm-socket /tmp/attnd_shm.sock
"""
import argparse
import json
import multiprocessing as mp
import statistics
import time

import numpy as np

KV, HQ, D = 8, 32, 128


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def client_for(a):
    import attnd
    return attnd.Client(a.target, transport="shm", shm_socket=a.shm_socket)


def fill(batch, n, context, torch):
    """Appends `context` random keys to each of the batch's n sequences (append-only steps of at most 64k rows)."""
    chunk = max(1, min(context, 65536 // n))
    done = 0
    while done < context:
        t = min(chunk, context - done)
        k = torch.randn((n * t, KV, D), device="cuda", dtype=torch.bfloat16)
        batch.step(0, k=k, v=k.clone(), tokens=t)
        done += t
    torch.cuda.synchronize()


def cut_back(client, seqs, context):
    """Cuts each of `seqs` back to its first `context` keys (what fill() appended)."""
    for s in seqs:
        client.truncate_sequence(s, context)


def kernel_us(client, seqs, context, warm, steps):
    """The server's kernel time of the decode steps of `seqs` that a chain of `warm` + `steps` from `context` keys
    measures (NumPy inputs: host order, so each reply has it): (mean, median) over the last `steps`. The sequences are
    cut back to `context` keys first (each chain cuts them back again before it runs)."""
    rng = np.random.default_rng(0)
    n = len(seqs)
    q = rng.standard_normal((n, HQ, D)).astype(np.float32).view(np.uint32).__rshift__(16).astype(np.uint16)
    k = q[:, :KV].copy()
    cut_back(client, seqs, context)
    times = []
    for i in range(warm + steps):
        client.step(0, seqs, q=q, k=k, v=k, dtype="bf16")
        if i >= warm:
            times.append(client.last_info.kernel_us)
    return statistics.mean(times), statistics.median(times)


INFO = ("queue_us", "h2d_us", "kernel_us", "total_us", "latency_us")


def chain(batch, n, steps, torch, events=False, infos=None):
    """`steps` dependent decode steps: Q from the previous O on the stream, then the step. Returns the wall time, the
    host time of each call, and (events) the GPU interval between consecutive steps' completions. `infos` (a list,
    steps that wait) receives each step's server timing (INFO) as the reply gave it."""
    q = torch.randn((n, HQ, D), device="cuda", dtype=torch.bfloat16)
    k = torch.randn((n, KV, D), device="cuda", dtype=torch.bfloat16)
    o = torch.empty_like(q)
    evs = [torch.cuda.Event(enable_timing=True) for _ in range(steps)] if events else None
    calls = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        q.copy_(o) if i else None
        c0 = time.perf_counter()
        batch.step(0, q, k, k, out=o)
        calls.append((time.perf_counter() - c0) * 1e6)
        if infos is not None and batch.wait:
            infos.append([getattr(batch.last_info, f) for f in INFO])
        if events:
            evs[i].record()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    gaps = [evs[i - 1].elapsed_time(evs[i]) * 1e3 for i in range(1, steps)] if events else []
    return wall, calls, gaps


MODES = (("wait", True), ("submit", False))
WARM_MANY = 20  # steps before a measured chain of many sequences


def breakdown(label, gaps, infos):
    """Where a waiting step's time goes: the p50 of each server timing beside the step interval on the stream.
    queue: from the server reading the step to its launch (admission, the wait for the caller's stream, the hand-over
    to a device worker); total - queue - kernel: staging, launch and completion; latency: the client's channel call."""
    med = {f: statistics.median(x[i] for x in infos) for i, f in enumerate(INFO)}
    step = statistics.median(gaps)
    print(f"{label} (wait) breakdown, p50 us: step {step:.1f} = server total {med['total_us']:.1f} (queue "
          f"{med['queue_us']:.1f}, h2d {med['h2d_us']:.1f}, kernel {med['kernel_us']:.1f}) + outside the server "
          f"{step - med['total_us']:.1f}; the channel call {med['latency_us']:.1f}", flush=True)
    return dict(med, step_us=step)


def one_sequence(a, torch, out):
    client = client_for(a)
    assert client.stream_ordered, "the server does not order steps on the caller's stream"
    seq = client.open_sequence(layers=1, kv_heads=KV, head_dim=D)
    rows = {}
    try:
        batch = client.batch([seq])
        fill(batch, 1, a.context, torch)
        warm = 200  # registrations, streams, the server's slots
        _, kern = kernel_us(client, [seq], a.context, warm, a.steps)
        for mode, wait in MODES:
            batch.wait = wait
            cut_back(client, [seq], a.context)
            chain(batch, 1, warm, torch)
            infos = []
            wall, calls, gaps = chain(batch, 1, a.steps, torch, events=True, infos=infos)
            batch.synchronize()
            if infos:
                rows[mode + "_breakdown"] = breakdown(f"one sequence kv {a.context}", gaps, infos)
            row = rows[mode] = {
                "kernel_us": kern, "step_p50_us": statistics.median(gaps), "step_p90_us": pct(gaps, 90),
                "step_p99_us": pct(gaps, 99), "call_p50_us": statistics.median(calls),
                "over_kernel_p50_us": statistics.median(gaps) - kern, "steps": a.steps}
            print(f"one sequence kv {a.context} ({mode}): step p50 {row['step_p50_us']:.1f} us (p90 "
                  f"{row['step_p90_us']:.1f}, p99 {row['step_p99_us']:.1f}) = kernel {kern:.1f} + "
                  f"{row['over_kernel_p50_us']:.1f} us; the call returns after {row['call_p50_us']:.1f} us (p50)",
                  flush=True)
    finally:
        seq.close()
    out["one_sequence"] = rows
    client.close()


def caller(a, n, steps, wait, start, results):
    import torch
    client = client_for(a)
    seqs = client.open_sequence(layers=1, kv_heads=KV, head_dim=D, count=n)
    batch = client.batch(seqs, wait=wait)
    fill(batch, n, a.context, torch)
    chain(batch, n, WARM_MANY, torch)
    start.wait()
    wall, calls, _ = chain(batch, n, steps, torch)
    batch.synchronize()
    results.put({"tokens_per_s": n * steps / wall, "call_p50_us": statistics.median(calls)})
    client.close_sequences(seqs)
    client.close()


def many(a, torch, out):
    client = client_for(a)
    seqs = client.open_sequence(layers=1, kv_heads=KV, head_dim=D, count=a.sequences)
    one, calls = {}, {}
    try:
        batch = client.batch(seqs)
        fill(batch, a.sequences, a.context, torch)
        kern, _ = kernel_us(client, seqs, a.context, WARM_MANY, a.steps64)
        kernel_rate = a.sequences / (kern * 1e-6)
        for mode, wait in MODES:
            batch.wait = wait
            cut_back(client, seqs, a.context)
            chain(batch, a.sequences, WARM_MANY, torch)
            infos = []
            wall, calls[mode], gaps = chain(batch, a.sequences, a.steps64, torch, events=True, infos=infos)
            batch.synchronize()
            one[mode] = a.sequences * a.steps64 / wall
            if infos:
                one[mode + "_breakdown"] = breakdown(f"{a.sequences} sequences x {a.context}, one caller", gaps, infos)
    finally:
        client.close_sequences(seqs)
    client.close()
    rows = {}
    for mode, wait in MODES:
        ctx = mp.get_context("spawn")
        start, results = ctx.Barrier(2), ctx.Queue()
        half = a.sequences // 2
        procs = [ctx.Process(target=caller, args=(a, half, a.steps64, wait, start, results)) for _ in range(2)]
        for p in procs:
            p.start()
        two = [results.get(timeout=600) for _ in procs]
        for p in procs:
            p.join()
        two_rate = sum(r["tokens_per_s"] for r in two)
        rows[mode] = {"sequences": a.sequences, "kernel_us": kern, "kernel_tokens_per_s": kernel_rate,
                      "one_caller_tokens_per_s": one[mode], "one_caller_ratio": one[mode] / kernel_rate,
                      "one_caller_call_p50_us": statistics.median(calls[mode]),
                      "two_callers_tokens_per_s": two_rate, "two_callers_ratio": two_rate / kernel_rate,
                      "one_caller_breakdown": one.get(mode + "_breakdown")}
        print(f"{a.sequences} sequences x {a.context} ({mode}): kernel {kern:.1f} us = {kernel_rate:,.0f} tokens/s; "
              f"one caller {one[mode]:,.0f} ({one[mode] / kernel_rate:.2f}x, the call returns after "
              f"{rows[mode]['one_caller_call_p50_us']:.0f} us), two callers {two_rate:,.0f} "
              f"({two_rate / kernel_rate:.2f}x)", flush=True)
    out["many"] = rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--shm-socket", dest="shm_socket", required=True)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--steps64", type=int, default=500)
    ap.add_argument("--what", default="one,many")
    ap.add_argument("--json")
    a = ap.parse_args()
    import torch
    torch.cuda.init()
    out = {"context": a.context}
    if "one" in a.what:
        one_sequence(a, torch, out)
    if "many" in a.what:
        many(a, torch, out)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

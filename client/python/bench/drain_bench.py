#!/usr/bin/env python3
"""A drain that moves a server's sequences (docs/sequences.md, "Drain"; docs/benchmarks.md, "Moving sequences"):
`--sequences` sequences are opened and prefilled on server A (`--source`, started with --sequence_drain_to naming
server B, --sequence_drain_s and --peer_secret_file; B with the same secret), each answers a query there, then A is
sent SIGTERM (`--source-pid`). The bench waits for A's log (`--source-log`, --log_level=info) to report the drain's
moves, reads how many sequences and MiB moved in how long, then asks every sequence the same query again: the client
follows each moved id to B, and each must answer with the same O, bit for bit (same rows, same kernel). Reports the
drain's time, its rate, and with torch on a GPU beside this machine's device-to-device copy rate. The prefill is
move_bench.py's.

  python3 client/python/bench/drain_bench.py --source 127.0.0.1:50051 --source-pid 1234 \\
      --source-log a.log --layers 32 --context 4096 --sequences 64
"""
import argparse
import json
import os
import re
import signal
import time

import numpy as np

import attnd
from move_bench import bf16, d2d_copy_gb_per_s, prefill

MOVED = re.compile(r"attnd drain: (\d+) KV sequences moved \(([\d.]+) MiB\) in (\S+);")


def seconds(text):
    """absl's duration text (1.234s, 850.5ms, 1m2.5s) in seconds."""
    total = 0.0
    for value, unit in re.findall(r"([\d.]+)(h|ms|us|m|s)", text):
        total += float(value) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}[unit]
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", required=True)
    ap.add_argument("--source-pid", dest="source_pid", type=int, required=True)
    ap.add_argument("--source-log", dest="source_log", required=True)
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", dest="kv_heads", type=int, default=8)
    ap.add_argument("--q-heads", dest="q_heads", type=int, default=32)
    ap.add_argument("--head-dim", dest="head_dim", type=int, default=128)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--timeout", type=float, default=120, help="seconds to wait for the drain's report")
    ap.add_argument("--json")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    with attnd.Client(a.source) as c:
        seqs = c.open_sequence(layers=a.layers, kv_heads=a.kv_heads, head_dim=a.head_dim, count=a.sequences)
        t0 = time.perf_counter()
        prefill(c, seqs, rng, a.layers, a.context, a.kv_heads, a.head_dim)
        prefill_s = time.perf_counter() - t0
        q = bf16(rng, (1, a.q_heads, a.head_dim))
        probe = a.layers - 1
        before = [np.asarray(c.step(probe, [s], q=q, q_heads=a.q_heads, dtype="bf16")).view(np.uint16) for s in seqs]
        old_ids = [s.id for s in seqs]
        os.kill(a.source_pid, signal.SIGTERM)
        found, until = None, time.monotonic() + a.timeout
        while found is None and time.monotonic() < until:
            time.sleep(0.05)
            with open(a.source_log, errors="replace") as f:
                found = MOVED.search(f.read())
        if found is None:
            raise SystemExit(f"no drain report in {a.source_log} within {a.timeout} s")
        moved, mib, took = int(found.group(1)), float(found.group(2)), seconds(found.group(3))
        after = [np.asarray(c.step(probe, [s], q=q, q_heads=a.q_heads, dtype="bf16")).view(np.uint16) for s in seqs]
        same = all(np.array_equal(x, y) for x, y in zip(before, after))
        where = {s.id.rsplit("@", 1)[-1] for s in seqs}
        followed = sum(s.id != old for s, old in zip(seqs, old_ids))
        c.close_sequences(seqs)
    out = {"sequences": a.sequences, "layers": a.layers, "context": a.context, "kv_heads": a.kv_heads,
           "head_dim": a.head_dim, "prefill_s": prefill_s, "moved": moved, "moved_mib": mib, "drain_s": took,
           "drain_gb_per_s": mib * (1 << 20) / took / 1e9 if took else None, "followed": followed,
           "now_on": sorted(where), "same_o_after_drain": same}
    d2d = d2d_copy_gb_per_s()
    out["d2d_copy_gb_per_s"] = d2d
    print(f"prefill on {a.source}: {a.sequences} x {a.context} tokens x {a.layers} layers in {prefill_s:.2f} s")
    print(f"drain: {moved} sequences, {mib * (1 << 20) / 1e6:.1f} MB moved in {took * 1e3:.1f} ms = "
          f"{out['drain_gb_per_s']:.2f} GB/s; {followed} of {a.sequences} ids followed to {', '.join(sorted(where))}; "
          f"O after the drain {'identical' if same else 'DIFFERENT'}")
    if d2d:
        out["drain_over_d2d"] = out["drain_gb_per_s"] / d2d
        print(f"device-to-device copy on this GPU: {d2d:.1f} GB/s; the drain reaches {out['drain_over_d2d']:.3f} of it")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    if not same or followed != a.sequences:
        raise SystemExit("the drain lost or changed a sequence")


if __name__ == "__main__":
    main()

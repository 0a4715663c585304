#!/usr/bin/env python3
"""Prefill on one server, decode on another (docs/benchmarks.md, "Moving sequences"): `--sequences` sequences are
opened and prefilled on server A (`--source`, append-only steps of random K/V, untimed), moved one after another to
server B (`--dest`, Sequence.move: ExportSequence from A through this client into ImportSequence on B), then decoded
there. Reports the moves' rate (K and V bytes over wall time, and with torch on a GPU beside this machine's
device-to-device copy rate) and time per sequence, checks that every sequence
answers the same query with the same O on B as it did on A (bit for bit: same rows, same kernel), and times decode
steps on B. Both servers must advertise their addresses (--advertise_address), which are what --source and --dest
name. With --warm, one sequence of the shape stays open on each server for the run (so each keeps its page pool) and
the sequences move to B and back untimed first, so that the timed moves write pages B has written before: a CPU
backend's fresh pool faults each page in on its first write, which a GPU's memory does not. --path chooses how the
rows travel: auto (on the GPU when both servers report the same one, else bytes), bytes (through this client) or
device (one GPU buffer per sequence that B copies from over CUDA IPC, or A's pages in place when A shares its pool);
the report says which path ran. --concurrency moves that many sequences at once (a thread each), as a drain does; a
list (1,8,16) times each in turn over the same sequences. --rounds R moves each sequence to B, back and to B again,
2R + 1 moves in all, one after another on its thread (B must export on the same path: start it with the same flags),
so that a rate counts many moves rather than one wave's start and end. --move-connections 0,8 times each row with a
mover of that many connections of its own to each server for moves by bytes (0: over the calls' connections). The
prefill's rows cycle through four random blocks per chunk size (generating tens of GB of random numbers would take
minutes), so the before/after check here is a smoke test; tests/gpu/gpu_sequence_moves_test.cc checks that every row
lands in place.

  python3 client/python/bench/move_bench.py --source 127.0.0.1:50051 --dest 127.0.0.1:50052 --layers 32 \\
      --context 2048 --sequences 8
"""
import argparse
import concurrent.futures
import json
import statistics
import time

import numpy as np

import attnd


def bf16(rng, shape):
    """Random bf16 bits (uint16) of standard normal values."""
    return (rng.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def prefill(c, seqs, rng, layers, context, kv_heads, head_dim):
    """Every layer of `seqs` to `context` tokens: all sequences in one append-only step per chunk of at most 64 MiB
    of K, the rows cycling through four random blocks per chunk size."""
    chunk = max(1, min(context, (64 << 20) // (2 * kv_heads * head_dim * len(seqs))))
    blocks = {}  # rows per sequence -> four random blocks, used in turn
    for layer in range(layers):
        for i, done in enumerate(range(0, context, chunk)):
            t = min(chunk, context - done)
            if t not in blocks:
                blocks[t] = [bf16(rng, (len(seqs) * t, kv_heads, head_dim)) for _ in range(4)]
            k, v = blocks[t][(layer + i) % 4], blocks[t][(layer + i + 1) % 4]
            c.step(layer, seqs, k=k, v=v, tokens=t, dtype="bf16")


def d2d_copy_gb_per_s():
    """The device-to-device copy rate on this machine's GPU (bytes copied per second, 1 GiB copies), the ceiling a
    same-host move is compared with; None without torch or a GPU."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    rate = 10 * src.numel() / (time.perf_counter() - t0) / 1e9
    del src, dst
    torch.cuda.empty_cache()
    return rate


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", required=True)
    ap.add_argument("--dest", required=True)
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", dest="kv_heads", type=int, default=8)
    ap.add_argument("--q-heads", dest="q_heads", type=int, default=32)
    ap.add_argument("--head-dim", dest="head_dim", type=int, default=128)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warm", action="store_true", help="time moves into pages the destination has written before")
    ap.add_argument("--path", choices=("auto", "bytes", "device"), default="auto",
                    help="how the rows travel (Client.move_sequence's path)")
    ap.add_argument("--concurrency", default="1", help="sequences moving at once, or a list of such (1,8,16)")
    ap.add_argument("--rounds", type=int, default=0, help="each sequence moves 2 x rounds + 1 times, ending on B")
    ap.add_argument("--grpc-arg", dest="grpc_args", action="append", default=[],
                    help="a gRPC channel argument name=value for this client's channels (repeatable)")
    ap.add_argument("--move-connections", dest="move_connections", default="",
                    help="the mover's connections of their own for moves by bytes (Client(move_connections)), or a "
                         "list of such (0,8), each a mover of its own; empty: the client's default")
    ap.add_argument("--json")
    a = ap.parse_args()
    try:
        concurrency = [int(x) for x in a.concurrency.split(",")]
    except ValueError:
        ap.error(f"--concurrency: {a.concurrency!r} is not a number or a list of numbers")
    try:
        lanes = [int(x) for x in a.move_connections.split(",")] if a.move_connections else [None]
    except ValueError:
        ap.error(f"--move-connections: {a.move_connections!r} is not a number or a list of numbers")
    if min(concurrency) < 1 or a.rounds < 0:
        ap.error("--concurrency takes numbers >= 1, --rounds a number >= 0")
    rng = np.random.default_rng(0)
    kv_row = a.kv_heads * a.head_dim
    movers = {n: attnd.Client(a.source, grpc_args=a.grpc_args, move_connections=n) for n in lanes}
    with attnd.Client(a.source, grpc_args=a.grpc_args) as c:
        seqs = c.open_sequence(layers=a.layers, kv_heads=a.kv_heads, head_dim=a.head_dim, count=a.sequences)
        warm = []  # --warm: (client, sequence) keeping each server's pool
        try:
            t0 = time.perf_counter()
            prefill(c, seqs, rng, a.layers, a.context, a.kv_heads, a.head_dim)
            prefill_s = time.perf_counter() - t0
            q = bf16(rng, (a.sequences, a.q_heads, a.head_dim))
            probe = [0, a.layers - 1]
            before = {l: c.step(l, seqs, q=q, q_heads=a.q_heads, dtype="bf16") for l in probe}

            if a.warm:
                for x in (a.source, a.dest):
                    wc = attnd.Client(x)
                    warm.append((wc, wc.open_sequence(layers=a.layers, kv_heads=a.kv_heads, head_dim=a.head_dim)))
                for s in seqs:
                    s.move(a.dest, path=a.path)
                for s in seqs:
                    s.move(a.source, path=a.path)

            def move(mover, s):
                """2 x rounds + 1 moves of s, ending on dest: (seconds for each, the paths they took)."""
                took, used = [], set()
                for i in range(2 * a.rounds + 1):
                    s0 = time.perf_counter()
                    mover.move_sequence(s, a.dest if i % 2 == 0 else a.source, path=a.path)
                    took.append(time.perf_counter() - s0)
                    used.add(mover.last_move_path)
                return took, used

            runs, paths = [], set()
            moved_bytes = 2 * a.context * kv_row * 2 * a.layers * a.sequences * (2 * a.rounds + 1)
            for n, (lane, at_once) in enumerate((x, y) for x in lanes for y in concurrency):
                if n > 0:  # back to the source, untimed
                    for s in seqs:
                        s.move(a.source, path=a.path)
                mover = movers[lane]
                t0 = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(at_once) as pool:
                    done = list(pool.map(lambda s: move(mover, s), seqs))
                move_s = time.perf_counter() - t0
                per = [x for d in done for x in d[0]]
                paths |= set().union(*(d[1] for d in done))
                runs.append({"move_connections": lane, "concurrency": at_once, "moved_bytes": moved_bytes,
                             "move_s": move_s,
                             "move_gb_per_s": moved_bytes / move_s / 1e9,
                             "move_ms_per_sequence_p50": statistics.median(per) * 1e3})
                assert all(s.id.rsplit("@", 1)[-1] == a.dest for s in seqs), "a moved id does not name --dest"

            after = {l: c.step(l, seqs, q=q, q_heads=a.q_heads, dtype="bf16") for l in probe}
            same = all(np.array_equal(np.asarray(before[l]).view(np.uint16), np.asarray(after[l]).view(np.uint16))
                       for l in probe)

            lat = []
            for i in range(a.steps):
                s0 = time.perf_counter()
                for layer in range(a.layers):
                    k = bf16(rng, (a.sequences, a.kv_heads, a.head_dim))
                    c.step(layer, seqs, q=q, k=k, v=k, q_heads=a.q_heads, dtype="bf16")
                lat.append(time.perf_counter() - s0)
        finally:
            c.close_sequences(seqs)
            for wc, ws in warm:
                ws.close()
                wc.close()
            for mover in movers.values():
                mover.close()
    out = {
        "sequences": a.sequences, "layers": a.layers, "context": a.context, "kv_heads": a.kv_heads,
        "head_dim": a.head_dim, "rounds": a.rounds, "path_asked": a.path, "path": ",".join(sorted(paths)),
        "prefill_s": prefill_s, "runs": runs,
        "same_o_after_move": same, "decode_step_ms_p50_on_dest": statistics.median(lat) * 1e3 if lat else None,
    }
    d2d = d2d_copy_gb_per_s()
    out["d2d_copy_gb_per_s"] = d2d
    print(f"prefill on {a.source}: {a.sequences} x {a.context} tokens x {a.layers} layers in {prefill_s:.2f} s")
    for r in runs:
        if d2d:
            r["move_over_d2d"] = r["move_gb_per_s"] / d2d
        lane = "" if r["move_connections"] is None else f", move_connections {r['move_connections']}"
        print(f"move {a.source} -> {a.dest} by {out['path']} (--path {a.path}{lane}, {r['concurrency']} at once, "
              f"{2 * a.rounds + 1} moves each): {r['moved_bytes'] / 1e6:.1f} MB in {r['move_s'] * 1e3:.1f} ms = "
              f"{r['move_gb_per_s']:.2f} GB/s; per move p50 {r['move_ms_per_sequence_p50']:.1f} ms"
              + (f"; {r['move_over_d2d']:.3f} of the device-to-device copy" if d2d else ""))
    print(f"O after the moves {'identical' if same else 'DIFFERENT'}")
    if d2d:
        print(f"device-to-device copy on this GPU: {d2d:.1f} GB/s")
    if lat:
        print(f"decode on {a.dest}: {a.sequences} sequences x {a.layers} layers, step p50 "
              f"{out['decode_step_ms_p50_on_dest']:.2f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    if not same:
        raise SystemExit("O differs after the move")


if __name__ == "__main__":
    main()

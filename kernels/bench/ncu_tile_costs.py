#!/usr/bin/env python3
"""Where a kernel's warp-stall samples go, by how often each instruction ran: reads the per-instruction CSV of
`ncu --import X.ncu-rep --page source --csv --print-source sass` (plain or .gz) and groups the SASS by its
"Instructions Executed" count. For an attention kernel with T tiles of W consumer warps and n key blocks each,
T*W is the code run once per tile per warp and T*W*(n-1) the overlapped loop, so this splits the samples into
the per-tile overhead and the steady state without reading the SASS by hand.

  python3 ncu_tile_costs.py source.csv.gz [--per-tile 16384] [--top 25]

--per-tile defaults to the count of the most-sampled class whose count divides the most-sampled class's count
(the loop's), i.e. the once-per-tile code. Prints the share of each class, then the per-tile code in address
order as runs of consecutive instructions with their samples and largest stall reasons, then its top
instructions.
"""
import argparse
import collections
import csv
import gzip
import io


def read_rows(path):
    raw = gzip.open(path, "rt") if path.endswith(".gz") else open(path)
    with raw:
        lines = raw.read().splitlines()
    # The CSV starts with a "Kernel Name" line; the header is the first line naming "Address".
    start = next(i for i, line in enumerate(lines) if line.startswith('"Address"'))
    reader = csv.DictReader(io.StringIO("\n".join(lines[start:])))
    rows = []
    for r in reader:
        try:
            r["_exec"] = int(r["Instructions Executed"])
            r["_samples"] = int(r["Warp Stall Sampling (All Samples)"])
        except (KeyError, ValueError):
            continue
        rows.append(r)
    return rows


def stall_columns(row):
    return [c for c in row if c.startswith("stall_") and "(Not Issued)" not in c]


def top_stalls(rows, n=3):
    acc = collections.Counter()
    for r in rows:
        for c in stall_columns(r):
            try:
                acc[c[len("stall_"):]] += int(r[c])
            except ValueError:
                pass
    return ", ".join(f"{k} {v}" for k, v in acc.most_common(n) if v > 0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--per-tile", type=int, default=0, help="executions of an instruction run once per tile and warp")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    rows = read_rows(args.csv)
    total = sum(r["_samples"] for r in rows)
    by_count = collections.Counter()
    for r in rows:
        by_count[r["_exec"]] += r["_samples"]
    classes = by_count.most_common()
    print(f"{len(rows)} instructions, {total} samples")
    print("samples by executions per instruction (the largest classes):")
    for count, samples in classes[:10]:
        n = sum(1 for r in rows if r["_exec"] == count)
        print(f"  {count:>10} executions: {n:5d} instructions, {samples:7d} samples ({100.0 * samples / total:5.1f}%)")
    per_tile = args.per_tile
    if not per_tile:
        loop = classes[0][0]
        per_tile = next((c for c, _ in classes[1:] if c and loop % c == 0 and c < loop), 0)
    tile_rows = [r for r in rows if r["_exec"] == per_tile]
    tile_samples = sum(r["_samples"] for r in tile_rows)
    print(f"\nonce per tile and warp ({per_tile} executions): {len(tile_rows)} instructions, {tile_samples} samples "
          f"({100.0 * tile_samples / max(total, 1):.1f}%)")
    # Runs of consecutive per-tile instructions (address order), the heavier ones first.
    runs, cur = [], []
    for r in rows:
        if r["_exec"] == per_tile:
            cur.append(r)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    print("runs of per-tile code (first address, instructions, samples, largest stalls, first instruction):")
    for run in sorted(runs, key=lambda run: -sum(r["_samples"] for r in run))[:15]:
        s = sum(r["_samples"] for r in run)
        print(f"  {run[0]['Address']} {len(run):4d} instr {s:6d} samples ({100.0 * s / max(tile_samples, 1):4.1f}%)  "
              f"[{top_stalls(run)}]  {run[0]['Source'].strip()[:60]}")
    print(f"top {args.top} per-tile instructions:")
    for r in sorted(tile_rows, key=lambda r: -r["_samples"])[: args.top]:
        print(f"  {r['Address']} {r['_samples']:6d}  [{top_stalls([r], 2)}]  {r['Source'].strip()[:70]}")


if __name__ == "__main__":
    main()

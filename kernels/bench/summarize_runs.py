#!/usr/bin/env python3
"""Joins the --json outputs of several hopper_bench.py processes into one line per row, each column's values in
process order and their median, plus each column's ratio to a reference column in the same process (the A/B
figure that survives the spread between processes), and flags any row that reported an error.

  python3 summarize_runs.py [--ref CONFIG] bench_1.json bench_2.json ...
"""
import argparse
import collections
import json
import statistics


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", default="", help="a column (config or peer) to divide every other column by, per process")
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    table = collections.defaultdict(lambda: collections.defaultdict(list))
    ratios = collections.defaultdict(lambda: collections.defaultdict(list))
    for path in args.files:
        try:
            rows = json.load(open(path))
        except (OSError, ValueError) as e:
            print(f"no json: {path}: {e}")
            continue
        for x in rows:
            key = (x["d"], "causal" if x["causal"] else "none", x["seq"], x["hq"], x["hkv"])
            if x.get("batch") and x["batch"] != 16384 // x["seq"]:  # --batches: rows off FA3's 16k tokens
                key += (f"batch {x['batch']}",)
            values = {c: v for c, v in x.items() if isinstance(v, float) and "maxdiff" not in c}
            for c, v in values.items():
                table[key][c].append(v)
            for c, v in x.items():
                if c.endswith("error") and v:
                    print("ERROR", key, c, v)
            ref = values.get(args.ref)
            if ref:
                for c, v in values.items():
                    if c != args.ref:
                        ratios[key][c].append(v / ref)
    for key in sorted(table):
        cols = " ".join(f"{c}={'/'.join('%.0f' % v for v in vs)} (median {statistics.median(vs):.0f})"
                        for c, vs in sorted(table[key].items()))
        print(key, cols)
        for c, rs in sorted(ratios[key].items()):
            ahead = sum(r > 1 for r in rs)
            # With the order alternating between processes, a bias for whichever config runs first in a process
            # (up to ~10% on the H200) splits the ratios into two groups; their geometric mean cancels a bias of
            # that kind where the median of four lands on either group.
            print(f"    {c} / {args.ref}: median {statistics.median(rs):.3f} "
                  f"gmean {statistics.geometric_mean(rs):.3f} "
                  f"({' '.join('%.3f' % r for r in rs)}; ahead in {ahead} of {len(rs)})")


if __name__ == "__main__":
    main()

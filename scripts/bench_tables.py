#!/usr/bin/env python3
"""Tables for scripts/device.sh from kernels/bench/hopper_bench.py's --json output, over several processes.

  bench_tables.py append OUT.json RUN.json PROCESS ORDER   adds one process's rows to OUT.json (a list of processes)
  bench_tables.py bench OUT.json CONFIG                    CONFIG against cuDNN and FA2, per row
  bench_tables.py ab OUT.json CONFIG[,CONFIG...]           each CONFIG against base:CONFIG (the --base_lib build)

A row's ratio is the geometric mean of its per-process ratios (a column's figure depends on its position in the
process, so processes alternate the order and each ratio is taken inside one process); "ahead" counts the
processes in which the first column was faster. The last line printed starts with SUMMARY.
"""
import json
import math
import os
import sys


def key(r):
    return (r["d"], r["causal"], r["batch"], r["seq"], r["hq"], r["hkv"])


def rows_by_key(processes):
    out = {}
    for p in processes:
        for r in p["rows"]:
            out.setdefault(key(r), []).append(r)
    return out


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def compare(rs, a, b):
    """(mean TFLOP/s of a, of b, geometric-mean ratio a/b, processes with a ahead, processes with both) or None."""
    pairs = [(r[a], r[b]) for r in rs if r.get(a) and r.get(b)]
    if not pairs:
        return None
    return (sum(p[0] for p in pairs) / len(pairs), sum(p[1] for p in pairs) / len(pairs),
            geomean([p[0] / p[1] for p in pairs]), sum(p[0] > p[1] for p in pairs), len(pairs))


def row_label(k):
    return f"{k[0]:>4} {str(k[1]):>6} {k[2]:>5} {k[3]:>6} {f'{k[4]}/{k[5]}':>7}"


def failed_columns(rs, columns):
    return sum(1 for r in rs for c in columns if (c + "_error") in r)


def table(processes, columns_of, title):
    """Prints one line per row with each (a, b) pair of columns_of; returns the pairs' results."""
    by_row = rows_by_key(processes)
    pairs = columns_of
    print(f"{'d':>4} {'causal':>6} {'batch':>5} {'seq':>6} {'hq/hkv':>7}" +
          "".join(f" {a[:14]:>14} {b[:14]:>14} {'ratio':>6} {'ahead':>6}" for a, b in pairs) + f"   ({title})")
    results = []
    for k, rs in by_row.items():
        line = row_label(k)
        for a, b in pairs:
            c = compare(rs, a, b)
            results.append((k, a, b, c, failed_columns(rs, [a, b])))
            if c is None:
                line += f" {'-':>14} {'-':>14} {'-':>6} {'-':>6}"
            else:
                line += f" {c[0]:>14.1f} {c[1]:>14.1f} {c[2]:>6.3f} {f'{c[3]}/{c[4]}':>6}"
        print(line)
    return by_row, results


def main():
    cmd = sys.argv[1]
    out = sys.argv[2]
    if cmd == "append":
        run, process, order = sys.argv[3], int(sys.argv[4]), sys.argv[5]
        processes = json.load(open(out)) if os.path.exists(out) else []
        processes.append({"process": process, "order": order, "rows": json.load(open(run))})
        json.dump(processes, open(out, "w"), indent=1)
        return
    processes = json.load(open(out))
    if cmd == "bench":
        config = sys.argv[3]
        by_row, results = table(processes, [(config, "cudnn"), (config, "fa2")], f"{config} against the peers")
        vs_cudnn = [c for _, _, b, c, _ in results if b == "cudnn" and c]
        failed = sum(f for _, a, b, _, f in results if b == "cudnn")
        msg = f"{len(by_row)} rows in {len(processes)} processes, {failed} failed"
        if vs_cudnn:
            ratios = sorted(c[2] for c in vs_cudnn)
            msg += (f"; {config}/cuDNN min {ratios[0]:.3f} median {ratios[len(ratios) // 2]:.3f}, ahead in every "
                    f"process on {sum(c[3] == c[4] for c in vs_cudnn)} of {len(vs_cudnn)} rows")
        print("SUMMARY " + msg)
    elif cmd == "ab":
        configs = [c for c in sys.argv[3].split(",") if c]
        by_row, results = table(processes, [(c, "base:" + c) for c in configs], "new against base")
        done = [c for _, _, _, c, _ in results if c]
        outside = sum(1 for c in done if abs(c[2] - 1) > 0.02)
        failed = sum(1 for _, _, _, c, _ in results if c is None)
        msg = f"{len(by_row)} rows in {len(processes)} processes, {outside} outside 2%, {failed} failed"
        if done:
            ratios = sorted(c[2] for c in done)
            msg += f"; new/base min {ratios[0]:.3f} median {ratios[len(ratios) // 2]:.3f} max {ratios[-1]:.3f}"
        print("SUMMARY " + msg)
    else:
        sys.exit(f"bench_tables.py: unknown command {cmd}")


if __name__ == "__main__":
    main()

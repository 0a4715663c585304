#!/usr/bin/env python3
"""Sums ncu's per-instruction warp-state samples (source page, SASS, csv) by opcode, and lists the hottest instructions
with their neighbourhood. Usage: stalls.py p2_1k_source.csv.gz"""
import csv, gzip, re, sys
from collections import defaultdict

rows = list(csv.reader(gzip.open(sys.argv[1], "rt")))
hi = next(i for i, r in enumerate(rows) if "Source" in r and any("Sampling" in c for c in r))
hdr = rows[hi]
src = hdr.index("Source")
cols = [i for i, c in enumerate(hdr) if "Sampling" in c]
print("columns:", [hdr[i] for i in cols])
total = defaultdict(float)
by_op = defaultdict(lambda: defaultdict(float))
body = []
for r in rows[hi + 1:]:
    if len(r) <= max(cols + [src]):
        continue
    op = re.sub(r"^@!?U?P\w+\s+", "", r[src].strip()).split(" ")[0]
    vals = []
    for i in cols:
        try:
            v = float(r[i] or 0)
        except ValueError:
            v = 0.0
        vals.append(v)
        total[hdr[i]] += v
        by_op[op][hdr[i]] += v
    body.append((r[src].strip(), vals))
main = hdr[cols[0]]
print(f"{'opcode':28s} " + " ".join(f"{hdr[i][:26]:>26s}" for i in cols))
for op, d in sorted(by_op.items(), key=lambda kv: -kv[1][main])[:25]:
    print(f"{op[:28]:28s} " + " ".join(f"{d[hdr[i]]:26.0f}" for i in cols) +
          f"   {100 * d[main] / max(1, total[main]):5.1f}%")
print("\nhottest instructions (all samples):")
for k, (s, v) in sorted(enumerate(body), key=lambda kv: -kv[1][1][0])[:30]:
    print(f"{k:6d} {v[0]:8.0f} {100 * v[0] / max(1, total[main]):5.1f}%  {s[:110]}")

#!/usr/bin/env bash
# Session 10 call 7: the full FA3-convention table on the final library (2b9d1af), two processes, cuDNN and FA2 timed
# in each: the current standing for docs/benchmarks.md.
set -u
C=.carry-hopper; W=/tmp/s10c7; mkdir -p $W
export LD_LIBRARY_PATH=$PWD/$C/lib
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > $W/env.txt
for i in 1 2; do
  PYTHONUNBUFFERED=1 timeout 250 python3 kernels/bench/hopper_bench.py --lib $C/new/libattnd_kernels_c.so --configs hopper \
    --peers cudnn,fa2 --rep 60 --json $W/table_$i.json > $W/table_$i.txt 2>&1
  echo "table $i rc=$?"
done
python3 - $W <<'PY' | tee $W/summary.txt
import json, sys, statistics as st, collections
w = sys.argv[1]
t = collections.defaultdict(lambda: collections.defaultdict(list))
for i in (1, 2):
    for x in json.load(open(f'{w}/table_{i}.json')):
        k = (x['d'], 'causal' if x['causal'] else 'none', x['seq'], x['hq'], x['hkv'])
        for c in ('hopper', 'cudnn', 'fa2'):
            if isinstance(x.get(c), float): t[k][c].append(x[c])
        if x.get('hopper_error'): print('ERROR', k, x['hopper_error'])
print('| d | mask | seq | heads | attnd | cuDNN | FA2 | attnd / cuDNN |')
print('|---|---|---|---|---|---|---|---|')
for k in sorted(t):
    m = {c: st.mean(v) for c, v in t[k].items() if v}
    r = m['hopper'] / m['cudnn'] if 'cudnn' in m else float('nan')
    print(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]}/{k[4]} | {'/'.join('%.0f' % v for v in t[k]['hopper'])} | "
          f"{'/'.join('%.0f' % v for v in t[k]['cudnn'])} | {'/'.join('%.0f' % v for v in t[k]['fa2'])} | {r:.2f} |")
PY
tar czf $OUT/s10call7.tgz -C /tmp s10c7

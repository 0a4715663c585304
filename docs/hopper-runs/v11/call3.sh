#!/usr/bin/env bash
# Session 10 call 3: the split tail with the launcher's rule (kSplitTailMinBlocks = 40 key blocks a block): six
# processes alternating the new library and HEAD's (base) on d128 8k/16k (the rows it now splits and the next
# shorter), auto configuration, cuDNN timed in each; then one process each at 1k-4k to check that nothing splits
# there (new level with base).
set -u
C=.carry-hopper; W=/tmp/s10c3; mkdir -p $W
export LD_LIBRARY_PATH=$PWD/$C/lib
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > $W/env.txt
i=0
for v in split base split base split base; do
  i=$((i+1)); lib=$C/new/libattnd_kernels_c.so; [ $v = base ] && lib=$C/libattnd_kernels_c.so
  PYTHONUNBUFFERED=1 timeout 120 python3 kernels/bench/hopper_bench.py --lib $lib --configs hopper --peers cudnn --rep 100 \
    --head_dims 128 --seqs 8192,16384 --json $W/bench_${i}_$v.json > $W/bench_${i}_$v.txt 2>&1
  echo "bench $i $v rc=$?"
done
for v in split base; do
  i=$((i+1)); lib=$C/new/libattnd_kernels_c.so; [ $v = base ] && lib=$C/libattnd_kernels_c.so
  PYTHONUNBUFFERED=1 timeout 120 python3 kernels/bench/hopper_bench.py --lib $lib --configs hopper --peers cudnn --rep 40 \
    --head_dims 128 --seqs 1024,2048,4096 --json $W/short_${i}_$v.json > $W/short_${i}_$v.txt 2>&1
  echo "short $i $v rc=$?"
done
python3 - $W <<'PY' | tee $W/ab_summary.txt
import json, sys, glob, collections, statistics as st
w = sys.argv[1]
for pat in ('bench', 'short'):
    t = collections.defaultdict(lambda: collections.defaultdict(list))
    diffs = {}
    for f in sorted(glob.glob(f'{w}/{pat}_*.json')):
        v = f.rsplit('_', 1)[1].split('.')[0]
        for x in json.load(open(f)):
            k = (x['d'], 'causal' if x['causal'] else 'nc', x['seq'], x['hq'], x['hkv'])
            if isinstance(x.get('hopper'), float): t[k][v].append(x['hopper'])
            if x.get('hopper_error'): print('ERROR', v, k, x['hopper_error'])
            d = x.get('hopper_maxdiff_vs_ref')
            if d is not None: diffs[v] = max(diffs.get(v, 0), d)
            if x.get('cudnn'): t[k]['cudnn'].append(x['cudnn'])
    print(pat, 'row | split | base | cudnn | split/base (medians) | split/cudnn')
    for k in sorted(t):
        m = {v: st.median(a) for v, a in t[k].items() if a}
        cells = ' | '.join('/'.join('%.0f' % x for x in t[k][v]) for v in ('split', 'base', 'cudnn'))
        print(k, '|', cells, '|', '%.3f' % (m['split'] / m['base']), '|', '%.3f' % (m['split'] / m['cudnn']))
    print('max |O - cuDNN|:', diffs)
PY
tar czf $OUT/s10call3.tgz -C /tmp s10c3

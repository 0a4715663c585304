#!/usr/bin/env bash
# Session 10 call 4: the split tail's combine in groups of 8 float4s (no spills, d256 128x64 now split too). GPU suite;
# forced splits on 3 / 5 / 7 blocks for the three split configurations; sanitizers on forced splits (a d256 case
# included); bench, new / HEAD's library (base) alternating, three processes each: d128 16k and d256 2k-16k.
set -u
C=.carry-hopper; W=/tmp/s10c4; mkdir -p $W
export LD_LIBRARY_PATH=$PWD/$C/lib
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > $W/env.txt
timeout 150 $C/gpu_attention_test > $W/suite.log 2>&1; echo "suite rc=$?"
grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' $W/suite.log | head -12
F='*hopper_sm90_d128_m128n128s3*:*hopper_sm90_d128_m128n176s2*:*hopper_sm90_d256_m128n64s2*'
for nb in 3 5 7; do
  ATTND_HOPPER_MAX_BLOCKS=$nb ATTND_HOPPER_SPLIT_TAIL=2 timeout 150 $C/gpu_attention_test --gtest_filter="$F" > $W/split_blocks$nb.log 2>&1
  echo "forced split, $nb blocks rc=$?"; grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' $W/split_blocks$nb.log | head -12
done
S='*hopper_sm90_d128_m128n128s3_d128_sq1000_none*:*hopper_sm90_d128_m128n176s2_d128_sq1000_br*:*hopper_sm90_d256_m128n64s2_d256_sq1000_tl*:*hopper_sm90_d256_m128n64s2_d256_sq1000_none*'
for tool in memcheck racecheck synccheck; do
  ATTND_HOPPER_MAX_BLOCKS=3 ATTND_HOPPER_SPLIT_TAIL=2 timeout 150 compute-sanitizer --tool $tool $C/gpu_attention_test \
    --gtest_filter="$S" > $W/sanitizer_$tool.log 2>&1
  echo "$tool rc=$?"; grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' $W/sanitizer_$tool.log | head -4
done
i=0
for v in split base split base split base; do
  i=$((i+1)); lib=$C/new/libattnd_kernels_c.so; [ $v = base ] && lib=$C/libattnd_kernels_c.so
  PYTHONUNBUFFERED=1 timeout 120 python3 kernels/bench/hopper_bench.py --lib $lib --configs hopper --peers cudnn --rep 60 \
    --head_dims 128,256 --seqs 2048,4096,8192,16384 --no-gqa --json $W/bench_${i}_$v.json > $W/bench_${i}_$v.txt 2>&1
  echo "bench $i $v rc=$?"
done
python3 - $W <<'PY' | tee $W/ab_summary.txt
import json, sys, glob, collections, statistics as st
w = sys.argv[1]
t = collections.defaultdict(lambda: collections.defaultdict(list))
diffs = {}
for f in sorted(glob.glob(f'{w}/bench_*.json')):
    v = f.rsplit('_', 1)[1].split('.')[0]
    for x in json.load(open(f)):
        k = (x['d'], 'causal' if x['causal'] else 'nc', x['seq'], x['hq'], x['hkv'])
        if isinstance(x.get('hopper'), float): t[k][v].append(x['hopper'])
        if x.get('hopper_error'): print('ERROR', v, k, x['hopper_error'])
        d = x.get('hopper_maxdiff_vs_ref')
        if d is not None: diffs[v] = max(diffs.get(v, 0), d)
        if x.get('cudnn'): t[k]['cudnn'].append(x['cudnn'])
print('row | new | base | cudnn | new/base (medians) | new/cudnn')
for k in sorted(t):
    m = {v: st.median(a) for v, a in t[k].items() if a}
    cells = ' | '.join('/'.join('%.0f' % x for x in t[k][v]) for v in ('split', 'base', 'cudnn'))
    print(k, '|', cells, '|', '%.3f' % (m['split'] / m['base']), '|', '%.3f' % (m['split'] / m['cudnn']))
print('max |O - cuDNN|:', diffs)
PY
tar czf $OUT/s10call4.tgz -C /tmp s10c4

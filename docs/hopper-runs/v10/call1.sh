#!/usr/bin/env bash
# Session 9 call 1. (a) Cross-tile kernels with the Q buffer as a template argument (new/) against HEAD's library:
# SASS counts, the _x GPU cases (full grid and 3 blocks), sanitizers on small _x cases, and a bench A/B of the
# short rows in four alternating processes. (b) unary vs stream at 256..4096 tokens on the session-8 server.
set -u
C=.carry-hopper; W=/tmp/work; mkdir -p $W
export LD_LIBRARY_PATH=$PWD/$C/lib
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > $W/env.txt
for v in old new; do
  lib=$C/libattnd_kernels_c.so; [ $v = new ] && lib=$C/new/libattnd_kernels_c.so
  cuobjdump -sass $lib > /tmp/sass_$v.txt 2>/dev/null
  python3 - /tmp/sass_$v.txt $v >> $W/sass_counts.txt <<'PY'
import re, sys, collections
f, v = sys.argv[1], sys.argv[2]
cur = None; c = collections.defaultdict(collections.Counter)
for line in open(f):
    m = re.search(r'Function : (\S+)', line)
    if m: cur = m.group(1); continue
    if cur is None: continue
    m = re.search(r'/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)', line)
    if m:
        op = m.group(1).split('.')[0]; c[cur]['ALL'] += 1; c[cur][op] += 1
for fn, k in c.items():
    m = re.search(r'TileShapeILi(\d+)ELi(\d+)ELi(\d+)ELb(\d)ELb(\d)ELi(\d)ELi(\d)ELb(\d)EEE(\w+?)Li(\d)E', fn)
    if not m or 'bfloat16' not in m.group(9): continue
    g = m.groups()
    if g[0] not in ('64', '128') or g[1] != '128' or g[3] != '1': continue
    name = f"d{g[0]} n{g[1]} s{g[2]} wg{g[5]} x{g[7]} order{g[9]}"
    print(v, name, ' '.join(f"{op}={k[op]}" for op in ('ALL', 'HGMMA', 'R2UR', 'UIADD3', 'ULOP3', 'IADD3', 'LDL', 'STL', 'BAR', 'SYNCS')))
PY
done
cat $W/sass_counts.txt
CF=hopper_sm90_d128_m128n128s3,hopper_sm90_d128_m128n128s2,hopper_sm90_d128_m128n128s2_x,hopper_sm90_d64_m192n128s4,hopper_sm90_d64_m128n128s4,hopper_sm90_d64_m128n128s4_x
i=0
for v in new old old new; do
  i=$((i+1)); lib=$C/libattnd_kernels_c.so; [ $v = new ] && lib=$C/new/libattnd_kernels_c.so
  PYTHONUNBUFFERED=1 timeout 150 python3 kernels/bench/hopper_bench.py --lib $lib --configs $CF --peers cudnn --rep 40 \
    --head_dims 64,128 --seqs 512,1024,2048,4096,16384 --json $W/bench_${i}_$v.json > $W/bench_${i}_$v.txt 2>&1; echo "bench $i $v rc=$?"
done
python3 - $W <<'PY' | tee $W/ab_summary.txt
import json, sys, glob, collections
w = sys.argv[1]
t = collections.defaultdict(lambda: collections.defaultdict(list))
for f in sorted(glob.glob(w + '/bench_*.json')):
    v = f.rsplit('_', 1)[1].split('.')[0]
    for x in json.load(open(f)):
        k = (x['d'], x['causal'], x['seq'], x['hq'], x['hkv'])
        for c, val in x.items():
            if c.startswith('hopper_sm90') and isinstance(val, float): t[k][(c.replace('hopper_sm90_', ''), v)].append(val)
        if x.get('cudnn'): t[k][('cudnn', v)].append(x['cudnn'])
for k in sorted(t):
    cells = []
    for (c, v), vals in sorted(t[k].items()):
        cells.append(f"{c}/{v} " + '/'.join('%.0f' % x for x in vals))
    print(k, ' | '.join(cells))
PY
timeout 200 $C/gpu_attention_test --gtest_filter='*s2_x*:*s4_x*' > $W/gpu_test_x.log 2>&1; echo "x tests rc=$?"
ATTND_HOPPER_MAX_BLOCKS=3 timeout 200 $C/gpu_attention_test --gtest_filter='*s2_x*:*s4_x*' > $W/gpu_test_x_3blocks.log 2>&1; echo "x tests 3 blocks rc=$?"
grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' $W/gpu_test_x.log $W/gpu_test_x_3blocks.log | head -20
for tool in memcheck racecheck synccheck; do
  ATTND_HOPPER_MAX_BLOCKS=3 ATTND_GPU_TEST_SMALL=1 timeout 60 compute-sanitizer --tool $tool --error-exitcode 9 $C/gpu_attention_test \
    --gtest_filter='*d128_m128n128s2_x_d128_sq129_tl*:*d128_m128n128s2_x_d128_sq17_none*' >> $W/sanitizer.log 2>&1
  echo "sanitizer $tool rc=$?"
done
grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' $W/sanitizer.log
# (b) unary vs stream by size, session-8 server binaries
OUT_SVC=$W/svc; mkdir -p $OUT_SVC
OUT=$OUT_SVC SKIP_TESTS=1 SKIP_IPC=1 SKIP_SHM=1 INLINE_SEQS="256 512 1024 2048 4096" CALLERS=1 DUR=3s \
  timeout 200 bash server/cuda/tools/device_run.sh > $W/svc_run.txt 2>&1; echo "svc rc=$?"
grep -E 'attn_bench|vs TCP' $OUT_SVC/bench.txt | head -40
cd /tmp && tar czf $OUT/s9call1.tgz work

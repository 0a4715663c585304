#!/usr/bin/env bash
# Session 11 call 5: v13, O through shared memory and TMA (hopper_sm90_d128_m128n128s3_os). Its GPU suite on the full
# grid and on 3 and 5 blocks, memcheck / racecheck / synccheck on small cases, SASS counts, and three bench processes
# timing s3 and s3_os beside cuDNN on d128 from 1k to 16k.
set -u
C=.carry-hopper; W=/tmp/v12c5; mkdir -p $W
export LD_LIBRARY_PATH=$PWD/$C/lib
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > $W/env.txt
QR='*hopper_sm90_d128_m128n128s3_os_*'
timeout 30 $C/gpu_attention_test --gtest_filter='*hopper_sm90_d128_m128n128s3_os_d128_sq129_tl*' > $W/smoke.log 2>&1
echo "smoke rc=$?"; tail -3 $W/smoke.log
timeout 120 $C/gpu_attention_test --gtest_filter="$QR:*hopper_sm90_d128_m128n128s3_d*" > $W/suite.log 2>&1
echo "suite rc=$?"; grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' $W/suite.log | head -12
for nb in 3 5; do
  ATTND_HOPPER_MAX_BLOCKS=$nb timeout 120 $C/gpu_attention_test --gtest_filter="$QR" > $W/blocks$nb.log 2>&1
  echo "$nb blocks rc=$?"; grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' $W/blocks$nb.log | head -12
done
for tool in memcheck racecheck synccheck; do
  f='*hopper_sm90_d128_m128n128s3_os_d128_sq129_tl*:*hopper_sm90_d128_m128n128s3_os_d128_b3_gqa8to2_tl*'
  [ $tool = racecheck ] && f='*hopper_sm90_d128_m128n128s3_os_d128_sq129_tl*'
  ATTND_HOPPER_MAX_BLOCKS=3 ATTND_GPU_TEST_SMALL=1 timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 \
    $C/gpu_attention_test --gtest_filter="$f" > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' $W/san_$tool.log | tail -3
done
cuobjdump --dump-sass $C/new/libattnd_kernels_c.so > /tmp/all.sass 2>&1
python3 - <<'PY' | tee $W/sass_counts.txt
import re
text = open('/tmp/all.sass').read()
for f in re.split(r'\n\s*Function : ', text)[1:]:
    name = f.split('\n', 1)[0].strip()
    if 'HopperFwdKernel' not in name or 'ILi128ELi128ELi3E' not in name or 'bfloat16' not in name: continue
    ops = re.findall(r'/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)', f)
    c = lambda p: sum(1 for o in ops if o.startswith(p))
    print(name[:120], '| instr', len(ops), 'HGMMA', c('HGMMA'), 'R2UR', c('R2UR'), 'LDSM', c('LDSM'), 'STL', c('STL'),
          'LDL', c('LDL'), 'UTMALDG', c('UTMALDG'))
PY
for i in 1 2 3; do
  cfg=hopper_sm90_d128_m128n128s3,hopper_sm90_d128_m128n128s3_os
  [ $i = 2 ] && cfg=hopper_sm90_d128_m128n128s3_os,hopper_sm90_d128_m128n128s3
  PYTHONUNBUFFERED=1 timeout 130 python3 kernels/bench/hopper_bench.py --lib $C/new/libattnd_kernels_c.so --configs $cfg \
    --peers cudnn --rep 30 --head_dims 128 --seqs 1024,2048,4096,8192,16384 --json $W/bench_$i.json > $W/bench_$i.txt 2>&1
  echo "bench $i rc=$?"
done
python3 - $W <<'PY' | tee $W/summary.txt
import json, sys, collections
w = sys.argv[1]
t = collections.defaultdict(lambda: collections.defaultdict(list))
for i in (1, 2, 3):
    try: rows = json.load(open(f'{w}/bench_{i}.json'))
    except Exception as e: print('no json', i, e); continue
    for x in rows:
        k = (x['d'], 'causal' if x['causal'] else 'none', x['seq'], x['hq'], x['hkv'])
        for c, v in x.items():
            if isinstance(v, float) and 'maxdiff' not in c: t[k][c].append(v)
        for c, v in x.items():
            if c.endswith('error') and v: print('ERROR', k, c, v)
for k in sorted(t):
    print(k, ' '.join(f"{c}={'/'.join('%.0f' % v for v in vs)}" for c, vs in sorted(t[k].items())))
PY
tar czf $OUT/v12call5.tgz -C /tmp v12c5

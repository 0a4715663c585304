#!/usr/bin/env bash
# Session 11 call 9: v13b, the O-through-shared-memory epilogue for 128x176 and inside the split-tail kernels
# (hopper_sm90_d128_m128n176s2_os). Its suite and the s3 _os / auto / API cases; forced split tails on 3, 5 and 7
# blocks; sanitizers on a forced split; 16k A/B n176 vs n176_os (split tail where it applies), three processes; the
# server suites on the new binaries and a non-causal request at 4k keys (auto: s3 _os, whose stage release changed).
set -u
C=.carry-hopper; W=/tmp/v12c9; mkdir -p $W
export LD_LIBRARY_PATH=$PWD/$C/lib
timeout 200 $C/gpu_attention_test --gtest_filter='*_os_*:*auto_*:KernelApi*' > $W/suite.log 2>&1
echo "suite rc=$?"; grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' $W/suite.log | head -8
for nb in 3 5 7; do
  ATTND_HOPPER_SPLIT_TAIL=2 ATTND_HOPPER_MAX_BLOCKS=$nb timeout 90 $C/gpu_attention_test \
    --gtest_filter='*hopper_sm90_d128_m128n176s2_os_*' > $W/split_blocks$nb.log 2>&1
  echo "forced split, $nb blocks rc=$?"; grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' $W/split_blocks$nb.log | head -4
done
for tool in memcheck racecheck synccheck; do
  f='*hopper_sm90_d128_m128n176s2_os_d128_sq129_tl*:*hopper_sm90_d128_m128n176s2_os_d128_b3_gqa8to2_tl*'
  [ $tool = racecheck ] && f='*hopper_sm90_d128_m128n176s2_os_d128_sq129_tl*'
  ATTND_HOPPER_SPLIT_TAIL=2 ATTND_HOPPER_MAX_BLOCKS=3 ATTND_GPU_TEST_SMALL=1 timeout 100 compute-sanitizer --tool $tool \
    --error-exitcode 9 $C/gpu_attention_test --gtest_filter="$f" > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1
done
for i in 1 2 3; do
  cfg=hopper_sm90_d128_m128n176s2,hopper_sm90_d128_m128n176s2_os
  [ $i = 2 ] && cfg=hopper_sm90_d128_m128n176s2_os,hopper_sm90_d128_m128n176s2
  PYTHONUNBUFFERED=1 timeout 100 python3 kernels/bench/hopper_bench.py --lib $C/new/libattnd_kernels_c.so --configs $cfg \
    --peers cudnn --rep 40 --head_dims 128 --seqs 16384 --json $W/bench_$i.json > $W/bench_$i.txt 2>&1
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
OUT=$W/server SKIP_IPC=1 SKIP_SHM=1 SKIP_INLINE=1 INLINE_SEQS="" PORT=51100 timeout 200 bash server/cuda/tools/device_run.sh > $W/server_run.txt 2>&1
echo "server tests rc=$?"; grep -E "^\[  (PASSED|FAILED) |=== .* rc=|^FAIL" $W/server/tests.log
mkdir -p /tmp/bins && tar xf .carry-cuda/bins.tar.xz -C /tmp/bins
/tmp/bins/attnd --listen=127.0.0.1:51111 --log_level=info > $W/attnd.log 2>&1 &
pid=$!
for i in $(seq 1 100); do /tmp/bins/attn info --target=127.0.0.1:51111 > /dev/null 2>&1 && break; sleep 0.2; done
for dt in bf16 fp16; do
  timeout 120 /tmp/bins/attn call --target=127.0.0.1:51111 --batch=2 --q_len=2000 --kv_len=4096 --q_heads=8 \
    --kv_heads=2 --head_dim=128 --mask=none --dtype=$dt --verify > $W/call_4096_$dt.txt 2>&1
  echo "kv 4096 $dt rc=$?"; grep -E "reply:|verify: (PASS|FAIL)" $W/call_4096_$dt.txt | head -2
done
kill -TERM $pid; wait $pid; echo "attnd exit rc=$?"
tar czf $OUT/v12call9.tgz -C /tmp v12c9

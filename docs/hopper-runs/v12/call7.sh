#!/usr/bin/env bash
# Session 11 call 7: v13 on main's path. O through shared memory and TMA with its O map from MapKeys /
# MakePlanFromMaps (and the server's map cache), auto picking hopper_sm90_d128_m128n128s3_os for non-causal d128 from
# 2k to 16k keys. Kernel suite (the _os cases both ways, auto, the API), the _os cases on 3 blocks, sanitizers; the
# server suites, the quickstart and non-causal requests the server runs with _os (unary, stream; bf16, fp16);
# two bench processes timing s3 and auto beside cuDNN on d128.
set -u
C=.carry-hopper; W=/tmp/v12c7; mkdir -p $W
export LD_LIBRARY_PATH=$PWD/$C/lib
nvidia-smi --query-gpu=name,driver_version --format=csv > $W/env.txt
timeout 150 $C/gpu_attention_test --gtest_filter='*_os_*:*auto_*:KernelApi*' > $W/suite.log 2>&1
echo "suite rc=$?"; grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' $W/suite.log | head -8
ATTND_HOPPER_MAX_BLOCKS=3 timeout 90 $C/gpu_attention_test --gtest_filter='*_os_*' > $W/blocks3.log 2>&1
echo "3 blocks rc=$?"; grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' $W/blocks3.log | head -4
for tool in memcheck synccheck; do
  ATTND_HOPPER_MAX_BLOCKS=3 ATTND_GPU_TEST_SMALL=1 timeout 90 compute-sanitizer --tool $tool --error-exitcode 9 $C/gpu_attention_test \
    --gtest_filter='*hopper_sm90_d128_m128n128s3_os_d128_sq129_tl*:*hopper_sm90_d128_m128n128s3_os_d128_b3_gqa8to2_tl*' > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY' $W/san_$tool.log | tail -1
done
OUT=$W/server SKIP_IPC=1 SKIP_SHM=1 SKIP_INLINE=1 INLINE_SEQS="" PORT=51100 timeout 200 bash server/cuda/tools/device_run.sh > $W/server_run.txt 2>&1
echo "server tests rc=$?"; grep -E "^\[  (PASSED|FAILED) |=== .* rc=|^FAIL" $W/server/tests.log
mkdir -p /tmp/bins && tar xf .carry-cuda/bins.tar.xz -C /tmp/bins
ATTND_BIN_DIR=/tmp/bins timeout 120 bash scripts/quickstart.sh > $W/quickstart.log 2>&1; echo "quickstart rc=$?"
grep -E "backend:|verify: PASS|verify: FAIL|requests:|quickstart:" $W/quickstart.log | head -6
/tmp/bins/attnd --listen=127.0.0.1:51111 --log_level=info > $W/attnd_os.log 2>&1 &
pid=$!
for i in $(seq 1 100); do /tmp/bins/attn info --target=127.0.0.1:51111 > /dev/null 2>&1 && break; sleep 0.2; done
for tr in unary stream; do
  for dt in bf16 fp16; do
    timeout 120 /tmp/bins/attn call --target=127.0.0.1:51111 --batch=2 --q_len=2000 --kv_len=4096 --q_heads=8 \
      --kv_heads=2 --head_dim=128 --mask=none --dtype=$dt --transport=$tr --verify > $W/call_os_${tr}_$dt.txt 2>&1
    echo "$tr $dt rc=$?"; grep -E "reply:|verify: (PASS|FAIL)" $W/call_os_${tr}_$dt.txt | head -2
  done
done
/tmp/bins/attn stats --target=127.0.0.1:51111 > $W/stats.txt 2>&1; grep -iE "tensor_map|map_(hits|misses)" $W/stats.txt | head -4
kill -TERM $pid; wait $pid; echo "attnd exit rc=$?"
for i in 1 2; do
  cfg=hopper_sm90_d128_m128n128s3,hopper
  [ $i = 2 ] && cfg=hopper,hopper_sm90_d128_m128n128s3
  PYTHONUNBUFFERED=1 timeout 120 python3 kernels/bench/hopper_bench.py --lib $C/new/libattnd_kernels_c.so --configs $cfg \
    --peers cudnn --rep 30 --head_dims 128 --seqs 1024,2048,4096,8192,16384 --json $W/bench_$i.json > $W/bench_$i.txt 2>&1
  echo "bench $i rc=$?"
done
python3 - $W <<'PY' | tee $W/summary.txt
import json, sys, collections
w = sys.argv[1]
t = collections.defaultdict(lambda: collections.defaultdict(list))
for i in (1, 2):
    try: rows = json.load(open(f'{w}/bench_{i}.json'))
    except Exception as e: print('no json', i, e); continue
    for x in rows:
        k = (x['d'], 'causal' if x['causal'] else 'none', x['seq'], x['hq'], x['hkv'])
        for c, v in x.items():
            if isinstance(v, float) and 'maxdiff' not in c: t[k][c].append(v)
            if c.endswith('_config'): t[k][c] = v
        for c, v in x.items():
            if c.endswith('error') and v: print('ERROR', k, c, v)
for k in sorted(t):
    print(k, ' '.join(f"{c}={'/'.join('%.0f' % v for v in vs) if isinstance(vs, list) else vs}" for c, vs in sorted(t[k].items())))
PY
tar czf $OUT/v12call7.tgz -C /tmp v12c7

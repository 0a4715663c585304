#!/usr/bin/env bash
# Session 12 call 4: the final binaries (0b54412's code: v14 with auto's s3 _osk below 16k keys, the map-cache test
# fix). The d128, auto and API kernel cases; the server suites; the README quickstart's main job; requests through
# the server at 4k keys (auto: s3 _osk); the headline rows (d128 16k, 16 heads) on auto (128x176 _os) beside s3 _osk
# and cuDNN, six processes in alternating order.
set -u
C=.carry-hopper; W=/tmp/v14c4; mkdir -p $W
export LD_LIBRARY_PATH=$PWD/$C/lib
T=$C/gpu_attention_test; L=$C/new/libattnd_kernels_c.so
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -6; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > $W/env.txt
timeout 200 $T --gtest_filter='*hopper_sm90_d128*:*auto_*:KernelApi*' > $W/suite.log 2>&1
echo "d128 + auto + API rc=$?"; pass $W/suite.log
OUT=$W/server SKIP_IPC=1 SKIP_SHM=1 SKIP_INLINE=1 INLINE_SEQS="" PORT=51100 timeout 200 bash server/cuda/tools/device_run.sh \
  > $W/server_run.txt 2>&1
echo "server tests rc=$?"; grep -E "^\[  (PASSED|FAILED) |=== .* rc=|^FAIL" $W/server/tests.log
mkdir -p /tmp/bins && tar xf .carry-cuda/bins.tar.xz -C /tmp/bins
ATTND_BIN_DIR=/tmp/bins timeout 120 bash scripts/quickstart.sh > $W/quickstart.log 2>&1
echo "quickstart rc=$?"; grep -E "backend|verify|requests|errors" $W/quickstart.log | head -8
/tmp/bins/attnd --listen=127.0.0.1:51111 --log_level=info > $W/attnd.log 2>&1 &
pid=$!
for i in $(seq 1 100); do /tmp/bins/attn info --target=127.0.0.1:51111 > /dev/null 2>&1 && break; sleep 0.2; done
for mask in causal none; do
  timeout 100 /tmp/bins/attn call --target=127.0.0.1:51111 --batch=2 --q_len=2000 --kv_len=4096 --q_heads=8 \
    --kv_heads=2 --head_dim=128 --mask=$mask --dtype=bf16 --verify > $W/call_4096_$mask.txt 2>&1
  echo "kv 4096 $mask rc=$?"; grep -E "reply:|verify: (PASS|FAIL)" $W/call_4096_$mask.txt | head -2
done
/tmp/bins/attn stats --target=127.0.0.1:51111 > $W/stats.txt 2>&1
kill -TERM $pid; wait $pid; echo "attnd exit rc=$?"
b=hopper_sm90_d128_m128n128s3_osk
for i in 1 2 3 4 5 6; do
  cfg=hopper,$b; [ $((i % 2)) = 0 ] && cfg=$b,hopper
  PYTHONUNBUFFERED=1 timeout 60 python3 kernels/bench/hopper_bench.py --lib $L --configs $cfg --peers cudnn --rep 40 \
    --head_dims 128 --seqs 16384 --no-gqa --json $W/head_$i.json > $W/head_$i.txt 2>&1
  echo "headline $i rc=$?"
done
python3 kernels/bench/summarize_runs.py --ref cudnn $W/head_*.json | tee $W/headline.txt
tar czf $OUT/v14call4.tgz -C /tmp v14c4

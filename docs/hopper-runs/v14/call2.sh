#!/usr/bin/env bash
# Session 12 call 2: the final v14 binaries (auto: s3 _osk below 16k keys, n176 _os from 16k). The d128, auto and API
# kernel cases; _osk and n176 _os (forced split) on 3 blocks; the server suites and requests through the server (auto's
# s3 _osk, causal and not, bf16 and fp16, verified); three processes of d128 auto / s3 / n176_os from 512 to 16k
# beside cuDNN; two processes of the whole table (auto, every head_dim) beside cuDNN and FA2.
set -u
C=.carry-hopper; W=/tmp/v14c2; mkdir -p $W
export LD_LIBRARY_PATH=$PWD/$C/lib
T=$C/gpu_attention_test; L=$C/new/libattnd_kernels_c.so
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -6; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > $W/env.txt
timeout 200 $T --gtest_filter='*hopper_sm90_d128*:*auto_*:KernelApi*' > $W/suite.log 2>&1
echo "suite rc=$?"; pass $W/suite.log
ATTND_HOPPER_MAX_BLOCKS=3 timeout 60 $T --gtest_filter='*_osk_*' > $W/osk_blocks3.log 2>&1
echo "osk 3 blocks rc=$?"; pass $W/osk_blocks3.log
ATTND_HOPPER_SPLIT_TAIL=2 ATTND_HOPPER_MAX_BLOCKS=3 timeout 60 $T --gtest_filter='*hopper_sm90_d128_m128n176s2_os_*' \
  > $W/n176os_split3.log 2>&1
echo "n176_os forced split 3 blocks rc=$?"; pass $W/n176os_split3.log
OUT=$W/server SKIP_IPC=1 SKIP_SHM=1 SKIP_INLINE=1 INLINE_SEQS="" PORT=51100 timeout 200 bash server/cuda/tools/device_run.sh \
  > $W/server_run.txt 2>&1
echo "server tests rc=$?"; grep -E "^\[  (PASSED|FAILED) |=== .* rc=|^FAIL" $W/server/tests.log
mkdir -p /tmp/bins && tar xf .carry-cuda/bins.tar.xz -C /tmp/bins
/tmp/bins/attnd --listen=127.0.0.1:51111 --log_level=info > $W/attnd.log 2>&1 &
pid=$!
for i in $(seq 1 100); do /tmp/bins/attn info --target=127.0.0.1:51111 > /dev/null 2>&1 && break; sleep 0.2; done
for mask in causal none; do
  for dt in bf16 fp16; do
    timeout 100 /tmp/bins/attn call --target=127.0.0.1:51111 --batch=2 --q_len=2000 --kv_len=4096 --q_heads=8 \
      --kv_heads=2 --head_dim=128 --mask=$mask --dtype=$dt --verify > $W/call_4096_${mask}_$dt.txt 2>&1
    echo "kv 4096 $mask $dt rc=$?"; grep -E "reply:|verify: (PASS|FAIL)" $W/call_4096_${mask}_$dt.txt | head -2
  done
done
/tmp/bins/attn stats --target=127.0.0.1:51111 > $W/stats.txt 2>&1
kill -TERM $pid; wait $pid; echo "attnd exit rc=$?"
a=hopper_sm90_d128_m128n128s3; b=hopper_sm90_d128_m128n176s2_os
for i in 1 2 3; do
  case $i in 1) cfg=hopper,$a,$b;; 2) cfg=$b,$a,hopper;; 3) cfg=$a,hopper,$b;; esac
  PYTHONUNBUFFERED=1 timeout 100 python3 kernels/bench/hopper_bench.py --lib $L --configs $cfg --peers cudnn --rep 30 \
    --head_dims 128 --seqs 512,1024,2048,4096,8192,16384 --json $W/d128_$i.json > $W/d128_$i.txt 2>&1
  echo "d128 bench $i rc=$?"
done
python3 kernels/bench/summarize_runs.py --ref cudnn $W/d128_*.json | tee $W/d128_summary.txt
for i in 1 2; do
  PYTHONUNBUFFERED=1 timeout 150 python3 kernels/bench/hopper_bench.py --lib $L --configs hopper --peers cudnn,fa2 \
    --rep 30 --json $W/table_$i.json > $W/table_$i.txt 2>&1
  echo "table $i rc=$?"
done
python3 kernels/bench/summarize_runs.py --ref cudnn $W/table_*.json > $W/table_summary.txt
tail -n 40 $W/table_1.txt
tar czf $OUT/v14call2.tgz -C /tmp v14c2

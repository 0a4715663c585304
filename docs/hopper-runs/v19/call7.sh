#!/usr/bin/env bash
# v19 call 2: the quad-max skip (softmax_sm90.cuh). Step parts, suite, 3 blocks, sanitizers, settled A/B against base.
set -u
C=.carry-hopper; W=/tmp/v19c2; mkdir -p $W
trap 'tar czf $OUT/v19c2.tgz -C /tmp v19c2' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -8; }
ATTND_HOPPER_SPLIT_TAIL=0 timeout 100 $C/hopper_trace \
  hopper_sm90_d128_m128n128s3_osk 4 4096 16 0 hopper_sm90_d128_m128n176s2_os 1 16384 16 0 \
  hopper_sm90_d128_m128n176s2_os 1 16384 16 1 hopper_sm90_d128_m128n128s3_osk 16 1024 16 0 \
  hopper_sm90_d64_m192n128s4 4 4096 32 0 hopper_sm90_d256_m128n64s2 4 4096 8 0 > $W/trace.log 2>&1
echo "trace rc=$?"; grep -E '^==|^steady|^step parts' $W/trace.log
T=$C/t19
timeout 240 $T --gtest_filter='*hopper*:*Auto*:*KernelApi*' > $W/suite.log 2>&1; echo "suite rc=$?"; pass $W/suite.log
ATTND_HOPPER_MAX_BLOCKS=3 timeout 120 $T --gtest_filter='*hopper_sm90_d128_m128n128s3_osk_*:*hopper_sm90_d128_m128n176s2_os_*:*hopper_sm90_d64_m192n128s4_*:*hopper_sm90_d256_m128n64s2_*' > $W/blocks3.log 2>&1
echo "3 blocks rc=$?"; pass $W/blocks3.log
S='*hopper_sm90_d128_m128n176s2_os_d128_sq1000_tl*:*hopper_sm90_d128_m128n128s3_osk_d128_b3_gqa8to2_tl*:*hopper_sm90_d64_m192n128s4_d64_q1000kv65_br*'
for tool in memcheck racecheck; do
  f=$S; [ $tool = racecheck ] && f='*hopper_sm90_d128_m128n128s3_osk_d128_sq129_tl*'
  ATTND_HOPPER_MAX_BLOCKS=3 ATTND_GPU_TEST_SMALL=1 timeout 90 compute-sanitizer --tool $tool --error-exitcode 9 $T \
    --gtest_filter="$f" > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done
echo "t=$SECONDS"
N=$C/v19/libattnd_kernels_c.so; B=$C/base/libattnd_kernels_c.so
for i in 1 2 3 4; do
  [ $SECONDS -gt 440 ] && break
  order=""; cfg=auto,base:auto; [ $((i % 2)) = 1 ] && order=--peers_last
  [ $((i % 2)) = 0 ] && cfg=base:auto,auto
  hd=128; [ $i -ge 3 ] && hd=64,256
  PYTHONUNBUFFERED=1 timeout 130 python3 kernels/bench/hopper_bench.py --lib $N --base_lib $B --configs $cfg --peers cudnn \
    --rep 100 --settle_ms 500 $order --head_dims $hd --seqs 1024,2048,4096,8192,16384 --json $W/ab_$i.json > $W/ab_$i.txt 2>&1
  echo "ab $i rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref base:auto $W/ab_*.json > $W/ab_summary.txt
grep -E '^\(|auto / base' $W/ab_summary.txt | head -120

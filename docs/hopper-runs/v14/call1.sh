#!/usr/bin/env bash
# Session 12 call 1: v14, split O stages (_osk: warpgroup 0's O into the last block's K stage, warpgroup 1's into its
# V stage, no wait for the other warpgroup's last P V). The _osk suite on the full grid and on 3 and 5 blocks, forced
# split tails on 3 and 7 blocks (128x176), memcheck / racecheck / synccheck, then bench processes timing s3 / s3_os /
# s3_osk from 1k to 8k and n176_os / n176_osk at 16k beside cuDNN, the order rotated between processes.
set -u
C=.carry-hopper; W=/tmp/v14c1; mkdir -p $W
export LD_LIBRARY_PATH=$PWD/$C/lib
T=$C/gpu_attention_test
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -6; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > $W/env.txt
timeout 30 $T --gtest_filter='*hopper_sm90_d128_m128n128s3_osk_d128_sq129_tl*' > $W/smoke.log 2>&1
echo "smoke rc=$?"; tail -2 $W/smoke.log
timeout 150 $T --gtest_filter='*_osk_*:*_os_*' > $W/suite.log 2>&1
echo "suite rc=$?"; pass $W/suite.log
for nb in 3 5; do
  ATTND_HOPPER_MAX_BLOCKS=$nb timeout 90 $T --gtest_filter='*_osk_*' > $W/blocks$nb.log 2>&1
  echo "$nb blocks rc=$?"; pass $W/blocks$nb.log
done
for nb in 3 7; do
  ATTND_HOPPER_SPLIT_TAIL=2 ATTND_HOPPER_MAX_BLOCKS=$nb timeout 60 $T \
    --gtest_filter='*hopper_sm90_d128_m128n176s2_osk_*' > $W/split_blocks$nb.log 2>&1
  echo "forced split, $nb blocks rc=$?"; pass $W/split_blocks$nb.log
done
for tool in memcheck racecheck synccheck; do
  f='*hopper_sm90_d128_m128n128s3_osk_d128_sq129_tl*:*hopper_sm90_d128_m128n176s2_osk_d128_b3_gqa8to2_tl*'
  [ $tool = racecheck ] && f='*hopper_sm90_d128_m128n128s3_osk_d128_sq129_tl*:*hopper_sm90_d128_m128n176s2_osk_d128_sq129_tl*'
  ATTND_HOPPER_SPLIT_TAIL=2 ATTND_HOPPER_MAX_BLOCKS=3 ATTND_GPU_TEST_SMALL=1 timeout 100 compute-sanitizer --tool $tool \
    --error-exitcode 9 $T --gtest_filter="$f" > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done
L=$C/new/libattnd_kernels_c.so
a=hopper_sm90_d128_m128n128s3; b=${a}_os; c=${a}_osk
for i in 1 2 3 4; do
  case $i in 1) cfg=$a,$b,$c;; 2) cfg=$c,$b,$a;; 3) cfg=$b,$c,$a;; 4) cfg=$c,$a,$b;; esac
  PYTHONUNBUFFERED=1 timeout 90 python3 kernels/bench/hopper_bench.py --lib $L --configs $cfg --peers cudnn --rep 30 \
    --head_dims 128 --seqs 1024,2048,4096,8192 --json $W/short_$i.json > $W/short_$i.txt 2>&1
  echo "short bench $i rc=$?"
done
python3 kernels/bench/summarize_runs.py --ref $b $W/short_*.json | tee $W/short_summary.txt
a=hopper_sm90_d128_m128n176s2_os; b=hopper_sm90_d128_m128n176s2_osk
for i in 1 2 3; do
  cfg=$a,$b; [ $i = 2 ] && cfg=$b,$a
  PYTHONUNBUFFERED=1 timeout 80 python3 kernels/bench/hopper_bench.py --lib $L --configs $cfg --peers cudnn --rep 40 \
    --head_dims 128 --seqs 16384 --json $W/long_$i.json > $W/long_$i.txt 2>&1
  echo "16k bench $i rc=$?"
done
python3 kernels/bench/summarize_runs.py --ref $a $W/long_*.json | tee $W/long_summary.txt
tar czf $OUT/v14call1.tgz -C /tmp v14c1

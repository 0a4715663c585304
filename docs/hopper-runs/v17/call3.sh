#!/usr/bin/env bash
# v17 call 3: the final library (v1c/: the masked P V skip only in the paired kernels of 176-key blocks, the
# shorter split-tail combine, auto's 128x176 without a mask from 8k keys). Its suite, the defaults on 3 blocks,
# forced split tails on 3 and 7 blocks, the sanitizers on paired 128x176 and split cases, then six processes
# timing it against base/ (f6e67f4) at 16k, order alternating.
set -u
C=.carry-hopper; W=/tmp/v17c3; mkdir -p $W
trap 'tar czf $OUT/v17c3.tgz -C /tmp v17c3' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -8; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > $W/env.txt
T=$C/t1c
timeout 30 $T --gtest_filter='*hopper_sm90_d128_m128n176s2_os_d128_sq129_tl*' > $W/smoke.log 2>&1
rc=$?; echo "smoke rc=$rc"; tail -1 $W/smoke.log; [ $rc = 0 ] || exit 1
timeout 120 $T --gtest_filter='*hopper_*:*auto_*:KernelApi*' > $W/suite.log 2>&1
echo "suite rc=$?"; pass $W/suite.log
D='*auto_*:*hopper_sm90_d128_m128n176s2_os_*:*hopper_sm90_d128_m128n128s3_osk_*:*hopper_sm90_d256_m128n64s2_*'
ATTND_HOPPER_MAX_BLOCKS=3 timeout 100 $T --gtest_filter="$D" > $W/blocks3.log 2>&1
echo "3 blocks rc=$?"; pass $W/blocks3.log
F='*hopper_sm90_d128_m128n128s3_d*:*hopper_sm90_d128_m128n176s2_*:*hopper_sm90_d256_m128n64s2_*'
for nb in 3 7; do
  ATTND_HOPPER_MAX_BLOCKS=$nb ATTND_HOPPER_SPLIT_TAIL=2 timeout 100 $T --gtest_filter="$F" > $W/split_$nb.log 2>&1
  echo "split $nb blocks rc=$?"; pass $W/split_$nb.log
done
S='*hopper_sm90_d128_m128n176s2_os_d128_sq1000_tl*:*hopper_sm90_d128_m128n176s2_os_d128_q1000kv65_br*:*hopper_sm90_d256_m128n64s2_d256_sq1000_tl*:*hopper_sm90_d128_m128n176s2_os_d128_sq1000_none*'
for tool in memcheck synccheck racecheck; do
  f=$S; [ $tool = racecheck ] && f='*hopper_sm90_d128_m128n176s2_os_d128_sq129_tl*'
  ATTND_HOPPER_MAX_BLOCKS=3 ATTND_HOPPER_SPLIT_TAIL=2 ATTND_GPU_TEST_SMALL=1 timeout 100 compute-sanitizer --tool $tool \
    --error-exitcode 9 $T --gtest_filter="$f" > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done
N=$C/v1c/libattnd_kernels_c.so; B=$C/base/libattnd_kernels_c.so
for i in 1 2 3 4 5 6; do
  [ $SECONDS -gt 470 ] && break
  cfg=auto,base:auto; [ $((i % 2)) = 0 ] && cfg=base:auto,auto
  PYTHONUNBUFFERED=1 timeout 100 python3 kernels/bench/hopper_bench.py --lib $N --base_lib $B --configs $cfg \
    --peers cudnn --rep 30 --head_dims 128 --seqs 16384 --json $W/long_$i.json > $W/long_$i.txt 2>&1
  echo "long $i rc=$?"
done
python3 kernels/bench/summarize_runs.py --ref base:auto $W/long_*.json | tee $W/long_summary.txt

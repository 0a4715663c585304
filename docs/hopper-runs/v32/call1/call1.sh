#!/usr/bin/env bash
# v32, call 1: warpgroup 1 one or two GEMM turns behind warpgroup 0 (`hopper_sm90_d64_m128n128s6_p2_l1`, `_l2`): their
# suites on the full grid, on 3 blocks (static and dynamic order), memcheck / synccheck / racecheck, then an A/B
# against auto (s6 `_p2`, the same code without the lag) on the d64 rows, cuDNN last in the same processes.
# .carry-hopper: t40 and v40/ (main + this change), lib/ (the abseil .so files).
set -u
C=.carry-hopper; W=/tmp/v32c1; mkdir -p $W
trap 'tar czf $OUT/v32c1.tgz -C /tmp v32c1' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/t40; N=$C/v40/libattnd_kernels_c.so; L1=hopper_sm90_d64_m128n128s6_p2_l1; L2=hopper_sm90_d64_m128n128s6_p2_l2
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv,noheader
F='*m128n128s6_p2_l1_*:*m128n128s6_p2_l2_*'
timeout 100 $T --gtest_filter="$F" > $W/suite.log 2>&1; rc=$?; echo "suite rc=$rc t=$SECONDS"; pass $W/suite.log
[ $rc = 0 ] || { grep -B5 -A20 'Failure\|error' $W/suite.log | head -60; exit 1; }
ATTND_HOPPER_MAX_BLOCKS=3 timeout 100 $T --gtest_filter="$F" > $W/blocks3.log 2>&1
echo "3 blocks rc=$? t=$SECONDS"; pass $W/blocks3.log
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 100 $T --gtest_filter="$F" > $W/dyn3.log 2>&1
echo "dynamic, 3 blocks rc=$? t=$SECONDS"; pass $W/dyn3.log
ATTND_HOPPER_SCHEDULE=static ATTND_HOPPER_MAX_BLOCKS=5 timeout 100 $T --gtest_filter="$F" > $W/static5.log 2>&1
echo "static order, 5 blocks rc=$? t=$SECONDS"; pass $W/static5.log
S='*_p2_l1_d64_sq129_tl*:*_p2_l2_d64_q1000kv65_br*:*_p2_l2_d64_sq1000_none*:*_p2_l1_d64_sq1_none*'
for tool in memcheck synccheck; do
  ATTND_HOPPER_MAX_BLOCKS=3 timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 $T --gtest_filter="$S" \
    > $W/san_$tool.log 2>&1
  echo "$tool rc=$? t=$SECONDS"; grep -E 'ERROR SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done
ATTND_HOPPER_MAX_BLOCKS=3 timeout 120 compute-sanitizer --tool racecheck --error-exitcode 9 $T \
  --gtest_filter='*_p2_l1_d64_sq129_tl*:*_p2_l2_d64_sq129_tl*' > $W/san_racecheck.log 2>&1
echo "racecheck rc=$? t=$SECONDS"; grep -E 'RACECHECK SUMMARY' $W/san_racecheck.log | tail -2
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 120 compute-sanitizer --tool racecheck \
  --error-exitcode 9 $T --gtest_filter='*_p2_l1_d64_sq1000_tl*' > $W/san_racecheck_dyn.log 2>&1
echo "racecheck dynamic rc=$? t=$SECONDS"; grep -E 'RACECHECK SUMMARY' $W/san_racecheck_dyn.log | tail -1
orders=(auto,$L1,$L2 $L1,$L2,auto $L2,auto,$L1)
for i in 1 2 3 4 5 6; do
  [ $SECONDS -gt 420 ] && break
  o=${orders[$(((i - 1) % 3))]}
  PYTHONUNBUFFERED=1 timeout 100 python3 kernels/bench/hopper_bench.py --lib $N --configs $o \
    --peers cudnn --rep 100 --settle_ms 500 --peers_last --no-gqa --head_dims 64 --seqs 1024,2048,4096 \
    --json $W/ab_$i.json > $W/ab_$i.txt 2>&1
  echo "ab $i rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref auto $W/ab_*.json > $W/ab_summary.txt
grep -E '^\(| / auto' $W/ab_summary.txt | cut -c1-230
python3 kernels/bench/summarize_runs.py --ref cudnn $W/ab_*.json > $W/ab_cudnn.txt
grep -E '^\(| / cudnn' $W/ab_cudnn.txt | cut -c1-230

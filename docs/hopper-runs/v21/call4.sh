#!/usr/bin/env bash
# v21 call 4 (session 18): call 3's sanitizer filters named auto cases that do not exist; the same tools on the final
# test binary's _p2 cases (auto's kernels), three blocks.
set -u
C=.carry-hopper; W=/tmp/v21c4; mkdir -p $W
trap 'tar czf $OUT/v21c4.tgz -C /tmp v21c4' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/t23
S='*_p2_d128_sq129_tl*:*_p2_d64_q1000kv65_br*:*_p2_d128_q17kv129_br*:*_p2_d64_sq129_tl*'
for tool in memcheck synccheck racecheck; do
  f=$S; [ $tool = racecheck ] && f='*hopper_sm90_d128_m128n128s3_osk_p2_d128_sq129_tl*:*hopper_sm90_d64_m128n128s4_p2_d64_sq129_tl*'
  ATTND_HOPPER_MAX_BLOCKS=3 ATTND_GPU_TEST_SMALL=1 timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 $T \
    --gtest_filter="$f" > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done

#!/usr/bin/env bash
# Session 29, call 5 (prepared, not run: no device time was left): compute-sanitizer (synccheck, racecheck,
# memcheck) on v48's changed path: the two kernels with two P buffers that auto runs (d128 s3 `_osk_p2`, d64 s6
# `_p2`) on cases whose TryStep is rejected (keys ramped down, causal 1000 rows), and on a causal fp16 case with the
# split tail forced on 3 blocks (parts run TryStep too).
# Carry: .carry-hopper/t30.tar.xz (t30/: v48's library, gpu_attention_test and hopper_trace), lib/.
set -u
C=.carry-hopper; W=/tmp/s29c5; mkdir -p $W
trap 'tar czf $OUT/s29c5.tgz -C /tmp s29c5' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
tar xJf $C/t30.tar.xz -C $C || exit 1
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/t30/gpu_attention_test
S='*hopper_sm90_d128_m128n128s3_osk_p2_d128_ramp_down_none:*hopper_sm90_d128_m128n128s3_osk_p2_d128_sq1000_tl'
S="$S:*hopper_sm90_d64_m128n128s6_p2_d64_ramp_down_none:*hopper_sm90_d64_m128n128s6_p2_d64_sq1000_tl"
S="$S:*hopper_sm90_d128_m128n128s3_osk_p2_d128_fp16_b2_long_tl"
for tool in synccheck racecheck memcheck; do
  ATTND_HOPPER_SPLIT_TAIL=2 ATTND_HOPPER_MAX_BLOCKS=3 timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 $T \
    --gtest_filter="$S" > $W/san_$tool.log 2>&1
  echo "$tool rc=$? t=$SECONDS"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done

#!/usr/bin/env bash
# Session 10 call 6: the split tail compiled for fp16 too. GPU suite; forced splits on 3 / 5 / 7 blocks for the three
# split configurations (their fp16 cases included); sanitizers on two forced-split fp16 cases.
set -u
C=.carry-hopper; W=/tmp/s10c6; mkdir -p $W
export LD_LIBRARY_PATH=$PWD/$C/lib
timeout 150 $C/gpu_attention_test > $W/suite.log 2>&1; echo "suite rc=$?"
grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' $W/suite.log | head -12
F='*hopper_sm90_d128_m128n128s3*:*hopper_sm90_d128_m128n176s2*:*hopper_sm90_d256_m128n64s2*'
for nb in 3 5 7; do
  ATTND_HOPPER_MAX_BLOCKS=$nb ATTND_HOPPER_SPLIT_TAIL=2 timeout 150 $C/gpu_attention_test --gtest_filter="$F" > $W/split_blocks$nb.log 2>&1
  echo "forced split, $nb blocks rc=$?"; grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' $W/split_blocks$nb.log | head -12
  grep -c "fp16.*OK \]\|OK \].*fp16" $W/split_blocks$nb.log
done
S='*hopper_sm90_d128_m128n128s3_d128_fp16_b2_long_none*:*hopper_sm90_d256_m128n64s2_d256_fp16_b2_long_tl*'
echo "sanitizer cases: $S"
for tool in memcheck racecheck synccheck; do
  ATTND_HOPPER_MAX_BLOCKS=3 ATTND_HOPPER_SPLIT_TAIL=2 timeout 150 compute-sanitizer --tool $tool $C/gpu_attention_test \
    --gtest_filter="$S" > $W/sanitizer_$tool.log 2>&1
  echo "$tool rc=$?"; grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' $W/sanitizer_$tool.log | head -4
done
tar czf $OUT/s10call6.tgz -C /tmp s10c6

#!/usr/bin/env bash
# Session 11 call 11: the launcher with one launch helper (LaunchKernel / RaiseSmemLimit; device code unchanged, text
# sections compared): every hopper case, auto and the API; the split configurations with the split forced on 3 blocks.
set -u
C=.carry-hopper; W=/tmp/v12c11; mkdir -p $W
export LD_LIBRARY_PATH=$PWD/$C/lib
timeout 300 $C/gpu_attention_test --gtest_filter='*hopper_*:*auto_*:KernelApi*' > $W/suite.log 2>&1
echo "suite rc=$?"; grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' $W/suite.log | head -8
F='*hopper_sm90_d128_m128n128s3_d*:*hopper_sm90_d128_m128n176s2_d*:*hopper_sm90_d128_m128n176s2_os_*:*hopper_sm90_d256_m128n64s2_d*'
ATTND_HOPPER_SPLIT_TAIL=2 ATTND_HOPPER_MAX_BLOCKS=3 timeout 150 $C/gpu_attention_test --gtest_filter="$F" > $W/split3.log 2>&1
echo "forced split, 3 blocks rc=$?"; grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' $W/split3.log | head -4
tar czf $OUT/v12call11.tgz -C /tmp v12c11

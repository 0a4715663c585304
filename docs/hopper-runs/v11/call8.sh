#!/usr/bin/env bash
# Session 10 call 8: the two pools' slot events in one helper (launch_slot.h). GPU suite (the dynamic order's
# 96-launches-on-8-streams test included); forced splits on 3 blocks; one bench process at 16k (the split's pool).
set -u
C=.carry-hopper; W=/tmp/s10c8; mkdir -p $W
export LD_LIBRARY_PATH=$PWD/$C/lib
timeout 150 $C/gpu_attention_test > $W/suite.log 2>&1; echo "suite rc=$?"
grep -hE '^\[  (PASSED|FAILED) |FAILED  \]|DynamicScheduleLaunchesInFlight' $W/suite.log | head -12
F='*hopper_sm90_d128_m128n128s3*:*hopper_sm90_d128_m128n176s2*:*hopper_sm90_d256_m128n64s2*'
ATTND_HOPPER_MAX_BLOCKS=3 ATTND_HOPPER_SPLIT_TAIL=2 timeout 150 $C/gpu_attention_test --gtest_filter="$F" > $W/split_blocks3.log 2>&1
echo "forced split, 3 blocks rc=$?"; grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' $W/split_blocks3.log | head -12
PYTHONUNBUFFERED=1 timeout 120 python3 kernels/bench/hopper_bench.py --lib $C/new/libattnd_kernels_c.so --configs hopper \
  --peers cudnn --rep 40 --head_dims 128,256 --seqs 16384 --no-gqa > $W/bench.txt 2>&1; echo "bench rc=$?"; tail -5 $W/bench.txt
tar czf $OUT/s10call8.tgz -C /tmp s10c8

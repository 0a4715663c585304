#!/usr/bin/env bash
# Session 12 call 6: s3 _osk with its last middle step peeled off the loop (the K hold decided outside it). The
# timeline probes on s3 and _osk (non-causal 1k / 4k, causal 1k); the _osk cases on the full grid and 3 blocks;
# racecheck / synccheck; four bench processes of s3 / _osk beside cuDNN (1k-8k, both masks), the order alternating.
set -u
C=.carry-hopper; W=/tmp/v14c6; mkdir -p $W
export LD_LIBRARY_PATH=$PWD/$C/lib
T=$C/gpu_attention_test; L=$C/new/libattnd_kernels_c.so
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -6; }
a=hopper_sm90_d128_m128n128s3; b=${a}_osk
timeout 120 $C/hopper_trace $a 16 1024 16 0 $b 16 1024 16 0 $a 4 4096 16 0 $b 4 4096 16 0 $a 16 1024 16 1 $b 16 1024 16 1 \
  > $W/trace.log 2>&1
echo "trace rc=$?"; grep -E '^==|^steady|^ +[0-9]+ |producer' $W/trace.log | head -60
timeout 90 $T --gtest_filter="*${b}_*:*auto_*" > $W/suite.log 2>&1
echo "osk + auto rc=$?"; pass $W/suite.log
ATTND_HOPPER_MAX_BLOCKS=3 timeout 60 $T --gtest_filter="*${b}_*" > $W/blocks3.log 2>&1
echo "osk 3 blocks rc=$?"; pass $W/blocks3.log
for tool in racecheck synccheck; do
  ATTND_HOPPER_MAX_BLOCKS=3 ATTND_GPU_TEST_SMALL=1 timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 $T \
    --gtest_filter="*${b}_d128_sq129_tl*:*${b}_d128_b3_gqa8to2_tl*" > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done
for i in 1 2 3 4; do
  cfg=$a,$b; [ $((i % 2)) = 0 ] && cfg=$b,$a
  PYTHONUNBUFFERED=1 timeout 80 python3 kernels/bench/hopper_bench.py --lib $L --configs $cfg --peers cudnn --rep 30 \
    --head_dims 128 --seqs 1024,2048,4096,8192 --json $W/short_$i.json > $W/short_$i.txt 2>&1
  echo "bench $i rc=$?"
done
python3 kernels/bench/summarize_runs.py --ref $a $W/short_*.json | tee $W/short_summary.txt
tar czf $OUT/v14call6.tgz -C /tmp v14c6

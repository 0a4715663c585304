#!/usr/bin/env bash
# Session 12 call 7: v15 candidate, Q per warpgroup (hopper_sm90_d128_m128n128s3_oskq: each warpgroup's 64 rows of Q
# with their own barriers and 64-row TMA box, so warpgroup 0's next Q leaves a turn earlier). Its cases on the full grid
# and on 3 and 5 blocks, sanitizers; the probes beside _osk; four bench processes of _osk / _oskq beside cuDNN.
set -u
C=.carry-hopper; W=/tmp/v14c7; mkdir -p $W
export LD_LIBRARY_PATH=$PWD/$C/lib
T=$C/gpu_attention_test; L=$C/new/libattnd_kernels_c.so
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -6; }
a=hopper_sm90_d128_m128n128s3_osk; b=${a}q
timeout 30 $T --gtest_filter="*${b}_d128_sq129_tl*" > $W/smoke.log 2>&1
echo "smoke rc=$?"; tail -2 $W/smoke.log
timeout 90 $T --gtest_filter="*${b}_*:*auto_*:KernelApi*" > $W/suite.log 2>&1
echo "oskq + auto + API rc=$?"; pass $W/suite.log
for nb in 3 5; do
  ATTND_HOPPER_MAX_BLOCKS=$nb timeout 60 $T --gtest_filter="*${b}_*" > $W/blocks$nb.log 2>&1
  echo "oskq $nb blocks rc=$?"; pass $W/blocks$nb.log
done
for tool in memcheck racecheck synccheck; do
  f="*${b}_d128_sq129_tl*:*${b}_d128_b3_gqa8to2_tl*"
  [ $tool = racecheck ] && f="*${b}_d128_sq129_tl*:*${b}_d128_sections_gqa_tl*"
  ATTND_HOPPER_MAX_BLOCKS=3 ATTND_GPU_TEST_SMALL=1 timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 $T \
    --gtest_filter="$f" > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done
timeout 100 $C/hopper_trace $a 16 1024 16 0 $b 16 1024 16 0 $a 4 4096 16 0 $b 4 4096 16 0 $a 16 1024 16 1 $b 16 1024 16 1 \
  > $W/trace.log 2>&1
echo "trace rc=$?"; grep -E '^==|^steady|^ +[0-9]+ |producer' $W/trace.log | head -60
for i in 1 2 3 4; do
  cfg=$a,$b; [ $((i % 2)) = 0 ] && cfg=$b,$a
  PYTHONUNBUFFERED=1 timeout 80 python3 kernels/bench/hopper_bench.py --lib $L --configs $cfg --peers cudnn --rep 30 \
    --head_dims 128 --seqs 1024,2048,4096,8192 --json $W/short_$i.json > $W/short_$i.txt 2>&1
  echo "bench $i rc=$?"
done
python3 kernels/bench/summarize_runs.py --ref $a $W/short_*.json | tee $W/short_summary.txt
tar czf $OUT/v14call7.tgz -C /tmp v14c7

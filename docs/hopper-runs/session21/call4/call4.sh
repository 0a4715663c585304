#!/usr/bin/env bash
# Session 21, call 4: main at ec1901f (auto on six K/V stages for the d64 short rows, 98965c3) — the whole GPU test
# binary, auto's cases on 3 blocks with split tails forced, memcheck on auto's small d64 cases, then processes of
# the 1k and 16k rows of d64 and d128 (auto and cuDNN, the order alternating) while time is left.
set -u
C=.carry-hopper; W=/tmp/s21c4; mkdir -p $W
trap 'tar czf $OUT/s21c4.tgz -C /tmp s21c4' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED|SKIPPED) |FAILED  \]' "$1" | head -12; }
T=$C/t35; N=$C/v35/libattnd_kernels_c.so
timeout 240 $T > $W/all.log 2>&1; echo "gpu_attention_test (all) rc=$? t=$SECONDS"; pass $W/all.log
ATTND_HOPPER_MAX_BLOCKS=3 ATTND_HOPPER_SPLIT_TAIL=2 timeout 100 $T --gtest_filter='*/auto_*' > $W/auto_split3.log 2>&1
echo "auto, 3 blocks, split tails rc=$? t=$SECONDS"; pass $W/auto_split3.log
ATTND_HOPPER_MAX_BLOCKS=3 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $T \
  --gtest_filter='*/auto_d64_sq129_tl*:*/auto_d64_q1000kv65_br*:*/auto_d64_sq1000_none*' > $W/san_memcheck.log 2>&1
echo "memcheck rc=$? t=$SECONDS"; grep -E 'ERROR SUMMARY' $W/san_memcheck.log | tail -1; pass $W/san_memcheck.log
for i in 1 2 3 4 5 6 7 8; do
  [ $SECONDS -gt 470 ] && break
  o=auto,cudnn; [ $((i % 2)) = 0 ] && o=cudnn,auto
  PYTHONUNBUFFERED=1 timeout 60 python3 kernels/bench/hopper_bench.py --lib $N --configs auto --peers cudnn \
    --rep 100 --settle_ms 500 --order $o --no-gqa --head_dims 64,128 --seqs 1024,16384 --json $W/rows_$i.json \
    > $W/rows_$i.txt 2>&1
  echo "rows $i ($o) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref cudnn $W/rows_*.json > $W/rows_summary.txt
grep -E '^\(|auto / cudnn' $W/rows_summary.txt | cut -c1-220

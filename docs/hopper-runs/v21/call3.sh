#!/usr/bin/env bash
# v21 call 3 (session 18): the final library (auto: d128 s3 _osk_p2 everywhere, d64 m128 _p2 on short problems).
# The whole GPU test binary, auto on 3 blocks with split tails forced, sanitizers on auto, then the whole table
# (settled, cuDNN and FA2 beside), two processes with the order alternating.
set -u
C=.carry-hopper; W=/tmp/v21c3; mkdir -p $W
trap 'tar czf $OUT/v21c3.tgz -C /tmp v21c3' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]|SKIPPED \]' "$1" | head -12; }
T=$C/t23
timeout 150 $T > $W/all.log 2>&1; echo "gpu_attention_test (all) rc=$?"; pass $W/all.log
ATTND_HOPPER_MAX_BLOCKS=3 ATTND_HOPPER_SPLIT_TAIL=2 timeout 100 $T --gtest_filter='*/auto_*' > $W/auto_split3.log 2>&1
echo "auto, 3 blocks, split tails rc=$?"; pass $W/auto_split3.log
S='*/auto_d128_sq129_tl*:*/auto_d64_q1000kv65_br*:*/auto_d128_ramp_down_none*:*/auto_d64_sq129_tl*'
for tool in memcheck racecheck; do
  f=$S; [ $tool = racecheck ] && f='*/auto_d64_sq129_tl*'
  ATTND_HOPPER_MAX_BLOCKS=3 ATTND_GPU_TEST_SMALL=1 timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 $T \
    --gtest_filter="$f" > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done
N=$C/v23/libattnd_kernels_c.so
for i in 1 2; do
  [ $i = 2 ] && [ $SECONDS -gt 250 ] && break
  order=""; [ $i = 1 ] && order=--peers_last
  PYTHONUNBUFFERED=1 timeout 170 python3 kernels/bench/hopper_bench.py --lib $N --configs auto --peers cudnn,fa2 \
    --rep 100 --settle_ms 500 $order --seqs 1024,2048,4096,8192,16384 --json $W/table_$i.json > $W/table_$i.txt 2>&1
  echo "table $i rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref cudnn $W/table_*.json > $W/table_summary.txt
grep -E '^\(|auto / cudnn' $W/table_summary.txt

#!/usr/bin/env bash
# v18 call 1 (prepared in session 16, not run): 192-row d128 tiles with three consumer warpgroups and no
# intra-warpgroup overlap (m192_d128.diff applied; .carry-hopper holds that build's gpu_attention_test as t18 and its
# libattnd_kernels_c.so in v18/). Correctness first (the new configurations' suite cases, 3 blocks, sanitizers), then
# settled timings against auto at 4k-16k, order alternating.
set -u
C=.carry-hopper; W=/tmp/v18c1; mkdir -p $W
trap 'tar czf $OUT/v18c1.tgz -C /tmp v18c1' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -8; }
T=$C/t18
M='*hopper_sm90_d128_m192n128s2_*:*hopper_sm90_d128_m192n96s3_*'
timeout 30 $T --gtest_filter='*hopper_sm90_d128_m192n128s2_d128_sq129_tl*' > $W/smoke.log 2>&1
rc=$?; echo "smoke rc=$rc"; tail -1 $W/smoke.log; [ $rc = 0 ] || exit 1
timeout 120 $T --gtest_filter="$M" > $W/suite.log 2>&1; echo "suite rc=$?"; pass $W/suite.log
ATTND_HOPPER_MAX_BLOCKS=3 timeout 100 $T --gtest_filter="$M" > $W/blocks3.log 2>&1; echo "3 blocks rc=$?"; pass $W/blocks3.log
S='*hopper_sm90_d128_m192n128s2_d128_sq1000_tl*:*hopper_sm90_d128_m192n128s2_d128_b3_gqa8to2_tl*:*hopper_sm90_d128_m192n96s3_d128_q1000kv65_br*'
for tool in memcheck synccheck racecheck; do
  f=$S; [ $tool = racecheck ] && f='*hopper_sm90_d128_m192n128s2_d128_sq129_tl*'
  ATTND_HOPPER_MAX_BLOCKS=3 ATTND_GPU_TEST_SMALL=1 timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 $T \
    --gtest_filter="$f" > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1
done
N=$C/v18/libattnd_kernels_c.so
for i in 1 2 3 4; do
  [ $SECONDS -gt 450 ] && break
  order=""; [ $((i % 2)) = 1 ] && order=--peers_last
  cfg=auto,hopper_sm90_d128_m192n128s2,hopper_sm90_d128_m192n96s3
  [ $((i % 2)) = 0 ] && cfg=hopper_sm90_d128_m192n96s3,hopper_sm90_d128_m192n128s2,auto
  PYTHONUNBUFFERED=1 timeout 120 python3 kernels/bench/hopper_bench.py --lib $N --configs $cfg --peers cudnn \
    --rep 100 --settle_ms 500 $order --head_dims 128 --seqs 4096,8192,16384 --json $W/m192_$i.json > $W/m192_$i.txt 2>&1
  echo "m192 $i rc=$?"
done
python3 kernels/bench/summarize_runs.py --ref auto $W/m192_*.json | tee $W/m192_summary.txt

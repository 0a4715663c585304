#!/usr/bin/env bash
# v23 call 2 (session 19): the hot path's speed of the in-place check, in a build whose overflow path traps (a
# measurement build: 128x176 _os_ck and s3 _osk_ck are spill-free there; d64 m192 / d256 _ck are not, skipped).
# Correctness on everything but the overflow case, step parts, A/B against auto on the d128 table from 1k.
set -u
C=.carry-hopper; W=/tmp/v23c2; mkdir -p $W
trap 'tar czf $OUT/v23c2.tgz -C /tmp v23c2' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/t26t
F='*m128n176s2_os_ck_*:*osk_ck_*:-*spike_none*'
timeout 150 $T --gtest_filter="$F" > $W/suite.log 2>&1; echo "suite rc=$?"; pass $W/suite.log
ATTND_HOPPER_MAX_BLOCKS=3 ATTND_HOPPER_SPLIT_TAIL=2 timeout 150 $T --gtest_filter="$F" > $W/blocks3.log 2>&1
echo "3 blocks, split tails rc=$?"; pass $W/blocks3.log
ATTND_HOPPER_MAX_BLOCKS=3 timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 $T \
  --gtest_filter='*m128n176s2_os_ck_d128_ramp_down_none*:*m128n176s2_os_ck_d128_sq129_tl*:*osk_ck_d128_ramp_down_none*' > $W/san_memcheck.log 2>&1
echo "memcheck rc=$?"; grep -E 'ERROR SUMMARY' $W/san_memcheck.log | tail -1; pass $W/san_memcheck.log
a=hopper_sm90_d128_m128n176s2_os
ATTND_HOPPER_SPLIT_TAIL=0 timeout 100 $C/hopper_trace26t $a 1 16384 16 0 ${a}_ck 1 16384 16 0 \
  $a 1 16384 16 1 ${a}_ck 1 16384 16 1 \
  hopper_sm90_d128_m128n128s3_osk_p2 1 16384 16 1 hopper_sm90_d128_m128n128s3_osk_ck 1 16384 16 1 \
  hopper_sm90_d128_m128n128s3_osk_p2 4 4096 16 0 hopper_sm90_d128_m128n128s3_osk_ck 4 4096 16 0 > $W/trace.log 2>&1
echo "trace rc=$?"; grep -E '^==|^steady|^step parts' $W/trace.log
N=$C/v26t/libattnd_kernels_c.so
bench() {  # name i configs head_dims seqs
  PYTHONUNBUFFERED=1 timeout 150 python3 kernels/bench/hopper_bench.py --lib $N --configs $3 --peers cudnn \
    --rep 100 --settle_ms 500 --peers_last --no-gqa --head_dims $4 --seqs $5 --json $W/$1_$2.json > $W/$1_$2.txt 2>&1
  echo "$1 $2 rc=$? t=$SECONDS"
}
for i in 1 2 3 4; do
  [ $SECONDS -gt 380 ] && break
  if [ $((i % 2)) = 1 ]; then o1=auto,${a}_ck,hopper_sm90_d128_m128n128s3_osk_ck,$a
  else o1=$a,hopper_sm90_d128_m128n128s3_osk_ck,${a}_ck,auto; fi
  bench d128 $i $o1 128 1024,2048,4096,8192,16384
done
python3 kernels/bench/summarize_runs.py --ref auto $W/d128_*.json > $W/d128_summary.txt
grep -E '/ auto' $W/d128_summary.txt | sed 's/hopper_sm90_//g'
grep -E '^\(' $W/d128_summary.txt | sed 's/hopper_sm90_//g' | cut -c1-250

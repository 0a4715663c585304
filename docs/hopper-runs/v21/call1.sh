#!/usr/bin/env bash
# v21 call 1 (session 18): the bf16 P packed with integer ops instead of F2FP (every Hopper config), and, in the two-P-
# buffer configs (_p2), the exponentials before the row max with a row-sum check (Softmax::TryStep). .carry-hopper
# holds that build's gpu_attention_test (t21), library (v21/), hopper_trace (hopper_trace21), main's library (base/)
# and v20's (v20/: _p2 without the check, F2FP). Correctness first, then step parts, then settled A/Bs.
set -u
C=.carry-hopper; W=/tmp/v21c1; mkdir -p $W
trap 'tar czf $OUT/v21c1.tgz -C /tmp v21c1' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/t21
timeout 30 $T --gtest_filter='*hopper_sm90_d128_m128n128s3_osk_p2_d128_sq129_tl*' > $W/smoke.log 2>&1
rc=$?; echo "smoke rc=$rc"; tail -1 $W/smoke.log; [ $rc = 0 ] || exit 1
timeout 200 $T --gtest_filter='*hopper*' > $W/suite.log 2>&1; echo "hopper suite rc=$?"; pass $W/suite.log
ATTND_HOPPER_MAX_BLOCKS=3 timeout 100 $T --gtest_filter='*_p2_*:*hopper_sm90_d128_m128n176s2_os_*:*hopper_sm90_d64_m192n128s4_*' \
  > $W/blocks3.log 2>&1; echo "3 blocks rc=$?"; pass $W/blocks3.log
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 100 $T --gtest_filter='*d64_m128n128s4_p2_*' \
  > $W/dyn3.log 2>&1; echo "d64 dynamic, 3 blocks rc=$?"; pass $W/dyn3.log
S='*_p2_d128_sq129_tl*:*_p2_d64_q1000kv65_br*:*_p2_d128_q17kv129_br*:*_p2_d64_sq129_tl*'
for tool in memcheck synccheck racecheck; do
  f=$S; [ $tool = racecheck ] && f='*hopper_sm90_d128_m128n128s3_osk_p2_d128_sq129_tl*'
  ATTND_HOPPER_MAX_BLOCKS=3 ATTND_GPU_TEST_SMALL=1 timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 $T \
    --gtest_filter="$f" > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done
a=hopper_sm90_d128_m128n128s3_osk; d=hopper_sm90_d64_m128n128s4; e=hopper_sm90_d64_m192n128s4
timeout 120 $C/hopper_trace21 $a 4 4096 16 0 ${a}_p2 4 4096 16 0 $a 16 1024 16 0 ${a}_p2 16 1024 16 0 \
  $d 16 1024 32 1 ${d}_p2 16 1024 32 1 $d 4 4096 32 0 ${d}_p2 4 4096 32 0 $e 4 4096 32 0 \
  hopper_sm90_d128_m128n176s2_os 1 16384 32 0 > $W/trace.log 2>&1
echo "trace rc=$?"; grep -E '^==|^steady|^step parts' $W/trace.log
N=$C/v21/libattnd_kernels_c.so; B=$C/base/libattnd_kernels_c.so
bench() {  # name i configs head_dims seqs
  PYTHONUNBUFFERED=1 timeout 90 python3 kernels/bench/hopper_bench.py --lib $N --base_lib $B --configs $3 --peers cudnn \
    --rep 100 --settle_ms 500 --peers_last --no-gqa --head_dims $4 --seqs $5 --json $W/$1_$2.json > $W/$1_$2.txt 2>&1
  echo "$1 $2 rc=$? t=$SECONDS"
}
for i in 1 2 3 4; do
  [ $SECONDS -gt 480 ] && break
  if [ $((i % 2)) = 1 ]; then o1=auto,${a}_p2,base:auto; o2=auto,${d}_p2,base:auto; o3=auto,base:auto
  else o1=base:auto,${a}_p2,auto; o2=base:auto,${d}_p2,auto; o3=base:auto,auto; fi
  bench d128 $i $o1 128 1024,2048,4096,8192
  bench d64 $i $o2 64 1024,2048,4096
  [ $i -le 2 ] && bench d256 $i $o3 256 1024,4096
done
for n in d128 d64 d256; do python3 kernels/bench/summarize_runs.py --ref base:auto $W/${n}_*.json > $W/${n}_summary.txt; done
grep -E '^\(|/ base:auto' $W/d128_summary.txt $W/d64_summary.txt $W/d256_summary.txt | grep -v cudnn

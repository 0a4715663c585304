#!/usr/bin/env bash
# v21 call 2 (session 18): call 1's integer packing reverted (F2FP again); the _p2 configs keep two P buffers and the
# exponentials before the row max (Softmax::TryStep). .carry-hopper: that build's test (t22), library (v22/) and
# hopper_trace (hopper_trace22). Correctness of the _p2 configs, step parts, then settled A/Bs of _p2 against auto on
# every sequence length, for auto's rules.
set -u
C=.carry-hopper; W=/tmp/v21c2; mkdir -p $W
trap 'tar czf $OUT/v21c2.tgz -C /tmp v21c2' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/t22
timeout 30 $T --gtest_filter='*hopper_sm90_d128_m128n128s3_osk_p2_d128_sq129_tl*' > $W/smoke.log 2>&1
rc=$?; echo "smoke rc=$rc"; tail -1 $W/smoke.log; [ $rc = 0 ] || exit 1
timeout 120 $T --gtest_filter='*_p2_*:*/auto_*' > $W/suite.log 2>&1; echo "suite (_p2, auto) rc=$?"; pass $W/suite.log
ATTND_HOPPER_MAX_BLOCKS=3 timeout 100 $T --gtest_filter='*_p2_*' > $W/blocks3.log 2>&1; echo "3 blocks rc=$?"; pass $W/blocks3.log
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 100 $T --gtest_filter='*d64_m128n128s4_p2_*' \
  > $W/dyn3.log 2>&1; echo "d64 dynamic, 3 blocks rc=$?"; pass $W/dyn3.log
ATTND_HOPPER_MAX_BLOCKS=3 ATTND_GPU_TEST_SMALL=1 timeout 100 compute-sanitizer --tool memcheck --error-exitcode 9 $T \
  --gtest_filter='*_p2_d128_sq129_tl*:*_p2_d64_q1000kv65_br*:*_p2_d128_ramp_down_none*' > $W/san_memcheck.log 2>&1
echo "memcheck rc=$?"; grep -E 'ERROR SUMMARY' $W/san_memcheck.log | tail -1; pass $W/san_memcheck.log
a=hopper_sm90_d128_m128n128s3_osk; d=hopper_sm90_d64_m128n128s4
timeout 120 $C/hopper_trace22 ${a}_p2 4 4096 16 0 ${a}_p2 16 1024 16 0 ${d}_p2 16 1024 32 1 ${d}_p2 4 4096 32 0 \
  ${a}_p2 1 16384 32 0 hopper_sm90_d128_m128n176s2_os 1 16384 32 0 ${a}_p2 1 16384 32 1 > $W/trace.log 2>&1
echo "trace rc=$?"; grep -E '^==|^steady|^step parts' $W/trace.log
N=$C/v22/libattnd_kernels_c.so
bench() {  # name i configs head_dims seqs
  PYTHONUNBUFFERED=1 timeout 120 python3 kernels/bench/hopper_bench.py --lib $N --configs $3 --peers cudnn \
    --rep 100 --settle_ms 500 --peers_last --no-gqa --head_dims $4 --seqs $5 --json $W/$1_$2.json > $W/$1_$2.txt 2>&1
  echo "$1 $2 rc=$? t=$SECONDS"
}
for i in 1 2 3 4; do
  [ $SECONDS -gt 440 ] && break
  if [ $((i % 2)) = 1 ]; then o1=auto,${a}_p2; o2=auto,${d}_p2; else o1=${a}_p2,auto; o2=${d}_p2,auto; fi
  bench d128 $i $o1 128 1024,2048,4096,8192,16384
  bench d64 $i $o2 64 1024,2048,4096,8192,16384
done
for n in d128 d64; do python3 kernels/bench/summarize_runs.py --ref auto $W/${n}_*.json > $W/${n}_summary.txt; done
grep -E '^\(|_p2 / auto' $W/d128_summary.txt $W/d64_summary.txt | grep -v cudnn | sed 's/hopper_sm90_//g'

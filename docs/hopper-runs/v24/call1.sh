#!/usr/bin/env bash
# v24 call 1 (session 19): the full step's row max in four chains a row instead of one. .carry-hopper: the build's
# test binary (t27), library (v27/), hopper_trace (hopper_trace27), main's library (base/), a small kernel compiled
# with the old and new Step (mxv_old/new.cubin). SASS of the max, correctness, step parts, A/B against main.
set -u
C=.carry-hopper; W=/tmp/v24c1; mkdir -p $W
trap 'tar czf $OUT/v24c1.tgz -C /tmp v24c1' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
for v in old new; do cuobjdump -sass $C/mxv_$v.cubin | grep -E 'FMNMX|MUFU|SHFL|VOTE' > $W/mxv_$v.sass; done
echo "FMNMX old/new: $(grep -c FMNMX $W/mxv_old.sass) $(grep -c FMNMX $W/mxv_new.sass)"
T=$C/t27
timeout 240 $T --gtest_filter='*hopper*' > $W/suite.log 2>&1; echo "hopper suite rc=$?"; pass $W/suite.log
ATTND_HOPPER_MAX_BLOCKS=3 ATTND_HOPPER_SPLIT_TAIL=2 timeout 150 $T --gtest_filter='*auto*' > $W/auto3.log 2>&1
echo "auto on 3 blocks, split tails rc=$?"; pass $W/auto3.log
ATTND_HOPPER_MAX_BLOCKS=3 timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 $T \
  --gtest_filter='*m192n128s4_d64_sq129_tl*:*m128n176s2_os_d128_ramp_down_none*:*osk_p2_d128_sq129_tl*' > $W/san_memcheck.log 2>&1
echo "memcheck rc=$?"; grep -E 'ERROR SUMMARY' $W/san_memcheck.log | tail -1; pass $W/san_memcheck.log
ATTND_HOPPER_SPLIT_TAIL=0 timeout 100 $C/hopper_trace27 hopper_sm90_d128_m128n176s2_os 1 16384 16 0 \
  hopper_sm90_d64_m192n128s4 4 4096 32 0 hopper_sm90_d64_m128n128s4_p2 16 1024 32 1 \
  hopper_sm90_d256_m128n64s2 2 8192 8 0 > $W/trace.log 2>&1
echo "trace rc=$?"; grep -E '^==|^step parts' $W/trace.log | cut -c1-260
N=$C/v27/libattnd_kernels_c.so; B=$C/base/libattnd_kernels_c.so
bench() {  # name i configs head_dims seqs
  PYTHONUNBUFFERED=1 timeout 150 python3 kernels/bench/hopper_bench.py --lib $N --base_lib $B --configs $3 \
    --peers cudnn --rep 100 --settle_ms 500 --peers_last --no-gqa --head_dims $4 --seqs $5 --json $W/$1_$2.json \
    > $W/$1_$2.txt 2>&1
  echo "$1 $2 rc=$? t=$SECONDS"
}
for i in 1 2 3 4; do
  [ $SECONDS -gt 400 ] && break
  if [ $((i % 2)) = 1 ]; then o=auto,base:auto; else o=base:auto,auto; fi
  bench d64 $i $o 64 1024,2048,4096,8192,16384
  bench d128 $i $o 128 1024,16384
  bench d256 $i $o 256 2048,16384
done
for n in d64 d128 d256; do python3 kernels/bench/summarize_runs.py --ref base:auto $W/${n}_*.json > $W/${n}_summary.txt; done
grep -E '^\(|auto / base' $W/d64_summary.txt $W/d128_summary.txt $W/d256_summary.txt | grep -v 'cudnn /' | cut -c1-200

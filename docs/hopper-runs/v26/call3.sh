#!/usr/bin/env bash
# v26 call 3: one masked Step in the first block, taking the live count (call 2 had a second copy of it); where the
# time goes (hopper_trace: library time and the middle steps' parts, _sk beside its base); then A/Bs.
set -u
C=.carry-hopper; W=/tmp/v26c3; mkdir -p $W
trap 'tar czf $OUT/v26c3.tgz -C /tmp v26c3' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/t31; N=$C/v31/libattnd_kernels_c.so
timeout 200 $T --gtest_filter='*_sk_*' > $W/suite.log 2>&1; rc=$?; echo "suite rc=$rc"; pass $W/suite.log
[ $rc = 0 ] || exit 1
ATTND_HOPPER_MAX_BLOCKS=3 ATTND_HOPPER_SPLIT_TAIL=2 timeout 200 $T --gtest_filter='*_sk_*' > $W/blocks3.log 2>&1
echo "3 blocks, split tails rc=$?"; pass $W/blocks3.log
ATTND_HOPPER_SPLIT_TAIL=0 timeout 150 $C/hopper_trace31 hopper_sm90_d64_m128n128s4_p2 16 1024 32 1 \
  hopper_sm90_d64_m128n128s4_p2_sk 16 1024 32 1 hopper_sm90_d64_m192n128s4 2 8192 32 1 \
  hopper_sm90_d64_m192n128s4_sk 2 8192 32 1 hopper_sm90_d128_m128n128s3_osk_p2 16 1024 16 1 \
  hopper_sm90_d128_m128n128s3_osk_p2_sk 16 1024 16 1 > $W/trace.log 2>&1
echo "trace rc=$?"; grep -E '^==|^step parts' $W/trace.log | cut -c1-300
bench() {  # name i configs head_dims seqs
  PYTHONUNBUFFERED=1 timeout 150 python3 kernels/bench/hopper_bench.py --lib $N --configs $3 --peers cudnn --causal yes \
    --rep 100 --settle_ms 500 --peers_last --no-gqa --head_dims $4 --seqs $5 --json $W/$1_$2.json > $W/$1_$2.txt 2>&1
  echo "$1 $2 rc=$? t=$SECONDS"
}
a64=hopper_sm90_d64_m128n128s4_p2_sk; a128=hopper_sm90_d128_m128n128s3_osk_p2_sk
for i in 1 2 3 4; do
  [ $SECONDS -gt 300 ] && break
  if [ $((i % 2)) = 1 ]; then o1=auto,$a64; o2=auto,$a128
  else o1=$a64,auto; o2=$a128,auto; fi
  bench d64 $i $o1 64 1024,2048
  bench d128 $i $o2 128 1024
done
for x in d64 d128; do python3 kernels/bench/summarize_runs.py --ref auto $W/${x}_*.json > $W/${x}_summary.txt; done
grep -hE '^\(|_sk / ' $W/d64_summary.txt $W/d128_summary.txt | sed 's/hopper_sm90_//g' | cut -c1-220

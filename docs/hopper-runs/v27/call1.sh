#!/usr/bin/env bash
# v27 call 1: deeper K/V rings for d64 (s5 / s6 with two P buffers at m128, s6 at m192). Does the middle step's K and V
# wait (~15% of a d64 causal 1k step) shrink, and do the short rows gain? Suites first, then step parts, then A/Bs.
set -u
C=.carry-hopper; W=/tmp/v27c1; mkdir -p $W
trap 'tar czf $OUT/v27c1.tgz -C /tmp v27c1' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/t32; N=$C/v32/libattnd_kernels_c.so
F='*m128n128s5_p2_*:*m128n128s6_p2_*:*m192n128s6_*'
timeout 100 $T --gtest_filter="$F" > $W/suite.log 2>&1; rc=$?; echo "suite rc=$rc"; pass $W/suite.log
[ $rc = 0 ] || exit 1
ATTND_HOPPER_MAX_BLOCKS=3 ATTND_HOPPER_SPLIT_TAIL=2 timeout 100 $T --gtest_filter="$F" > $W/blocks3.log 2>&1
echo "3 blocks, split tails rc=$?"; pass $W/blocks3.log
ATTND_HOPPER_SPLIT_TAIL=0 timeout 60 $C/hopper_trace32 hopper_sm90_d64_m128n128s4_p2 16 1024 32 1 \
  hopper_sm90_d64_m128n128s6_p2 16 1024 32 1 > $W/trace.log 2>&1
echo "trace rc=$?"; grep -E '^==|^step parts' $W/trace.log | cut -c1-300
bench() {  # name i configs head_dims seqs causal
  PYTHONUNBUFFERED=1 timeout 100 python3 kernels/bench/hopper_bench.py --lib $N --configs $3 --peers cudnn --causal $6 \
    --rep 100 --settle_ms 500 --peers_last --no-gqa --head_dims $4 --seqs $5 --json $W/$1_$2.json > $W/$1_$2.txt 2>&1
  echo "$1 $2 rc=$? t=$SECONDS"
}
s5=hopper_sm90_d64_m128n128s5_p2; s6=hopper_sm90_d64_m128n128s6_p2; m6=hopper_sm90_d64_m192n128s6
for i in 1 2 3 4; do
  [ $SECONDS -gt 200 ] && break
  if [ $((i % 2)) = 1 ]; then o=auto,$s6,$s5; om=auto,$m6; else o=$s5,$s6,auto; om=$m6,auto; fi
  bench short $i $o 64 1024,2048 yes
  bench shortnc $i $o 64 1024 no
  [ $i -le 2 ] && bench m192 $i $om 64 2048,4096 no
done
for x in short shortnc m192; do python3 kernels/bench/summarize_runs.py --ref auto $W/${x}_*.json > $W/${x}_summary.txt; done
grep -hE '^\(| / auto' $W/short_summary.txt $W/shortnc_summary.txt $W/m192_summary.txt | sed 's/hopper_sm90_//g' | cut -c1-220

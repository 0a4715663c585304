#!/usr/bin/env bash
# Session 21, call 7 (v29): the split tail compiled for auto's d128 kernel (s3 `_osk_p2`; since v21 auto's at every
# d128 length, and not in MaySplitTail, so d128 ran without the split tail since then). Its cases with split tails
# forced on 3 and 7 blocks, the defaults on the full grid, memcheck / racecheck on forced splits, then processes of
# the new library's auto against main's (`base:auto`, --base_lib) on the d128 rows from 4k, order alternating.
set -u
C=.carry-hopper; W=/tmp/v29c7; mkdir -p $W
trap 'tar czf $OUT/v29c7.tgz -C /tmp v29c7' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/t36; N=$C/v36/libattnd_kernels_c.so; B=$C/v35/libattnd_kernels_c.so
F='*d128_m128n128s3_osk_p2_*:*/auto_d128*'
timeout 60 $T --gtest_filter="$F" > $W/suite.log 2>&1; rc=$?; echo "suite rc=$rc t=$SECONDS"; pass $W/suite.log
[ $rc = 0 ] || exit 1
for n in 3 7; do
  ATTND_HOPPER_MAX_BLOCKS=$n ATTND_HOPPER_SPLIT_TAIL=2 timeout 60 $T --gtest_filter="$F" > $W/split$n.log 2>&1
  echo "$n blocks, split tails forced rc=$? t=$SECONDS"; pass $W/split$n.log
done
for tool in memcheck racecheck; do
  ATTND_HOPPER_MAX_BLOCKS=3 ATTND_HOPPER_SPLIT_TAIL=2 timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 $T \
    --gtest_filter='*d128_m128n128s3_osk_p2_d128_sq1000_tl*:*d128_m128n128s3_osk_p2_d128_sq1000_none*' \
    > $W/san_$tool.log 2>&1
  echo "$tool rc=$? t=$SECONDS"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done
for i in 1 2 3 4 5 6; do
  [ $SECONDS -gt 250 ] && break
  if [ $((i % 2)) = 1 ]; then o=auto,base:auto; else o=base:auto,auto; fi
  PYTHONUNBUFFERED=1 timeout 60 python3 kernels/bench/hopper_bench.py --lib $N --base_lib $B --configs $o \
    --peers cudnn --rep 100 --settle_ms 500 --peers_last --head_dims 128 --seqs 4096,8192,16384 \
    --json $W/ab_$i.json > $W/ab_$i.txt 2>&1
  echo "ab $i rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref base:auto $W/ab_*.json > $W/ab_summary.txt
grep -E '^\(| auto / base:auto' $W/ab_summary.txt | cut -c1-200

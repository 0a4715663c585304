#!/usr/bin/env bash
# Session 21, call 3 (v28): d64 m128 s6 `_p2` with split O stages (`_osk`, O through shared memory and TMA) —
# the suite on it (full grid, 3 blocks with split tails forced, the dynamic order forced on 3 blocks), the
# sanitizers on small cases (dynamic order forced: new for `_osk` since v14's d64 run), then six processes of
# auto (s6 `_p2` on the short rows) against it, the attnd column order alternating, cuDNN last.
set -u
C=.carry-hopper; W=/tmp/v28c3; mkdir -p $W
trap 'tar czf $OUT/v28c3.tgz -C /tmp v28c3' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/t34; N=$C/v34/libattnd_kernels_c.so; X=hopper_sm90_d64_m128n128s6_osk_p2
F='*m128n128s6_osk_p2_*'
timeout 150 $T --gtest_filter="$F" > $W/suite.log 2>&1; rc=$?; echo "suite rc=$rc"; pass $W/suite.log
[ $rc = 0 ] || exit 1
ATTND_HOPPER_MAX_BLOCKS=3 ATTND_HOPPER_SPLIT_TAIL=2 timeout 150 $T --gtest_filter="$F" > $W/blocks3.log 2>&1
echo "3 blocks, split tails rc=$?"; pass $W/blocks3.log
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 100 $T --gtest_filter="$F" > $W/dyn3.log 2>&1
echo "dynamic, 3 blocks rc=$?"; pass $W/dyn3.log
S='*m128n128s6_osk_p2_d64_sq129_tl*:*m128n128s6_osk_p2_d64_q1000kv65_br*:*m128n128s6_osk_p2_d64_sq1000_none*'
for tool in memcheck synccheck racecheck; do
  f=$S; [ $tool = racecheck ] && f='*m128n128s6_osk_p2_d64_sq129_tl*'
  ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 150 compute-sanitizer --tool $tool \
    --error-exitcode 9 $T --gtest_filter="$f" > $W/san_$tool.log 2>&1
  echo "$tool (dynamic) rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1
done
ATTND_HOPPER_MAX_BLOCKS=3 ATTND_HOPPER_SPLIT_TAIL=2 timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 \
  $T --gtest_filter='*m128n128s6_osk_p2_d64_sq1000_none*' > $W/san_racecheck_static.log 2>&1
echo "racecheck (static, split tails) rc=$?"; grep -E 'RACECHECK SUMMARY' $W/san_racecheck_static.log | tail -1
for i in 1 2 3 4 5 6; do
  [ $SECONDS -gt 480 ] && break
  if [ $((i % 2)) = 1 ]; then o=auto,$X; else o=$X,auto; fi
  PYTHONUNBUFFERED=1 timeout 100 python3 kernels/bench/hopper_bench.py --lib $N --configs $o \
    --peers cudnn --rep 100 --settle_ms 500 --peers_last --no-gqa --head_dims 64 --seqs 1024,2048,4096 \
    --json $W/ab_$i.json > $W/ab_$i.txt 2>&1
  echo "ab $i rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref auto $W/ab_*.json > $W/ab_summary.txt
grep -E '^\(| / auto' $W/ab_summary.txt | cut -c1-220

#!/usr/bin/env bash
# v27, prepared for the next session's first device call (not run): what `hopper_sm90_d64_m128n128s6_p2` still needs
# before auto takes it (auto_s6.diff), then the A/B of that auto against main's. .carry-hopper: that build's
# gpu_attention_test as t33 and library in v33/ (main + auto_s6.diff), main's library in base/, the absl .so in lib/.
set -u
C=.carry-hopper; W=/tmp/v27n; mkdir -p $W
trap 'tar czf $OUT/v27n.tgz -C /tmp v27n' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/t33; N=$C/v33/libattnd_kernels_c.so; B=$C/base/libattnd_kernels_c.so
F='*m128n128s6_p2_*:*auto_*'
timeout 150 $T --gtest_filter="$F" > $W/suite.log 2>&1; rc=$?; echo "suite rc=$rc"; pass $W/suite.log
[ $rc = 0 ] || exit 1
ATTND_HOPPER_MAX_BLOCKS=3 ATTND_HOPPER_SPLIT_TAIL=2 timeout 150 $T --gtest_filter="$F" > $W/blocks3.log 2>&1
echo "3 blocks, split tails rc=$?"; pass $W/blocks3.log
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 100 $T --gtest_filter='*m128n128s6_p2_*' \
  > $W/dyn3.log 2>&1
echo "dynamic, 3 blocks rc=$?"; pass $W/dyn3.log
S='*m128n128s6_p2_d64_sq129_tl*:*m128n128s6_p2_d64_q1000kv65_br*:*m128n128s6_p2_d64_sq1000_none*'
for tool in memcheck synccheck racecheck; do
  f=$S; [ $tool = racecheck ] && f='*m128n128s6_p2_d64_sq129_tl*'
  ATTND_HOPPER_MAX_BLOCKS=3 timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 $T --gtest_filter="$f" \
    > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 150 compute-sanitizer --tool racecheck \
  --error-exitcode 9 $T --gtest_filter='*m128n128s6_p2_d64_sq1000_tl*' > $W/san_racecheck_dyn.log 2>&1
echo "racecheck dynamic rc=$?"; grep -E 'RACECHECK SUMMARY' $W/san_racecheck_dyn.log | tail -1
for i in 1 2 3 4 5 6; do
  [ $SECONDS -gt 420 ] && break
  if [ $((i % 2)) = 1 ]; then o=auto,base:auto; else o=base:auto,auto; fi
  PYTHONUNBUFFERED=1 timeout 100 python3 kernels/bench/hopper_bench.py --lib $N --base_lib $B --configs $o \
    --peers cudnn --rep 100 --settle_ms 500 --peers_last --no-gqa --head_dims 64 --seqs 1024,2048,4096 \
    --json $W/ab_$i.json > $W/ab_$i.txt 2>&1
  echo "ab $i rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref base:auto $W/ab_*.json > $W/ab_summary.txt
grep -E '^\(| / base:auto' $W/ab_summary.txt | cut -c1-220

#!/usr/bin/env bash
# v32, prepared for the next session (not run): `hopper_sm90_d64_m128n128s6_p2_fe` (a tile's first S and last P V
# without turns) and `_fe_l1` with the lag taken lazily (warpgroup 1's empty turn before its first middle step, not
# at its start: the form that deadlocked in call 2), first their suites (multi-tile runs with short timeouts: a
# deadlock shows as rc 124), then both against auto on the d64 rows, causal included (call 2 timed only non-causal
# rows). Build: main + docs/hopper-runs/v32/fe_lazy_lag.diff (compiled in session 22: 0 spills, no C75xx); carry its
# gpu_attention_test as t42 and library in v42/ (both left in .carry-hopper by session 22), with lib/.
set -u
C=.carry-hopper; W=/tmp/v32n; mkdir -p $W
trap 'tar czf $OUT/v32n.tgz -C /tmp v32n' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/t42; N=$C/v42/libattnd_kernels_c.so; FE=hopper_sm90_d64_m128n128s6_p2_fe; FL=hopper_sm90_d64_m128n128s6_p2_fe_l1
F='*m128n128s6_p2_fe_d64*:*m128n128s6_p2_fe_l1_d64*'
timeout 60 $T --gtest_filter="$F" > $W/suite.log 2>&1; echo "suite rc=$?"; pass $W/suite.log
ATTND_HOPPER_MAX_BLOCKS=3 timeout 40 $T --gtest_filter="$F" > $W/blocks3.log 2>&1; echo "3 blocks rc=$?"; pass $W/blocks3.log
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 40 $T --gtest_filter="$F" > $W/dyn3.log 2>&1
echo "dynamic, 3 blocks rc=$?"; pass $W/dyn3.log
ATTND_HOPPER_SCHEDULE=static ATTND_HOPPER_MAX_BLOCKS=5 timeout 40 $T --gtest_filter="$F" > $W/static5.log 2>&1
echo "static order, 5 blocks rc=$?"; pass $W/static5.log
ok=1; grep -q '^\[  PASSED' $W/dyn3.log && grep -q '^\[  PASSED' $W/static5.log && grep -q '^\[  PASSED' $W/blocks3.log || ok=0
S='*_p2_fe_l1_d64_sq129_tl*:*_p2_fe_l1_d64_q1000kv65_br*:*_p2_fe_l1_d64_q1000kv65_none*:*_p2_fe_d64_sq1000_tl*'
for tool in synccheck racecheck; do
  ATTND_HOPPER_MAX_BLOCKS=3 timeout 60 compute-sanitizer --tool $tool --error-exitcode 9 $T --gtest_filter="$S" \
    > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1
done
cols="auto,$FE,$FL"; [ $ok = 1 ] || cols="auto,$FE"  # a deadlocking `_fe_l1` would hang the bench
for i in 1 2 3 4 5 6; do
  [ $SECONDS -gt 420 ] && break
  o=$(echo $cols | awk -F, -v k=$(((i - 1) % 3)) '{n=NF; s=""; for (j=0;j<n;j++) s=s (j?",":"") $(((j+k)%n)+1); print s}')
  PYTHONUNBUFFERED=1 timeout 100 python3 kernels/bench/hopper_bench.py --lib $N --configs $o --peers cudnn --rep 100 \
    --settle_ms 500 --peers_last --no-gqa --head_dims 64 --seqs 1024,2048,4096 --json $W/ab_$i.json > $W/ab_$i.txt 2>&1
  echo "ab $i ($o) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref auto $W/ab_*.json > $W/ab_summary.txt
grep -E '^\(| / auto' $W/ab_summary.txt | cut -c1-220

#!/usr/bin/env bash
# v35, call 1 (session 24): two Q buffers on auto's short-row d64 kernel (`hopper_sm90_d64_m128n128s6_p2_q2`,
# docs/hopper-runs/v35/q_double.diff). With one buffer the producer issues the next tile's Q only after both
# warpgroups' last S of the current tile, and Q is read once per tile, so from DRAM; at d64 the last P V and the
# epilogue are short, so that load may be on the tile change. Six K/V stages and two Q buffers fit (230,688 bytes).
# SASS counts, the q2 suite (full grid, dynamic order forced on 3 blocks), sanitizers, then A/B against s6 `_p2` in the
# same library, cuDNN last. .carry-hopper: t48 (test binary), v48/ (library), lib/.
set -u
C=.carry-hopper; W=/tmp/v35c1; mkdir -p $W
trap 'tar czf $OUT/v35c1.tgz -C /tmp v35c1' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/t48; N=$C/v48/libattnd_kernels_c.so
cuobjdump -sass $N > $W/sass.txt 2>&1
awk '/Function :/ {if (f) print f, n, h, u, l; f=$3; n=0; h=0; u=0; l=0} /^ +\/\*[0-9a-f]+\*\// {n++} /HGMMA/ {h++}
     /R2UR/ {u++} /LDL|STL/ {l++} END {print f, n, h, u, l}' $W/sass.txt | grep 'TileShapeILi64ELi128ELi6E' > $W/sass_counts.txt
cat $W/sass_counts.txt | awk '{print $2, $3, $4, $5, substr($1, 60, 90)}'
rm -f $W/sass.txt
F='AllConfigs/GpuAttentionTest.*/*s6_p2_q2_d64*'
timeout 90 $T --gtest_filter="$F" > $W/suite.log 2>&1; echo "suite rc=$? t=$SECONDS"; pass $W/suite.log
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 90 $T --gtest_filter="$F" > $W/dyn3.log 2>&1
echo "dynamic forced, 3 blocks rc=$? t=$SECONDS"; pass $W/dyn3.log
ATTND_HOPPER_MAX_BLOCKS=5 ATTND_HOPPER_SCHEDULE=static timeout 90 $T --gtest_filter="$F" > $W/static5.log 2>&1
echo "static, 5 blocks rc=$? t=$SECONDS"; pass $W/static5.log
S='*s6_p2_q2_d64_sq1000_tl*:*s6_p2_q2_d64_q1000kv65_br*:*s6_p2_q2_d64_b2_mqa4to1_br*'
for tool in memcheck synccheck racecheck; do
  ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 90 compute-sanitizer --tool $tool \
    --error-exitcode 9 $T --gtest_filter="$S" > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done
A=hopper_sm90_d64_m128n128s6_p2; B=hopper_sm90_d64_m128n128s6_p2_q2
for i in 1 2 3 4 5 6 7 8; do
  [ $SECONDS -gt 330 ] && break
  o=$A,$B; [ $((i % 2)) = 0 ] && o=$B,$A
  PYTHONUNBUFFERED=1 timeout 60 python3 kernels/bench/hopper_bench.py --lib $N --configs $o \
    --peers cudnn --rep 100 --settle_ms 500 --peers_last --no-gqa --head_dims 64 \
    --seqs 1024,2048 --json $W/ab_$i.json > $W/ab_$i.txt 2>&1
  echo "ab $i ($o) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref $A $W/ab_*.json > $W/ab_summary.txt
grep -E '^\(|/ hopper' $W/ab_summary.txt | cut -c1-220

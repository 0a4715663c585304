#!/usr/bin/env bash
# v35, call 2 (session 24): call 1's `_q2` was correct but 1.6% slower at d64 causal 1k / 2k, and its SASS had R2UR
# 11 -> 32 (static order) and 72 -> 93 (dynamic): the alternating Q slot took Q's descriptors out of the uniform
# registers. Here the slot comes from lane 0 through a shuffle (docs/hopper-runs/v35/q_double_uniform.diff), to see
# what the earlier Q load is worth with the descriptors as before. SASS counts, the q2 suite (full grid, dynamic
# order forced on 3 blocks), then A/B against s6 `_p2` in the same library, cuDNN last.
# .carry-hopper: t49 (test binary), v49/ (library), lib/.
set -u
C=.carry-hopper; W=/tmp/v35c2; mkdir -p $W
trap 'tar czf $OUT/v35c2.tgz -C /tmp v35c2' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/t49; N=$C/v49/libattnd_kernels_c.so
cuobjdump -sass $N > $W/sass.txt 2>&1
awk '/Function :/ {if (f) print f, n, h, u, l; f=$3; n=0; h=0; u=0; l=0} /^ +\/\*[0-9a-f]+\*\// {n++} /HGMMA/ {h++}
     /R2UR/ {u++} /LDL|STL/ {l++} END {print f, n, h, u, l}' $W/sass.txt | grep 'TileShapeILi64ELi128ELi6E' > $W/sass_counts.txt
awk '{print $2, $3, $4, $5, substr($1, 60, 90)}' $W/sass_counts.txt
rm -f $W/sass.txt
F='AllConfigs/GpuAttentionTest.*/*s6_p2_q2_d64*'
timeout 90 $T --gtest_filter="$F" > $W/suite.log 2>&1; echo "suite rc=$? t=$SECONDS"; pass $W/suite.log
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 90 $T --gtest_filter="$F" > $W/dyn3.log 2>&1
echo "dynamic forced, 3 blocks rc=$? t=$SECONDS"; pass $W/dyn3.log
A=hopper_sm90_d64_m128n128s6_p2; B=hopper_sm90_d64_m128n128s6_p2_q2
for i in 1 2 3 4 5 6; do
  [ $SECONDS -gt 170 ] && break
  o=$A,$B; [ $((i % 2)) = 0 ] && o=$B,$A
  PYTHONUNBUFFERED=1 timeout 60 python3 kernels/bench/hopper_bench.py --lib $N --configs $o \
    --peers cudnn --rep 100 --settle_ms 500 --peers_last --no-gqa --head_dims 64 --causal yes \
    --seqs 1024,2048 --json $W/ab_$i.json > $W/ab_$i.txt 2>&1
  echo "ab $i ($o) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref $A $W/ab_*.json > $W/ab_summary.txt
grep -E '^\(|/ hopper' $W/ab_summary.txt | cut -c1-220

#!/usr/bin/env bash
# v36, prepared in session 24 (not run): the cross-tile step on s6 `_p2` (`hopper_sm90_d64_m128n128s6_p2_x`,
# docs/hopper-runs/v36/cross_tile_p2.diff): a tile's last P V issued in one turn with the next tile's first S, the
# epilogue under that P V, in the dynamic order too (the next index taken from the ring one tile early), two Q
# buffers, the Q slot from lane 0 (v35). The d64 causal 1k gap is paid per tile (session 24, call 5); this is the one
# handover that removes a GEMM turn per tile. `_x` (v4, s4, static orders only) lost in the steady loop to R2UR
# before its HGMMAs; check the SASS first. ptxas here: 0 spills and no C75xx in all 30 d64 kernels (ptxas_d64.txt).
# Build: main + the diff into build-kernels (library and gpu_attention_test); carry .carry-hopper with t50 (test
# binary), v50/ (library) and lib/ (abseil .so files: ldd of both). About 300 s. A deadlock would show as a timeout:
# the smoke case runs alone first under 30 s.
set -u
C=.carry-hopper; W=/tmp/v36n; mkdir -p $W
trap 'tar czf $OUT/v36n.tgz -C /tmp v36n' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/t50; N=$C/v50/libattnd_kernels_c.so
cuobjdump -sass $N > $W/sass.txt 2>&1
awk '/Function :/ {if (f) print f, n, h, u, l; f=$3; n=0; h=0; u=0; l=0} /^ +\/\*[0-9a-f]+\*\// {n++} /HGMMA/ {h++}
     /R2UR/ {u++} /LDL|STL/ {l++} END {print f, n, h, u, l}' $W/sass.txt | grep 'TileShapeILi64ELi128ELi6E' > $W/sass_counts.txt
awk '{print $2, $3, $4, $5, substr($1, 60, 90)}' $W/sass_counts.txt
# The new kernels' whole listing (bf16, static and dynamic), to find any R2UR between HGMMAs.
awk '/Function :/ {p = ($3 ~ /TileShapeILi64ELi128ELi6ELb1ELb1ELi2ELi0ELb1ELi0ELb1E.*13__nv_bfloat16/)} p' $W/sass.txt \
  | gzip -9 > $W/sass_p2x.txt.gz
rm -f $W/sass.txt
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 30 $T \
  --gtest_filter='*s6_p2_x_d64_packed_qkv_tl*' > $W/smoke.log 2>&1
echo "smoke (dynamic, 3 blocks) rc=$? t=$SECONDS"; pass $W/smoke.log
F='AllConfigs/GpuAttentionTest.*/*s6_p2_x_d64*'
timeout 90 $T --gtest_filter="$F" > $W/suite.log 2>&1; echo "suite rc=$? t=$SECONDS"; pass $W/suite.log
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 90 $T --gtest_filter="$F" > $W/dyn3.log 2>&1
echo "dynamic forced, 3 blocks rc=$? t=$SECONDS"; pass $W/dyn3.log
ATTND_HOPPER_MAX_BLOCKS=5 ATTND_HOPPER_SCHEDULE=static timeout 90 $T --gtest_filter="$F" > $W/static5.log 2>&1
echo "static, 5 blocks rc=$? t=$SECONDS"; pass $W/static5.log
S='*s6_p2_x_d64_sq1000_tl*:*s6_p2_x_d64_q1000kv65_br*:*s6_p2_x_d64_b2_mqa4to1_br*'
for tool in memcheck synccheck racecheck; do
  ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 90 compute-sanitizer --tool $tool \
    --error-exitcode 9 $T --gtest_filter="$S" > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done
A=hopper_sm90_d64_m128n128s6_p2; B=hopper_sm90_d64_m128n128s6_p2_x
for i in 1 2 3 4 5 6 7 8; do
  [ $SECONDS -gt 420 ] && break
  o=$A,$B; [ $((i % 2)) = 0 ] && o=$B,$A
  PYTHONUNBUFFERED=1 timeout 60 python3 kernels/bench/hopper_bench.py --lib $N --configs $o \
    --peers cudnn --rep 100 --settle_ms 500 --peers_last --no-gqa --head_dims 64 \
    --seqs 1024,2048,4096 --json $W/ab_$i.json > $W/ab_$i.txt 2>&1
  echo "ab $i ($o) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref $A $W/ab_*.json > $W/ab_summary.txt
grep -E '^\(|/ hopper' $W/ab_summary.txt | cut -c1-220

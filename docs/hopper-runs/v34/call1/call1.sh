#!/usr/bin/env bash
# v34, prepared in session 23 (not run): the dynamic order's tile index through a shuffle from lane 0
# (docs/hopper-runs/v34/dynamic_tile_uniform.diff). After v33 the dynamic-order d64 kernels still had 72 R2UR against
# the static order's 11 (v33 call 5); the index read from the tile ring in shared memory is a per-thread value to
# ptxas, and the key range and loop bounds follow from it. The dynamic order is auto's at d64 causal 1k-4k, the row
# still below cuDNN. Build: main (v33 or later) + the diff into build-kernels (library and gpu_attention_test), main
# alone into build-main (library); carry .carry-hopper with t47 (test binary), v47/ (the diff's library), main/
# (main's library) and lib/ (abseil .so files: ldd of both binaries). About 300 s.
set -u
C=.carry-hopper; W=/tmp/v34n; mkdir -p $W
trap 'tar czf $OUT/v34n.tgz -C /tmp v34n' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/t47; N=$C/v47/libattnd_kernels_c.so; B=$C/main/libattnd_kernels_c.so
for lib in $B $N; do
  cuobjdump -sass $lib > $W/sass.txt 2>&1
  awk '/Function :/ {if (f) print f, n, h, u, l; f=$3; n=0; h=0; u=0; l=0} /^ +\/\*[0-9a-f]+\*\// {n++} /HGMMA/ {h++}
       /R2UR/ {u++} /LDL|STL/ {l++} END {print f, n, h, u, l}' $W/sass.txt | grep 'HopperFwd' \
    > $W/sass_counts_$(basename $(dirname $lib)).txt
  # The whole listing of auto's d64 kernels (bf16; static and dynamic order), to find what R2UR remain for.
  awk '/Function :/ {p = ($3 ~ /TileShapeILi64ELi128ELi6E.*13__nv_bfloat16/)} p' $W/sass.txt | gzip -9 \
    > $W/sass_d64_s6p2_$(basename $(dirname $lib)).txt.gz
done
rm -f $W/sass.txt
F='AllConfigs/GpuAttentionTest.*/auto_d64*:*s6_p2_d64*:*m192n128s4_d64*'
timeout 90 $T --gtest_filter="$F" > $W/suite.log 2>&1; echo "suite rc=$? t=$SECONDS"; pass $W/suite.log
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 90 $T --gtest_filter="$F" > $W/dyn3.log 2>&1
echo "dynamic forced, 3 blocks rc=$? t=$SECONDS"; pass $W/dyn3.log
S='*s6_p2_d64_sq1000_tl*:*s6_p2_d64_q1000kv65_br*:*m192n128s4_d64_b2_mqa4to1_br*'
for tool in memcheck synccheck racecheck; do
  ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 90 compute-sanitizer --tool $tool \
    --error-exitcode 9 $T --gtest_filter="$S" > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done
for i in 1 2 3 4 5 6 7 8; do
  [ $SECONDS -gt 400 ] && break
  o=auto,base:auto; [ $((i % 2)) = 0 ] && o=base:auto,auto
  PYTHONUNBUFFERED=1 timeout 60 python3 kernels/bench/hopper_bench.py --lib $N --base_lib $B --configs $o \
    --peers cudnn --rep 100 --settle_ms 500 --peers_last --no-gqa --head_dims 64 --causal yes \
    --seqs 1024,2048,4096,8192 --json $W/ab_$i.json > $W/ab_$i.txt 2>&1
  echo "ab $i ($o) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref base:auto $W/ab_*.json > $W/ab_summary.txt
grep -E '^\(|auto / base|cudnn / base' $W/ab_summary.txt | cut -c1-200

#!/usr/bin/env bash
# v41, call 1 (session 26's call 2): v40 plus Q's L2 prefetch (cp.async.bulk.prefetch.tensor) issued by the producer
# when it takes a tile, most of a tile before Q's own load (which waits for the previous tile's last S). Checks of
# the v41 build (v40's final code included: the register epilogue's plain stores in the shared-memory-epilogue
# kernels), step parts of base (main), v40 and v41, then base:auto (v40) / auto (v41) / cuDNN rotated, d64 and d128.
# Carry: .carry-hopper/v41.tar.xz (base/, v40/, v41/: library, hopper_trace; v40/, v41/: gpu_attention_test), lib/.
set -u
C=.carry-hopper; W=/tmp/v41c1; mkdir -p $W
trap 'tar czf $OUT/v41c1.tgz -C /tmp v41c1' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
tar xJf $C/v41.tar.xz -C $C || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv > $W/env.txt; cat $W/env.txt
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/v41/gpu_attention_test; N=$C/v41/libattnd_kernels_c.so; B=$C/v40/libattnd_kernels_c.so
cuobjdump -sass $N > $W/sass.txt 2>&1
awk '/Function :/ {if (f) print f, n, h, u, l; f=$3; n=0; h=0; u=0; l=0} /^ +\/\*[0-9a-f]+\*\// {n++} /HGMMA/ {h++}
     /R2UR/ {u++} /LDL|STL/ {l++} END {print f, n, h, u, l}' $W/sass.txt > $W/sass_counts_v41.txt
echo "v41 hopper kernels with LDL/STL: $(awk '$5 > 0 && /hopper/' $W/sass_counts_v41.txt | wc -l); UTMAPF: $(grep -c UTMAPF $W/sass.txt)"
rm -f $W/sass.txt
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 30 $T \
  --gtest_filter='*s6_p2_d64_packed_qkv_tl*' > $W/smoke.log 2>&1
echo "smoke (dynamic, 3 blocks) rc=$? t=$SECONDS"; pass $W/smoke.log
timeout 200 $T --gtest_filter='*hopper*' > $W/hopper_all.log 2>&1; echo "hopper suite rc=$? t=$SECONDS"; pass $W/hopper_all.log
F='*hopper_sm90_d64_m128n128s6_p2_*:*hopper_sm90_d64_m192n128s4_*'
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 90 $T --gtest_filter="$F" > $W/dyn3.log 2>&1
echo "d64 dynamic forced, 3 blocks rc=$? t=$SECONDS"; pass $W/dyn3.log
ATTND_HOPPER_MAX_BLOCKS=3 ATTND_HOPPER_SPLIT_TAIL=2 timeout 120 $T --gtest_filter='*hopper_sm90_d128_m128n128s3_osk_p2_*:*hopper_sm90_d256*' > $W/split3.log 2>&1
echo "d128 osk_p2 / d256, 3 blocks, split tails rc=$? t=$SECONDS"; pass $W/split3.log
S='*s6_p2_d64_sq1000_tl*:*s6_p2_d64_q1000kv65_br*:*s6_p2_d64_b2_mqa4to1_br*:*d128_m128n128s3_osk_p2_d128_sq1000_tl*'
for tool in memcheck synccheck racecheck; do
  ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 90 compute-sanitizer --tool $tool \
    --error-exitcode 9 $T --gtest_filter="$S" > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done
for lib in base v40 v41; do
  ATTND_HOPPER_SPLIT_TAIL=0 timeout 60 $C/$lib/hopper_trace hopper_sm90_d64_m128n128s6_p2 16 1024 32 1 \
    hopper_sm90_d128_m128n128s3_osk_p2 16 1024 16 1 > $W/trace_$lib.log 2>&1
  echo "trace $lib rc=$?"; grep -E '^==|^steady|^ +[0-9]+ |^producer' $W/trace_$lib.log | cut -c1-200
done
A=base:auto
orders=("$A,auto,cudnn" "auto,cudnn,$A" "cudnn,$A,auto")
for i in 1 2 3 4 5 6; do
  [ $SECONDS -gt 360 ] && break
  o=${orders[$(((i - 1) % 3))]}
  PYTHONUNBUFFERED=1 timeout 70 python3 kernels/bench/hopper_bench.py --lib $N --base_lib $B --configs $A,auto \
    --peers cudnn --rep 100 --settle_ms 500 --order $o --no-gqa --head_dims 64,128 --seqs 1024,2048,4096 \
    --json $W/ab_$i.json > $W/ab_$i.txt 2>&1
  echo "ab $i ($o) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref $A $W/ab_*.json > $W/ab_summary.txt
python3 kernels/bench/summarize_runs.py --ref cudnn $W/ab_*.json > $W/ab_summary_cudnn.txt
grep -E '^\(| auto / base' $W/ab_summary.txt | cut -c1-200
echo "== over cudnn"; grep -E '^\(|/ cudnn' $W/ab_summary_cudnn.txt | grep -v "^(" | cut -c1-160

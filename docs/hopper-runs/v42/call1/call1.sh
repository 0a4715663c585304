#!/usr/bin/env bash
# v42, call 1 (session 26's call 5): the row sums' quad reduction taken right after a tile's last softmax, before the
# last P V's turn, instead of after that GEMM's wait in the epilogue (Softmax::ReduceRowSums; the epilogues and the
# split tail's parts read the totals). Local SASS (d64 s6 `_p2`, dynamic): the four SHFL.BFLY of l now sit before
# the last P V's BAR.SYNC; R2UR 11 / 77 and 0 LDL/STL as v41. Checks (the split tail's parts carry the totals now),
# then base:auto (v41's final library) / auto (v42) / cuDNN rotated. Carry: .carry-hopper/v42.tar.xz (v42/: library,
# stripped gpu_attention_test), .carry-hopper/s26c3.tar.xz (v41f/), lib/.
set -u
C=.carry-hopper; W=/tmp/v42c1; mkdir -p $W
trap 'tar czf $OUT/v42c1.tgz -C /tmp v42c1' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
tar xJf $C/v42.tar.xz -C $C && tar xJf $C/s26c3.tar.xz -C $C || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > $W/env.txt; cat $W/env.txt
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/v42/gpu_attention_test; N=$C/v42/libattnd_kernels_c.so; B=$C/v41f/libattnd_kernels_c.so
cuobjdump -sass $N > $W/sass.txt 2>&1
awk '/Function :/ {if (f) print f, n, h, u, l; f=$3; n=0; h=0; u=0; l=0} /^ +\/\*[0-9a-f]+\*\// {n++} /HGMMA/ {h++}
     /R2UR/ {u++} /LDL|STL/ {l++} END {print f, n, h, u, l}' $W/sass.txt > $W/sass_counts.txt
echo "hopper kernels with LDL/STL: $(awk '$5 > 0 && /hopper/' $W/sass_counts.txt | wc -l)"
rm -f $W/sass.txt
timeout 200 $T --gtest_filter='*hopper*' > $W/hopper_all.log 2>&1; echo "hopper suite rc=$? t=$SECONDS"; pass $W/hopper_all.log
F='*hopper_sm90_d64_m128n128s6_p2_*:*hopper_sm90_d64_m192n128s4_*'
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 90 $T --gtest_filter="$F" > $W/dyn3.log 2>&1
echo "d64 dynamic forced, 3 blocks rc=$? t=$SECONDS"; pass $W/dyn3.log
ATTND_HOPPER_MAX_BLOCKS=3 ATTND_HOPPER_SPLIT_TAIL=2 timeout 120 $T \
  --gtest_filter='*hopper_sm90_d128_m128n128s3_osk_p2_*:*hopper_sm90_d128_m128n176s2_os_*:*hopper_sm90_d256*' > $W/split3.log 2>&1
echo "d128 osk_p2 / n176 os / d256, 3 blocks, split tails rc=$? t=$SECONDS"; pass $W/split3.log
S='*s6_p2_d64_sq1000_tl*:*s6_p2_d64_q1000kv65_br*:*d128_m128n128s3_osk_p2_d128_sq1000_tl*'
for tool in memcheck racecheck; do
  ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 ATTND_HOPPER_SPLIT_TAIL=2 timeout 90 compute-sanitizer \
    --tool $tool --error-exitcode 9 $T --gtest_filter="$S" > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done
A=base:auto
orders=("$A,auto,cudnn" "auto,cudnn,$A" "cudnn,$A,auto")
for i in 1 2 3 4 5 6; do
  [ $SECONDS -gt 330 ] && break
  o=${orders[$(((i - 1) % 3))]}
  PYTHONUNBUFFERED=1 timeout 70 python3 kernels/bench/hopper_bench.py --lib $N --base_lib $B --configs $A,auto \
    --peers cudnn --rep 100 --settle_ms 500 --order $o --no-gqa --head_dims 64,128 --seqs 1024,2048,4096 \
    --json $W/ab_$i.json > $W/ab_$i.txt 2>&1
  echo "ab $i ($o) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref $A $W/ab_*.json > $W/ab_summary.txt
python3 kernels/bench/summarize_runs.py --ref cudnn $W/ab_*.json > $W/ab_summary_cudnn.txt
grep -E '^\(| auto / base' $W/ab_summary.txt | cut -c1-200
echo "== over cudnn"; grep -E '^\(|/ cudnn' $W/ab_summary_cudnn.txt | cut -c1-160

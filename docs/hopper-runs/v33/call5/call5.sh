#!/usr/bin/env bash
# v33 call 5: the warpgroup index through a shuffle from lane 0 (uniform_wg.diff), so that ptxas keeps the Q
# descriptors in uniform registers (call 3's SASS: two R2UR before every S HGMMA). Every Hopper kernel's code changes,
# so: the SASS counts of main's library and the new one, the auto and hopper suites, then auto against main's auto
# in the same process (--base_lib; order alternating, cuDNN last) on the 1k and 16k rows, then the whole test
# binary with the time left. Carry .carry-hopper: t46 (gpu_attention_test), v46/ (new library), main/ (main's).
set -u
C=.carry-hopper; W=/tmp/v33c5; mkdir -p $W
trap 'tar czf $OUT/v33c5.tgz -C /tmp v33c5' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/t46; N=$C/v46/libattnd_kernels_c.so; B=$C/main/libattnd_kernels_c.so
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv,noheader
for lib in $B $N; do
  cuobjdump -sass $lib > $W/sass.txt 2>&1
  awk '/Function :/ {if (f) print f, n, h, u, l; f=$3; n=0; h=0; u=0; l=0} /^ +\/\*[0-9a-f]+\*\// {n++} /HGMMA/ {h++}
       /R2UR/ {u++} /LDL|STL/ {l++} END {print f, n, h, u, l}' $W/sass.txt | grep 'HopperFwd' \
    > $W/sass_counts_$(basename $(dirname $lib)).txt
done
rm -f $W/sass.txt
F='AllConfigs/GpuAttentionTest.*/auto_*:*_p2_d64*:*s6_p2_d64*:*osk_p2_d128*:*m128n64s2_d256*:*m192n128s4_d64*'
timeout 120 $T --gtest_filter="$F" > $W/suite.log 2>&1; echo "suite rc=$? t=$SECONDS"; pass $W/suite.log
ATTND_HOPPER_MAX_BLOCKS=3 ATTND_HOPPER_SPLIT_TAIL=2 timeout 120 $T --gtest_filter="$F" > $W/blocks3.log 2>&1
echo "3 blocks, split forced rc=$? t=$SECONDS"; pass $W/blocks3.log
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 60 $T --gtest_filter='*s6_p2_d64*:*m192n128s4_d64*' \
  > $W/dyn3.log 2>&1
echo "d64 dynamic, 3 blocks rc=$? t=$SECONDS"; pass $W/dyn3.log
for i in 1 2 3 4 5 6; do
  [ $SECONDS -gt 270 ] && break
  o=auto,base:auto; [ $((i % 2)) = 0 ] && o=base:auto,auto
  PYTHONUNBUFFERED=1 timeout 90 python3 kernels/bench/hopper_bench.py --lib $N --base_lib $B --configs $o \
    --peers cudnn --rep 100 --settle_ms 500 --peers_last --no-gqa --head_dims 64,128 --seqs 1024,16384 \
    --json $W/ab_$i.json > $W/ab_$i.txt 2>&1
  echo "ab $i ($o) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref base:auto $W/ab_*.json > $W/ab_summary.txt
grep -E '^\(|auto / base' $W/ab_summary.txt | cut -c1-200
left=$((560 - SECONDS)); [ $left -gt 30 ] || exit 0
timeout $left $T > $W/all.log 2>&1; echo "gpu_attention_test (whole) rc=$? t=$SECONDS"
grep -hE '^\[  (PASSED|FAILED|SKIPPED) |FAILED  \]' $W/all.log | head; grep -c '^\[       OK' $W/all.log

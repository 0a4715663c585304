#!/usr/bin/env bash
# v33 call 4: `_hf` with its branch on a warp vote (call 3's SASS: the branch on a row-derived value put 100 more R2UR
# in the d64 kernel, the steady loop's descriptors among them). SASS counts first, the `_hf` suites, then A/B against
# auto in the same process, order alternating, cuDNN last. Build: main + half_first.diff (the vote included); carry
# .carry-hopper (t45: gpu_attention_test, v45: library).
set -u
C=.carry-hopper; W=/tmp/v33c4; mkdir -p $W
trap 'tar czf $OUT/v33c4.tgz -C /tmp v33c4' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/t45; N=$C/v45/libattnd_kernels_c.so
H64=hopper_sm90_d64_m128n128s6_p2_hf; H128=hopper_sm90_d128_m128n128s3_osk_p2_hf
cuobjdump -sass $N > $W/sass.txt 2>&1
awk '/Function :/ {if (f) print f, n, h, u, l; f=$3; n=0; h=0; u=0; l=0} /^ +\/\*[0-9a-f]+\*\// {n++} /HGMMA/ {h++} /R2UR/ {u++} /LDL|STL/ {l++}
     END {print f, n, h, u, l}' $W/sass.txt | grep 'HopperFwd' > $W/sass_counts.txt
rm $W/sass.txt
F="*${H64}_d64*:*${H128}_d128*"
timeout 60 $T --gtest_filter="$F" > $W/suite.log 2>&1; echo "suite rc=$? t=$SECONDS"; pass $W/suite.log
ATTND_HOPPER_MAX_BLOCKS=3 timeout 60 $T --gtest_filter="$F" > $W/blocks3.log 2>&1; echo "3 blocks rc=$?"; pass $W/blocks3.log
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 40 $T --gtest_filter="*${H64}_d64*" > $W/dyn3.log 2>&1
echo "d64 dynamic, 3 blocks rc=$?"; pass $W/dyn3.log
ATTND_HOPPER_SPLIT_TAIL=2 ATTND_HOPPER_MAX_BLOCKS=3 timeout 40 $T --gtest_filter="*${H128}_d128*" > $W/split3.log 2>&1
echo "d128 split forced, 3 blocks rc=$?"; pass $W/split3.log
echo "t=$SECONDS"
rot() { echo $1 | awk -F, -v k=$2 '{n=NF; s=""; for (j=0;j<n;j++) s=s (j?",":"") $(((j+k)%n)+1); print s}'; }
for i in 1 2 3 4 5 6 7 8; do
  [ $SECONDS -gt 150 ] && break
  o=$(rot auto,$H64 $(((i - 1) % 2)))
  PYTHONUNBUFFERED=1 timeout 60 python3 kernels/bench/hopper_bench.py --lib $N --configs $o --peers cudnn --rep 100 \
    --settle_ms 500 --peers_last --no-gqa --head_dims 64 --causal yes --seqs 1024,2048,4096 --json $W/ab64_$i.json \
    > $W/ab64_$i.txt 2>&1
  echo "ab64 $i ($o) rc=$? t=$SECONDS"
done
for i in 1 2 3 4; do
  [ $SECONDS -gt 210 ] && break
  o=$(rot auto,$H128 $(((i - 1) % 2)))
  PYTHONUNBUFFERED=1 timeout 50 python3 kernels/bench/hopper_bench.py --lib $N --configs $o --peers cudnn --rep 100 \
    --settle_ms 500 --peers_last --no-gqa --head_dims 128 --causal yes --seqs 1024,2048,4096 --json $W/ab128_$i.json \
    > $W/ab128_$i.txt 2>&1
  echo "ab128 $i ($o) rc=$? t=$SECONDS"
done
for d in 64 128; do
  python3 kernels/bench/summarize_runs.py --ref auto $W/ab${d}_*.json > $W/ab${d}_summary.txt
  grep -E '^\(| / auto' $W/ab${d}_summary.txt | cut -c1-220
done

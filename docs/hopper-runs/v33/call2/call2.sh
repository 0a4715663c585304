#!/usr/bin/env bash
# v33 call 2: the half first block (`_hf`: S and softmax of the tile's first block over its lower half for a warpgroup
# none of whose rows sees the upper half) on auto's d64 and d128 kernels. Suites with short timeouts, the orders and
# block counts that chain tiles, the sanitizers on cases where the half path runs, then A/B against auto in the same
# process, order alternating, cuDNN last. Build: main + docs/hopper-runs/v33/half_first.diff; carry .carry-hopper
# (t44: gpu_attention_test, v44: library).
set -u
C=.carry-hopper; W=/tmp/v33c2; mkdir -p $W
trap 'tar czf $OUT/v33c2.tgz -C /tmp v33c2' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/t44; N=$C/v44/libattnd_kernels_c.so
H64=hopper_sm90_d64_m128n128s6_p2_hf; H128=hopper_sm90_d128_m128n128s3_osk_p2_hf
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv > $W/gpu.txt
F="*${H64}_d64*:*${H128}_d128*"
timeout 60 $T --gtest_filter="$F" > $W/suite.log 2>&1; echo "suite rc=$? t=$SECONDS"; pass $W/suite.log
ATTND_HOPPER_MAX_BLOCKS=3 timeout 60 $T --gtest_filter="$F" > $W/blocks3.log 2>&1; echo "3 blocks rc=$?"; pass $W/blocks3.log
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 40 $T --gtest_filter="*${H64}_d64*" > $W/dyn3.log 2>&1
echo "d64 dynamic, 3 blocks rc=$?"; pass $W/dyn3.log
ATTND_HOPPER_SCHEDULE=static ATTND_HOPPER_MAX_BLOCKS=5 timeout 40 $T --gtest_filter="$F" > $W/static5.log 2>&1
echo "static order, 5 blocks rc=$?"; pass $W/static5.log
ATTND_HOPPER_SPLIT_TAIL=2 ATTND_HOPPER_MAX_BLOCKS=3 timeout 40 $T --gtest_filter="*${H128}_d128*" > $W/split3.log 2>&1
echo "d128 split forced, 3 blocks rc=$?"; pass $W/split3.log
echo "t=$SECONDS"
S="*${H64}_d64_sq129_tl*:*${H64}_d64_q65kv63_none*:*${H64}_d64_b2_mqa4to1_br*:*${H64}_d64_sq1000_tl*"
S="$S:*${H128}_d128_sq129_tl*:*${H128}_d128_q65kv63_br*:*${H128}_d128_fp16_b2_long_tl*"
for tool in memcheck synccheck racecheck; do
  ATTND_HOPPER_MAX_BLOCKS=3 timeout 70 compute-sanitizer --tool $tool --error-exitcode 9 $T --gtest_filter="$S" \
    > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log | tail -2
done
echo "t=$SECONDS"
rot() { echo $1 | awk -F, -v k=$2 '{n=NF; s=""; for (j=0;j<n;j++) s=s (j?",":"") $(((j+k)%n)+1); print s}'; }
for i in 1 2 3 4 5 6 7 8; do
  [ $SECONDS -gt 360 ] && break
  o=$(rot auto,$H64 $(((i - 1) % 2)))
  PYTHONUNBUFFERED=1 timeout 60 python3 kernels/bench/hopper_bench.py --lib $N --configs $o --peers cudnn --rep 100 \
    --settle_ms 500 --peers_last --no-gqa --head_dims 64 --causal yes --seqs 1024,2048,4096 --json $W/ab64_$i.json \
    > $W/ab64_$i.txt 2>&1
  echo "ab64 $i ($o) rc=$? t=$SECONDS"
done
for i in 1 2 3 4 5 6; do
  [ $SECONDS -gt 520 ] && break
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

#!/usr/bin/env bash
# v33 call 1: v32's free edges with the lazy lag (d64 `_fe`, `_fe_l1`) and free edges on auto's d128 kernel (s3
# `_osk_p2_fe`). Suites first with short timeouts (a deadlock shows as rc 124), then the sanitizers on multi-tile
# cases, then A/B against auto in the same process, order rotating, cuDNN last: d64 causal 1k-4k, d128 causal 1k /
# 4k / 16k. Build: main + docs/hopper-runs/v33/fe.diff; carry .carry-hopper (t43: gpu_attention_test, v43: library).
set -u
C=.carry-hopper; W=/tmp/v33c1; mkdir -p $W
trap 'tar czf $OUT/v33c1.tgz -C /tmp v33c1' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/t43; N=$C/v43/libattnd_kernels_c.so
FE=hopper_sm90_d64_m128n128s6_p2_fe; FL=hopper_sm90_d64_m128n128s6_p2_fe_l1; KF=hopper_sm90_d128_m128n128s3_osk_p2_fe
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv > $W/gpu.txt
F='*m128n128s6_p2_fe_d64*:*m128n128s6_p2_fe_l1_d64*:*s3_osk_p2_fe_d128*'
timeout 90 $T --gtest_filter="$F" > $W/suite.log 2>&1; echo "suite rc=$? t=$SECONDS"; pass $W/suite.log
ATTND_HOPPER_MAX_BLOCKS=3 timeout 60 $T --gtest_filter="$F" > $W/blocks3.log 2>&1; echo "3 blocks rc=$?"; pass $W/blocks3.log
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 40 $T --gtest_filter="${F%:*}" > $W/dyn3.log 2>&1
echo "dynamic, 3 blocks rc=$?"; pass $W/dyn3.log
ATTND_HOPPER_SCHEDULE=static ATTND_HOPPER_MAX_BLOCKS=5 timeout 40 $T --gtest_filter="$F" > $W/static5.log 2>&1
echo "static order, 5 blocks rc=$?"; pass $W/static5.log
ATTND_HOPPER_SPLIT_TAIL=2 ATTND_HOPPER_MAX_BLOCKS=3 timeout 40 $T --gtest_filter="${F##*:}" > $W/split3.log 2>&1
echo "d128 split forced, 3 blocks rc=$?"; pass $W/split3.log
ok=1; grep -q '^\[  PASSED' $W/dyn3.log && grep -q '^\[  PASSED' $W/static5.log && grep -q '^\[  PASSED' $W/blocks3.log || ok=0
echo "t=$SECONDS"
S='*_p2_fe_l1_d64_sq129_tl*:*_p2_fe_l1_d64_q1000kv65_br*:*_p2_fe_l1_d64_q1000kv65_none*:*_p2_fe_d64_sq1000_tl*'
S="$S:*s3_osk_p2_fe_d128_sq1000_tl*:*s3_osk_p2_fe_d128_q1000kv65_br*"
for tool in memcheck synccheck racecheck; do
  ATTND_HOPPER_MAX_BLOCKS=3 timeout 60 compute-sanitizer --tool $tool --error-exitcode 9 $T --gtest_filter="$S" \
    > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log | tail -2
done
echo "t=$SECONDS"
rot() { echo $1 | awk -F, -v k=$2 '{n=NF; s=""; for (j=0;j<n;j++) s=s (j?",":"") $(((j+k)%n)+1); print s}'; }
cols="auto,$FE,$FL"; [ $ok = 1 ] || cols="auto,$FE"  # a deadlocking `_fe_l1` would hang the bench
for i in 1 2 3 4 5 6; do
  [ $SECONDS -gt 330 ] && break
  o=$(rot $cols $(((i - 1) % 3)))
  PYTHONUNBUFFERED=1 timeout 70 python3 kernels/bench/hopper_bench.py --lib $N --configs $o --peers cudnn --rep 100 \
    --settle_ms 500 --peers_last --no-gqa --head_dims 64 --causal yes --seqs 1024,2048,4096 --json $W/ab64_$i.json \
    > $W/ab64_$i.txt 2>&1
  echo "ab64 $i ($o) rc=$? t=$SECONDS"
done
for i in 1 2 3 4; do
  [ $SECONDS -gt 530 ] && break
  o=$(rot auto,$KF $(((i - 1) % 2)))
  PYTHONUNBUFFERED=1 timeout 60 python3 kernels/bench/hopper_bench.py --lib $N --configs $o --peers cudnn --rep 100 \
    --settle_ms 500 --peers_last --no-gqa --head_dims 128 --causal yes --seqs 1024,4096,16384 --json $W/ab128_$i.json \
    > $W/ab128_$i.txt 2>&1
  echo "ab128 $i ($o) rc=$? t=$SECONDS"
done
for d in 64 128; do
  python3 kernels/bench/summarize_runs.py --ref auto $W/ab${d}_*.json > $W/ab${d}_summary.txt
  grep -E '^\(| / auto' $W/ab${d}_summary.txt | cut -c1-220
done

#!/usr/bin/env bash
# v31, call 3: the S-ahead prologue (`hopper_sm90_d64_m128n128s6_p2sa`): its suite on the full grid, on 3
# blocks (static and dynamic order), memcheck / racecheck, then an A/B against auto (s6 `_p2`, the same code without
# the prologue) on the d64 rows, cuDNN in the same processes. .carry-hopper: t38 and v38/ (main + this change), lib/.
set -u
C=.carry-hopper; W=/tmp/v31c2; mkdir -p $W
trap 'tar czf $OUT/v31c2.tgz -C /tmp v31c2' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/t38; N=$C/v38/libattnd_kernels_c.so; M=hopper_sm90_d64_m128n128s6_p2sa
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv,noheader
F='*m128n128s6_p2sa_*'
timeout 150 $T --gtest_filter="$F" > $W/suite.log 2>&1; rc=$?; echo "suite rc=$rc t=$SECONDS"; pass $W/suite.log
[ $rc = 0 ] || { grep -B5 -A20 'Failure\|error' $W/suite.log | head -60; exit 1; }
ATTND_HOPPER_MAX_BLOCKS=3 timeout 150 $T --gtest_filter="$F" > $W/blocks3.log 2>&1
echo "3 blocks rc=$? t=$SECONDS"; pass $W/blocks3.log
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 150 $T --gtest_filter="$F" > $W/dyn3.log 2>&1
echo "dynamic, 3 blocks rc=$? t=$SECONDS"; pass $W/dyn3.log
S='*m128n128s6_p2sa_d64_sq129_tl*:*m128n128s6_p2sa_d64_q1000kv65_br*:*m128n128s6_p2sa_d64_sq1000_none*'
ATTND_HOPPER_MAX_BLOCKS=3 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 $T --gtest_filter="$S" \
  > $W/san_memcheck.log 2>&1
echo "memcheck rc=$? t=$SECONDS"; grep -E 'ERROR SUMMARY' $W/san_memcheck.log | tail -1; pass $W/san_memcheck.log
ATTND_HOPPER_MAX_BLOCKS=3 timeout 120 compute-sanitizer --tool racecheck --error-exitcode 9 $T \
  --gtest_filter='*m128n128s6_p2sa_d64_sq129_tl*' > $W/san_racecheck.log 2>&1
echo "racecheck rc=$? t=$SECONDS"; grep -E 'RACECHECK SUMMARY' $W/san_racecheck.log | tail -1
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 120 compute-sanitizer --tool racecheck \
  --error-exitcode 9 $T --gtest_filter='*m128n128s6_p2sa_d64_sq1000_tl*' > $W/san_racecheck_dyn.log 2>&1
echo "racecheck dynamic rc=$? t=$SECONDS"; grep -E 'RACECHECK SUMMARY' $W/san_racecheck_dyn.log | tail -1
for i in 1 2 3 4 5 6; do
  [ $SECONDS -gt 440 ] && break
  if [ $((i % 2)) = 1 ]; then o=auto,$M; else o=$M,auto; fi
  PYTHONUNBUFFERED=1 timeout 100 python3 kernels/bench/hopper_bench.py --lib $N --configs $o \
    --peers cudnn --rep 100 --settle_ms 500 --peers_last --no-gqa --head_dims 64 --seqs 1024,2048,4096 \
    --json $W/ab_$i.json > $W/ab_$i.txt 2>&1
  echo "ab $i rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref auto $W/ab_*.json > $W/ab_summary.txt
grep -E '^\(| / auto' $W/ab_summary.txt | cut -c1-220
python3 kernels/bench/summarize_runs.py --ref cudnn $W/ab_*.json > $W/ab_cudnn.txt
grep -E '^\(| / cudnn' $W/ab_cudnn.txt | cut -c1-220
if [ $SECONDS -lt 500 ]; then
  PYTHONUNBUFFERED=1 timeout 80 python3 kernels/bench/hopper_bench.py --lib $N --configs auto,$M --peers cudnn \
    --rep 100 --settle_ms 500 --peers_last --no-gqa --head_dims 64 --seqs 8192,16384 --json $W/long.json \
    > $W/long.txt 2>&1
  echo "long rc=$? t=$SECONDS"; grep -E 'TFLOP|^ *64' $W/long.txt | head -12
fi

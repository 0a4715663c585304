#!/usr/bin/env bash
# v22 call 1 (session 18, the session's last ~290 s of device time): FMA-pipe exp2 for every 4th / 8th column group
# inside TryStep, d64 m128 _p2 only (its step is bound by the MUFU pipe: 64 MUFU.EX2 + 32 F2FP a warp and step).
# .carry-hopper: t24, v24/ (library), hopper_trace24. Results go straight to $OUT (no tar: a cut call keeps them).
set -u
C=.carry-hopper; W=$OUT/v22c1; mkdir -p $W
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/t24
timeout 60 $T --gtest_filter='*_p2_polyexp*' > $W/suite.log 2>&1; echo "suite rc=$?"; pass $W/suite.log
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 60 $T --gtest_filter='*_p2_polyexp*' \
  > $W/dyn3.log 2>&1; echo "dynamic forced, 3 blocks rc=$?"; pass $W/dyn3.log
ATTND_HOPPER_MAX_BLOCKS=3 ATTND_GPU_TEST_SMALL=1 timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 $T \
  --gtest_filter='*_p2_polyexp_d64_q1000kv65_br*:*_p2_polyexp8_d64_sq129_tl*' > $W/san_memcheck.log 2>&1
echo "memcheck rc=$?"; grep -E 'ERROR SUMMARY' $W/san_memcheck.log | tail -1; pass $W/san_memcheck.log
d=hopper_sm90_d64_m128n128s4_p2
timeout 60 $C/hopper_trace24 $d 16 1024 32 1 ${d}_polyexp 16 1024 32 1 ${d}_polyexp8 16 1024 32 1 \
  $d 4 4096 32 0 ${d}_polyexp 4 4096 32 0 > $W/trace.log 2>&1
echo "trace rc=$?"; grep -E '^==|^steady|^step parts' $W/trace.log
N=$C/v24/libattnd_kernels_c.so
for i in 1 2 3 4; do
  [ $SECONDS -gt 100 ] && break
  cfg=$d,${d}_polyexp,${d}_polyexp8; [ $((i % 2)) = 0 ] && cfg=${d}_polyexp8,${d}_polyexp,$d
  PYTHONUNBUFFERED=1 timeout 40 python3 kernels/bench/hopper_bench.py --lib $N --configs $cfg --peers cudnn \
    --rep 100 --settle_ms 500 --peers_last --no-gqa --head_dims 64 --seqs 1024,2048 --json $W/d64_$i.json > $W/d64_$i.txt 2>&1
  echo "d64 $i rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref $d $W/d64_*.json > $W/d64_summary.txt
grep -E '^\(|/ hopper' $W/d64_summary.txt | grep -v cudnn | sed 's/hopper_sm90_//g'

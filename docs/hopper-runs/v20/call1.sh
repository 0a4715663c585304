#!/usr/bin/env bash
# v20 call 1 (prepared in session 17, not run): two P register buffers (p_double.diff applied; .carry-hopper holds that
# build's gpu_attention_test as t20, its libattnd_kernels_c.so in v20/, its hopper_trace as hopper_trace20, and main's
# library in base/). Correctness first (the _p2 suite cases, 3 blocks, d64 with the dynamic order forced, sanitizers),
# then the step parts against the one-buffer kernels, ncu's per-instruction stalls of s3 _osk at 4k (the row max), and
# settled timings against auto, --peers_last in every process, the attnd column order alternating.
set -u
C=.carry-hopper; W=/tmp/v20c1; mkdir -p $W
trap 'tar czf $OUT/v20c1.tgz -C /tmp v20c1' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -8; }
T=$C/t20
timeout 30 $T --gtest_filter='*hopper_sm90_d128_m128n128s3_osk_p2_d128_sq129_tl*' > $W/smoke.log 2>&1
rc=$?; echo "smoke rc=$rc"; tail -1 $W/smoke.log; [ $rc = 0 ] || exit 1
timeout 120 $T --gtest_filter='*_p2_*' > $W/suite.log 2>&1; echo "suite rc=$?"; pass $W/suite.log
ATTND_HOPPER_MAX_BLOCKS=3 timeout 100 $T --gtest_filter='*_p2_*' > $W/blocks3.log 2>&1; echo "3 blocks rc=$?"; pass $W/blocks3.log
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 100 $T --gtest_filter='*d64_m128n128s4_p2_*' \
  > $W/dyn3.log 2>&1; echo "d64 dynamic, 3 blocks rc=$?"; pass $W/dyn3.log
S='*_p2_d128_sq129_tl*:*_p2_d64_q1000kv65_br*:*_p2_d128_q17kv129_br*:*_p2_d64_sq129_tl*'
for tool in memcheck synccheck racecheck; do
  f=$S; [ $tool = racecheck ] && f='*hopper_sm90_d128_m128n128s3_osk_p2_d128_sq129_tl*'
  ATTND_HOPPER_MAX_BLOCKS=3 ATTND_GPU_TEST_SMALL=1 timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 $T \
    --gtest_filter="$f" > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done
a=hopper_sm90_d128_m128n128s3_osk; d=hopper_sm90_d64_m128n128s4
timeout 120 $C/hopper_trace20 $a 4 4096 16 0 ${a}_p2 4 4096 16 0 $a 16 1024 16 0 ${a}_p2 16 1024 16 0 \
  $d 16 1024 32 1 ${d}_p2 16 1024 32 1 $d 4 4096 32 0 ${d}_p2 4 4096 32 0 > $W/trace.log 2>&1
echo "trace rc=$?"; grep -E '^==|^steady|^step parts' $W/trace.log
timeout 150 ncu --clock-control none -k "regex:HopperFwdKernel" -s 1 -c 1 --set full --import-source no -o $W/osk_4k \
  python3 kernels/bench/hopper_profile.py --lib $C/base/libattnd_kernels_c.so once --shapes d128nc4k \
  --configs $a --launches 2 > $W/ncu_osk.log 2>&1
echo "ncu rc=$?"
ncu --import $W/osk_4k.ncu-rep --page source --csv --print-source sass > $W/osk_4k_source.csv 2>&1
gzip $W/osk_4k_source.csv; rm -f $W/osk_4k.ncu-rep
N=$C/v20/libattnd_kernels_c.so
for i in 1 2 3 4; do
  [ $SECONDS -gt 470 ] && break
  cfg=auto,${a}_p2; [ $((i % 2)) = 0 ] && cfg=${a}_p2,auto
  PYTHONUNBUFFERED=1 timeout 60 python3 kernels/bench/hopper_bench.py --lib $N --configs $cfg --peers cudnn \
    --rep 100 --settle_ms 500 --peers_last --head_dims 128 --seqs 1024,2048,4096 --json $W/d128_$i.json > $W/d128_$i.txt 2>&1
  echo "d128 $i rc=$?"
  cfg=auto,${d}_p2,$d; [ $((i % 2)) = 0 ] && cfg=$d,${d}_p2,auto
  PYTHONUNBUFFERED=1 timeout 60 python3 kernels/bench/hopper_bench.py --lib $N --configs $cfg --peers cudnn \
    --rep 100 --settle_ms 500 --peers_last --head_dims 64 --seqs 1024,2048 --json $W/d64_$i.json > $W/d64_$i.txt 2>&1
  echo "d64 $i rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref auto $W/d128_*.json > $W/d128_summary.txt
python3 kernels/bench/summarize_runs.py --ref auto $W/d64_*.json > $W/d64_summary.txt
grep -E '^\(|/ auto' $W/d128_summary.txt $W/d64_summary.txt | grep -v cudnn

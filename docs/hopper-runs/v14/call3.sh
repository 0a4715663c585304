#!/usr/bin/env bash
# Session 12 call 3: split O stages at head_dim 64 (hopper_sm90_d64_m128n128s4_osk, also in the dynamic order), and
# the binaries of 0b54412's test fix. The _osk cases on the full grid, with the dynamic order forced on the full grid
# and on 3 blocks, with the static order on 3 blocks; sanitizers with the dynamic order forced on 3 blocks; the d128,
# auto and API cases (ConfigInfo::stores_o_with_tma against MapKeys); the server suites; four bench processes of
# d64 m128 / m192 / m128 _osk beside cuDNN, the order rotated.
set -u
C=.carry-hopper; W=/tmp/v14c3; mkdir -p $W
export LD_LIBRARY_PATH=$PWD/$C/lib
T=$C/gpu_attention_test; L=$C/new/libattnd_kernels_c.so
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -6; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > $W/env.txt
K='*hopper_sm90_d64_m128n128s4_osk_*'
timeout 30 $T --gtest_filter='*hopper_sm90_d64_m128n128s4_osk_d64_sq129_tl*' > $W/smoke.log 2>&1
echo "smoke rc=$?"; tail -2 $W/smoke.log
timeout 90 $T --gtest_filter="$K" > $W/d64osk.log 2>&1
echo "d64 osk rc=$?"; pass $W/d64osk.log
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 timeout 90 $T --gtest_filter="$K" > $W/d64osk_dyn.log 2>&1
echo "d64 osk dynamic forced rc=$?"; pass $W/d64osk_dyn.log
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 90 $T --gtest_filter="$K" > $W/d64osk_dyn3.log 2>&1
echo "d64 osk dynamic forced, 3 blocks rc=$?"; pass $W/d64osk_dyn3.log
ATTND_HOPPER_SCHEDULE=static ATTND_HOPPER_MAX_BLOCKS=3 timeout 90 $T --gtest_filter="$K" > $W/d64osk_static3.log 2>&1
echo "d64 osk static, 3 blocks rc=$?"; pass $W/d64osk_static3.log
for tool in memcheck racecheck synccheck; do
  f='*hopper_sm90_d64_m128n128s4_osk_d64_sq129_tl*:*hopper_sm90_d64_m128n128s4_osk_d64_sections_gqa_tl*'
  [ $tool = racecheck ] && f='*hopper_sm90_d64_m128n128s4_osk_d64_sq129_tl*'
  ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 ATTND_GPU_TEST_SMALL=1 timeout 100 compute-sanitizer \
    --tool $tool --error-exitcode 9 $T --gtest_filter="$f" > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done
timeout 200 $T --gtest_filter='*hopper_sm90_d128*:*auto_*:KernelApi*' > $W/suite.log 2>&1
echo "d128 + auto + API rc=$?"; pass $W/suite.log
OUT=$W/server SKIP_IPC=1 SKIP_SHM=1 SKIP_INLINE=1 INLINE_SEQS="" PORT=51100 timeout 200 bash server/cuda/tools/device_run.sh \
  > $W/server_run.txt 2>&1
echo "server tests rc=$?"; grep -E "^\[  (PASSED|FAILED) |=== .* rc=|^FAIL" $W/server/tests.log
a=hopper_sm90_d64_m128n128s4; b=hopper_sm90_d64_m192n128s4; c=${a}_osk
for i in 1 2 3 4; do
  case $i in 1) cfg=$a,$b,$c;; 2) cfg=$c,$b,$a;; 3) cfg=$b,$c,$a;; 4) cfg=$c,$a,$b;; esac
  PYTHONUNBUFFERED=1 timeout 90 python3 kernels/bench/hopper_bench.py --lib $L --configs $cfg --peers cudnn --rep 30 \
    --head_dims 64 --json $W/d64_$i.json > $W/d64_$i.txt 2>&1
  echo "d64 bench $i rc=$?"
done
python3 kernels/bench/summarize_runs.py --ref $c $W/d64_*.json | tee $W/d64_summary.txt
tar czf $OUT/v14call3.tgz -C /tmp v14c3

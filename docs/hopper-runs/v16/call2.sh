#!/usr/bin/env bash
# NOTE: in call 2 the bench steps failed (rc=2): the run copies the repository, whose hopper_bench.py had no
# --base_lib yet; call 3 re-ran them with the new bench from .carry-hopper.
# v16 call 2: the masked P V skip and the shorter split-tail combine. .carry-hopper holds v16/ (this build's
# libattnd_kernels_c.so), base/ (44861c5's), gpu_attention_test and hopper_trace of this build.
# Smoke, the Hopper suite, the defaults on 3 blocks, forced split tails on 3 and 7 blocks, the sanitizers on
# masked and split cases, then bench processes timing both builds in one process (--base_lib), order rotated.
set -u
C=.carry-hopper; W=/tmp/v16c2; mkdir -p $W
export LD_LIBRARY_PATH=$PWD/$C/lib
T=$C/gpu_attention_test
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -8; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > $W/env.txt
timeout 30 $T --gtest_filter='*hopper_sm90_d128_m128n176s2_os_d128_sq129_tl*:*hopper_sm90_d128_m128n128s3_osk_d128_sq129_tl*' > $W/smoke.log 2>&1
rc=$?; echo "smoke rc=$rc"; tail -2 $W/smoke.log
[ $rc = 0 ] || { tar czf $OUT/v16call2.tgz -C /tmp v16c2; exit 1; }
timeout 200 $T --gtest_filter='*hopper_*:*auto_*:KernelApi*' > $W/suite.log 2>&1
echo "suite rc=$?"; pass $W/suite.log; grep -E "tests? ran" $W/suite.log
D='*hopper_sm90_d128_m128n176s2_os_*:*hopper_sm90_d128_m128n128s3_osk_*:*hopper_sm90_d256_m128n64s2_*:*hopper_sm90_d64_m192n128s4_d64*:*hopper_sm90_d128_m128n176s2_d*'
ATTND_HOPPER_MAX_BLOCKS=3 timeout 120 $T --gtest_filter="$D" > $W/blocks3.log 2>&1
echo "3 blocks rc=$?"; pass $W/blocks3.log
F='*hopper_sm90_d128_m128n128s3_d*:*hopper_sm90_d128_m128n176s2_*:*hopper_sm90_d256_m128n64s2_*'
for nb in 3 7; do
  ATTND_HOPPER_MAX_BLOCKS=$nb ATTND_HOPPER_SPLIT_TAIL=2 timeout 120 $T --gtest_filter="$F" > $W/split_blocks$nb.log 2>&1
  echo "split $nb blocks rc=$?"; pass $W/split_blocks$nb.log
done
S='*hopper_sm90_d128_m128n176s2_os_d128_sq1000_tl*:*hopper_sm90_d128_m128n128s3_osk_d128_q1000kv65_br*:*hopper_sm90_d256_m128n64s2_d256_sq1000_tl*:*hopper_sm90_d128_m128n176s2_d128_sq1000_none*'
for tool in memcheck synccheck racecheck; do
  f=$S; [ $tool = racecheck ] && f='*hopper_sm90_d128_m128n176s2_os_d128_sq129_tl*'
  ATTND_HOPPER_MAX_BLOCKS=3 ATTND_HOPPER_SPLIT_TAIL=2 ATTND_GPU_TEST_SMALL=1 timeout 100 compute-sanitizer --tool $tool \
    --error-exitcode 9 $T --gtest_filter="$f" > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done
N=$C/v16/libattnd_kernels_c.so; B=$C/base/libattnd_kernels_c.so
for i in 1 2 3 4; do
  cfg=auto,base:auto; [ $((i % 2)) = 0 ] && cfg=base:auto,auto
  PYTHONUNBUFFERED=1 timeout 100 python3 kernels/bench/hopper_bench.py --lib $N --base_lib $B --configs $cfg \
    --peers cudnn --rep 30 --head_dims 128 --seqs 16384 --json $W/long_$i.json > $W/long_$i.txt 2>&1
  echo "long $i rc=$?"
done
for i in 1 2; do
  cfg=auto,base:auto; [ $((i % 2)) = 0 ] && cfg=base:auto,auto
  PYTHONUNBUFFERED=1 timeout 120 python3 kernels/bench/hopper_bench.py --lib $N --base_lib $B --configs $cfg \
    --peers cudnn --rep 30 --head_dims 128 --causal yes --seqs 1024,2048,4096,8192 --json $W/short_$i.json > $W/short_$i.txt 2>&1
  echo "short $i rc=$?"
done
python3 kernels/bench/summarize_runs.py --ref base:auto $W/long_*.json | tee $W/long_summary.txt
python3 kernels/bench/summarize_runs.py --ref base:auto $W/short_*.json | tee $W/short_summary.txt
ATTND_HOPPER_SPLIT_TAIL=1 timeout 60 $C/hopper_trace --timeline hopper_sm90_d128_m128n176s2_os 1 16384 16 1 \
  hopper_sm90_d128_m128n176s2_os 1 16384 16 0 > $W/timeline.txt 2>&1
echo "timeline rc=$?"; grep -E "^==|block ends" $W/timeline.txt
tar czf $OUT/v16call2.tgz -C /tmp v16c2

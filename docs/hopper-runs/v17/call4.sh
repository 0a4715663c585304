#!/usr/bin/env bash
# v17 call 4: the library to land (v1d/: the masked P V skip in the paired 176-key kernels only, the split tail's
# combine as before, auto's 128x176 without a mask from 8k keys). Suite, defaults on 3 blocks, forced split tails,
# sanitizers on paired 128x176 and split cases; then A/B against base/ (f6e67f4) in each process, order alternating:
# causal 16k (six processes), non-causal 8k / 16k (four); then two processes of the d128 table beside cuDNN and FA2.
set -u
C=.carry-hopper; W=/tmp/v17c4; mkdir -p $W
trap 'tar czf $OUT/v17c4.tgz -C /tmp v17c4' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -8; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > $W/env.txt
T=$C/t1d
timeout 30 $T --gtest_filter='*hopper_sm90_d128_m128n176s2_os_d128_sq129_tl*' > $W/smoke.log 2>&1
rc=$?; echo "smoke rc=$rc"; tail -1 $W/smoke.log; [ $rc = 0 ] || exit 1
timeout 120 $T --gtest_filter='*hopper_*:*auto_*:KernelApi*' > $W/suite.log 2>&1
echo "suite rc=$?"; pass $W/suite.log
D='*auto_*:*hopper_sm90_d128_m128n176s2_os_*:*hopper_sm90_d128_m128n128s3_osk_*:*hopper_sm90_d256_m128n64s2_*'
ATTND_HOPPER_MAX_BLOCKS=3 timeout 100 $T --gtest_filter="$D" > $W/blocks3.log 2>&1
echo "3 blocks rc=$?"; pass $W/blocks3.log
F='*hopper_sm90_d128_m128n128s3_d*:*hopper_sm90_d128_m128n176s2_*:*hopper_sm90_d256_m128n64s2_*'
for nb in 3 7; do
  ATTND_HOPPER_MAX_BLOCKS=$nb ATTND_HOPPER_SPLIT_TAIL=2 timeout 100 $T --gtest_filter="$F" > $W/split_$nb.log 2>&1
  echo "split $nb blocks rc=$?"; pass $W/split_$nb.log
done
S='*hopper_sm90_d128_m128n176s2_os_d128_sq1000_tl*:*hopper_sm90_d128_m128n176s2_os_d128_q1000kv65_br*:*hopper_sm90_d128_m128n176s2_d128_sq1000_tl*'
for tool in memcheck synccheck racecheck; do
  f=$S; [ $tool = racecheck ] && f='*hopper_sm90_d128_m128n176s2_os_d128_sq129_tl*'
  ATTND_HOPPER_MAX_BLOCKS=3 ATTND_HOPPER_SPLIT_TAIL=2 ATTND_GPU_TEST_SMALL=1 timeout 100 compute-sanitizer --tool $tool \
    --error-exitcode 9 $T --gtest_filter="$f" > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done
N=$C/v1d/libattnd_kernels_c.so; B=$C/base/libattnd_kernels_c.so
run() {  # name index extra-args...
  local name=$1 i=$2; shift 2
  [ $SECONDS -gt 470 ] && { echo "$name $i skipped (time)"; return; }
  local cfg=auto,base:auto; [ $((i % 2)) = 0 ] && cfg=base:auto,auto
  PYTHONUNBUFFERED=1 timeout 100 python3 kernels/bench/hopper_bench.py --lib $N --base_lib $B --configs $cfg \
    --peers cudnn --rep 30 --json $W/${name}_$i.json "$@" > $W/${name}_$i.txt 2>&1
  echo "$name $i rc=$?"
}
for i in 1 2 3 4 5 6; do run causal $i --head_dims 128 --causal yes --seqs 16384; done
for i in 1 2 3 4; do run nc $i --head_dims 128 --causal no --seqs 8192,16384; done
for i in 1 2; do
  [ $SECONDS -gt 470 ] && break
  PYTHONUNBUFFERED=1 timeout 100 python3 kernels/bench/hopper_bench.py --lib $N --configs hopper --peers cudnn,fa2 \
    --rep 30 --head_dims 128 --json $W/table_$i.json > $W/table_$i.txt 2>&1
  echo "table $i rc=$?"
done
for n in causal nc; do
  python3 kernels/bench/summarize_runs.py --ref base:auto $W/${n}_*.json | tee $W/${n}_summary.txt
done
python3 kernels/bench/summarize_runs.py --ref cudnn $W/table_*.json > $W/table_summary.txt

#!/usr/bin/env bash
# v17 call 1. .carry-hopper: base/ (f6e67f4's libattnd_kernels_c.so), v1/ (v16's masked P V skip at 176-key
# blocks only, with the shorter split-tail combine), v2/ (the combine alone), t1 / t2: their gpu_attention_test.
# Suites of both, then bench processes timing each build against base in one process (order alternating), and
# 128x176 `_os` with forced split tails at 4k / 8k without a mask beside auto.
set -u
C=.carry-hopper; W=/tmp/v17c1; mkdir -p $W
trap 'tar czf $OUT/v17c1.tgz -C /tmp v17c1' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -8; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > $W/env.txt
for v in 1 2; do
  T=$C/t$v
  timeout 30 $T --gtest_filter='*hopper_sm90_d128_m128n176s2_os_d128_sq129_tl*' > $W/smoke$v.log 2>&1
  rc=$?; echo "v$v smoke rc=$rc"; tail -1 $W/smoke$v.log
  [ $rc = 0 ] || continue
  timeout 120 $T --gtest_filter='*hopper_*:*auto_*:KernelApi*' > $W/suite$v.log 2>&1
  echo "v$v suite rc=$?"; pass $W/suite$v.log
  F='*hopper_sm90_d128_m128n128s3_d*:*hopper_sm90_d128_m128n176s2_*:*hopper_sm90_d256_m128n64s2_*'
  for nb in 3 7; do
    ATTND_HOPPER_MAX_BLOCKS=$nb ATTND_HOPPER_SPLIT_TAIL=2 timeout 100 $T --gtest_filter="$F" > $W/split${v}_$nb.log 2>&1
    echo "v$v split $nb blocks rc=$?"; pass $W/split${v}_$nb.log
  done
done
S='*hopper_sm90_d128_m128n176s2_os_d128_sq1000_tl*:*hopper_sm90_d128_m128n176s2_os_d128_q1000kv65_br*:*hopper_sm90_d256_m128n64s2_d256_sq1000_tl*'
for tool in memcheck racecheck; do
  f=$S; [ $tool = racecheck ] && f='*hopper_sm90_d128_m128n176s2_os_d128_sq129_tl*'
  ATTND_HOPPER_MAX_BLOCKS=3 ATTND_HOPPER_SPLIT_TAIL=2 ATTND_GPU_TEST_SMALL=1 timeout 90 compute-sanitizer --tool $tool \
    --error-exitcode 9 $C/t1 --gtest_filter="$f" > $W/san_$tool.log 2>&1
  echo "v1 $tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1
done
B=$C/base/libattnd_kernels_c.so
run() {  # variant name index extra-args...
  local v=$1 name=$2 i=$3; shift 3
  [ $SECONDS -gt 480 ] && { echo "$name $i skipped (time)"; return; }
  local cfg=auto,base:auto; [ $((i % 2)) = 0 ] && cfg=base:auto,auto
  PYTHONUNBUFFERED=1 timeout 100 python3 kernels/bench/hopper_bench.py --lib $C/v$v/libattnd_kernels_c.so --base_lib $B \
    --configs $cfg --peers cudnn --rep 30 --json $W/${name}_$i.json "$@" > $W/${name}_$i.txt 2>&1
  echo "$name $i rc=$?"
}
for i in 1 2 3 4 5 6; do run 1 v1long $i --head_dims 128 --seqs 16384; done
for i in 1 2 3 4; do run 2 v2long $i --head_dims 128 --seqs 16384; done
for i in 1 2; do run 1 v1d256 $i --head_dims 256 --seqs 8192,16384 --no-gqa; done
for i in 1 2; do run 2 v2d256 $i --head_dims 256 --seqs 8192,16384 --no-gqa; done
N176=hopper_sm90_d128_m128n176s2_os
for i in 1 2 3 4; do
  cfg=auto,$N176; [ $((i % 2)) = 0 ] && cfg=$N176,auto
  split=2; [ $i -gt 2 ] && split=1
  [ $SECONDS -gt 480 ] && { echo "n176 $i skipped (time)"; continue; }
  ATTND_HOPPER_SPLIT_TAIL=$split PYTHONUNBUFFERED=1 timeout 100 python3 kernels/bench/hopper_bench.py --lib $B \
    --configs $cfg --peers cudnn --rep 30 --head_dims 128 --causal no --seqs 4096,8192 --json $W/n176split${split}_$i.json \
    > $W/n176split${split}_$i.txt 2>&1
  echo "n176 split=$split $i rc=$?"
done
for n in v1long v2long v1d256 v2d256; do
  python3 kernels/bench/summarize_runs.py --ref base:auto $W/${n}_*.json | tee $W/${n}_summary.txt
done
for s in 2 1; do python3 kernels/bench/summarize_runs.py --ref auto $W/n176split${s}_*.json | tee $W/n176split${s}_summary.txt; done

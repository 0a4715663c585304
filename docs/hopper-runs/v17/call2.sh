#!/usr/bin/env bash
# v17 call 2: the candidate library (v1b/: call 1's v1 plus auto taking 128x176 `_os` without a mask from 8k keys)
# against base/ (f6e67f4), both in each process, order alternating; its suite; then the d128 table beside cuDNN.
set -u
C=.carry-hopper; W=/tmp/v17c2; mkdir -p $W
trap 'tar czf $OUT/v17c2.tgz -C /tmp v17c2' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -8; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > $W/env.txt
T=$C/t1b
timeout 120 $T --gtest_filter='*hopper_*:*auto_*:KernelApi*' > $W/suite.log 2>&1
echo "suite rc=$?"; pass $W/suite.log
ATTND_HOPPER_MAX_BLOCKS=3 timeout 100 $T --gtest_filter='*auto_*:*hopper_sm90_d128_m128n176s2_os_*' > $W/blocks3.log 2>&1
echo "3 blocks rc=$?"; pass $W/blocks3.log
N=$C/v1b/libattnd_kernels_c.so; B=$C/base/libattnd_kernels_c.so
run() {  # name index extra-args...
  local name=$1 i=$2; shift 2
  [ $SECONDS -gt 470 ] && { echo "$name $i skipped (time)"; return; }
  local cfg=auto,base:auto; [ $((i % 2)) = 0 ] && cfg=base:auto,auto
  PYTHONUNBUFFERED=1 timeout 100 python3 kernels/bench/hopper_bench.py --lib $N --base_lib $B --configs $cfg \
    --peers cudnn --rep 30 --json $W/${name}_$i.json "$@" > $W/${name}_$i.txt 2>&1
  echo "$name $i rc=$?"
}
for i in 1 2 3 4; do run nc $i --head_dims 128 --causal no --seqs 8192,16384; done
for i in 1 2 3 4; do run causal $i --head_dims 128 --causal yes --seqs 16384; done
for i in 1 2 3 4; do run d256 $i --head_dims 256 --seqs 8192,16384 --no-gqa; done
for i in 1 2; do
  [ $SECONDS -gt 470 ] && break
  PYTHONUNBUFFERED=1 timeout 100 python3 kernels/bench/hopper_bench.py --lib $N --configs hopper --peers cudnn,fa2 \
    --rep 30 --head_dims 128 --json $W/table_$i.json > $W/table_$i.txt 2>&1
  echo "table $i rc=$?"
done
for n in nc causal d256; do
  python3 kernels/bench/summarize_runs.py --ref base:auto $W/${n}_*.json | tee $W/${n}_summary.txt
done
python3 kernels/bench/summarize_runs.py --ref cudnn $W/table_*.json > $W/table_summary.txt

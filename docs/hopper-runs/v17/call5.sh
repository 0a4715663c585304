#!/usr/bin/env bash
# v17 call 5: the library as landed (final/: f6e67f4's kernels, auto taking 128x176 `_os` without a mask from 8k
# keys). Its suite and the defaults on 3 blocks; the headline rows and non-causal 8k beside cuDNN (four
# processes); then two processes of the whole table (head_dim 64 / 128 / 256) beside cuDNN and FA2.
set -u
C=.carry-hopper; W=/tmp/v17c5; mkdir -p $W
trap 'tar czf $OUT/v17c5.tgz -C /tmp v17c5' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -8; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > $W/env.txt
python3 -c 'import torch; print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version())' >> $W/env.txt
T=$C/tf
timeout 120 $T --gtest_filter='*hopper_*:*auto_*:KernelApi*' > $W/suite.log 2>&1
echo "suite rc=$?"; pass $W/suite.log
ATTND_HOPPER_MAX_BLOCKS=3 timeout 100 $T --gtest_filter='*auto_*' > $W/blocks3.log 2>&1
echo "3 blocks rc=$?"; pass $W/blocks3.log
N=$C/final/libattnd_kernels_c.so
for i in 1 2 3 4; do
  PYTHONUNBUFFERED=1 timeout 100 python3 kernels/bench/hopper_bench.py --lib $N --configs hopper --peers cudnn \
    --rep 30 --head_dims 128 --seqs 8192,16384 --json $W/head_$i.json > $W/head_$i.txt 2>&1
  echo "head $i rc=$?"
done
for i in 1 2; do
  [ $SECONDS -gt 420 ] && break
  PYTHONUNBUFFERED=1 timeout 150 python3 kernels/bench/hopper_bench.py --lib $N --configs hopper --peers cudnn,fa2 \
    --rep 30 --json $W/table_$i.json > $W/table_$i.txt 2>&1
  echo "table $i rc=$?"
done
python3 kernels/bench/summarize_runs.py --ref cudnn $W/head_*.json | tee $W/head_summary.txt
python3 kernels/bench/summarize_runs.py --ref cudnn $W/table_*.json > $W/table_summary.txt

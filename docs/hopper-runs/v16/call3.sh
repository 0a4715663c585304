#!/usr/bin/env bash
# v16 call 3: call 2's bench part (call 2 ran the repository's hopper_bench.py, which has no --base_lib yet).
set -u
C=.carry-hopper; W=/tmp/v16c3; mkdir -p $W
export LD_LIBRARY_PATH=$PWD/$C/lib
N=$C/v16/libattnd_kernels_c.so; B=$C/base/libattnd_kernels_c.so
for i in 1 2 3 4; do
  cfg=auto,base:auto; [ $((i % 2)) = 0 ] && cfg=base:auto,auto
  PYTHONUNBUFFERED=1 timeout 100 python3 $C/hopper_bench.py --lib $N --base_lib $B --configs $cfg \
    --peers cudnn --rep 30 --head_dims 128 --seqs 16384 --json $W/long_$i.json > $W/long_$i.txt 2>&1
  echo "long $i rc=$?"
done
for i in 1 2; do
  cfg=auto,base:auto; [ $((i % 2)) = 0 ] && cfg=base:auto,auto
  PYTHONUNBUFFERED=1 timeout 120 python3 $C/hopper_bench.py --lib $N --base_lib $B --configs $cfg \
    --peers cudnn --rep 30 --head_dims 128 --causal yes --seqs 1024,2048,4096,8192 --json $W/short_$i.json > $W/short_$i.txt 2>&1
  echo "short $i rc=$?"
done
python3 kernels/bench/summarize_runs.py --ref base:auto $W/long_*.json | tee $W/long_summary.txt
python3 kernels/bench/summarize_runs.py --ref base:auto $W/short_*.json | tee $W/short_summary.txt
tail -3 $W/long_1.txt
tar czf $OUT/v16call3.tgz -C /tmp v16c3

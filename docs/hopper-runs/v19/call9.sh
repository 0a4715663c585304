#!/usr/bin/env bash
# v19 call 4: the whole table (settled), the final library, cuDNN and FA2 beside, two processes, order alternating.
set -u
C=.carry-hopper; W=/tmp/v19c4; mkdir -p $W
trap 'tar czf $OUT/v19c4.tgz -C /tmp v19c4' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
N=$C/v19/libattnd_kernels_c.so
for i in 1 2; do
  order=""; [ $i = 1 ] && order=--peers_last
  PYTHONUNBUFFERED=1 timeout 170 python3 kernels/bench/hopper_bench.py --lib $N --configs auto --peers cudnn,fa2 \
    --rep 100 --settle_ms 500 $order --seqs 1024,2048,4096,8192,16384 --json $W/table_$i.json > $W/table_$i.txt 2>&1
  echo "table $i rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref cudnn $W/table_*.json > $W/table_summary.txt
grep -E '^\(|auto / cudnn' $W/table_summary.txt

#!/usr/bin/env bash
# v17 call 8: the whole table on the landed library beside cuDNN, every column settled (--settle_ms 500, --rep 100),
# two processes with the order of peers and attnd swapped between them.
set -u
C=.carry-hopper; W=/tmp/v17c8; mkdir -p $W
trap 'tar czf $OUT/v17c8.tgz -C /tmp v17c8' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
N=$C/final/libattnd_kernels_c.so
for i in 1 2; do
  order=""; [ $i = 1 ] && order=--peers_last
  PYTHONUNBUFFERED=1 timeout 110 python3 kernels/bench/hopper_bench.py --lib $N --configs hopper --peers cudnn \
    --rep 100 --settle_ms 500 $order --json $W/table_$i.json > $W/table_$i.txt 2>&1
  echo "table $i rc=$? $order"
done
python3 kernels/bench/summarize_runs.py --ref cudnn $W/table_*.json > $W/table_summary.txt
grep -B1 'hopper / cudnn' $W/table_summary.txt | grep -o "^([^)]*)\|hopper / cudnn: median [0-9.]*" | paste - - 

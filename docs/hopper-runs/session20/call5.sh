#!/usr/bin/env bash
# Session 20, call 5: main's library (9badc58's kernels; v25 and v26 not kept) in this call's machine: the whole
# table (settled, cuDNN and FA2 beside), two processes with the order alternating, then headline rows in more
# processes while time is left.
set -u
C=.carry-hopper; W=/tmp/s20c5; mkdir -p $W
trap 'tar czf $OUT/s20c5.tgz -C /tmp s20c5' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
N=$C/base/libattnd_kernels_c.so
for i in 1 2; do
  order=""; [ $i = 1 ] && order=--peers_last
  PYTHONUNBUFFERED=1 timeout 170 python3 kernels/bench/hopper_bench.py --lib $N --configs auto --peers cudnn,fa2 \
    --rep 100 --settle_ms 500 $order --seqs 1024,2048,4096,8192,16384 --json $W/table_$i.json > $W/table_$i.txt 2>&1
  echo "table $i rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref cudnn $W/table_*.json > $W/table_summary.txt
for i in 1 2 3 4 5 6; do
  [ $SECONDS -gt 300 ] && break
  order=""; [ $((i % 2)) = 1 ] && order=--peers_last
  PYTHONUNBUFFERED=1 timeout 60 python3 kernels/bench/hopper_bench.py --lib $N --configs auto --peers cudnn \
    --rep 100 --settle_ms 500 $order --no-gqa --head_dims 128 --seqs 16384 --json $W/head_$i.json > $W/head_$i.txt 2>&1
  echo "headline $i rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref cudnn $W/head_*.json > $W/head_summary.txt
grep -E '^\(|auto / cudnn' $W/table_summary.txt | cut -c1-200
grep -E '^\(' $W/head_summary.txt

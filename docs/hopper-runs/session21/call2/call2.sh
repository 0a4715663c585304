#!/usr/bin/env bash
# Session 21, call 2: main's library (98965c3: auto on six K/V stages for the d64 short rows) — the whole table
# (settled, cuDNN and FA2 beside) in three processes that rotate the three columns through every position
# (--order), then the headline rows alone in six processes, the order alternating.
set -u
C=.carry-hopper; W=/tmp/s21c2; mkdir -p $W
trap 'tar czf $OUT/s21c2.tgz -C /tmp s21c2' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
N=$C/v33/libattnd_kernels_c.so
orders=(auto,cudnn,fa2 cudnn,fa2,auto fa2,auto,cudnn)
for i in 1 2 3; do
  PYTHONUNBUFFERED=1 timeout 170 python3 kernels/bench/hopper_bench.py --lib $N --configs auto --peers cudnn,fa2 \
    --rep 100 --settle_ms 500 --order ${orders[$((i - 1))]} --seqs 1024,2048,4096,8192,16384 \
    --json $W/table_$i.json > $W/table_$i.txt 2>&1
  echo "table $i (${orders[$((i - 1))]}) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref cudnn $W/table_*.json > $W/table_summary.txt
for i in 1 2 3 4 5 6; do
  [ $SECONDS -gt 500 ] && break
  o=auto,cudnn; [ $((i % 2)) = 0 ] && o=cudnn,auto
  PYTHONUNBUFFERED=1 timeout 60 python3 kernels/bench/hopper_bench.py --lib $N --configs auto --peers cudnn \
    --rep 100 --settle_ms 500 --order $o --no-gqa --head_dims 128 --seqs 16384 --json $W/head_$i.json \
    > $W/head_$i.txt 2>&1
  echo "headline $i ($o) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref cudnn $W/head_*.json > $W/head_summary.txt
grep -E '^\(|auto / cudnn' $W/table_summary.txt | cut -c1-200
grep -E '^\(' $W/head_summary.txt

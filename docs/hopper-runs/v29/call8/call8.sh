#!/usr/bin/env bash
# Session 21, call 8 (v29, the command as run): the headline rows alone on the split-tail library, four processes,
# the order alternating (results were written to $OUT/h and copied here).
export LD_LIBRARY_PATH=$PWD/.carry-hopper/lib; mkdir -p $OUT/h
for i in 1 2 3 4; do
  o=auto,cudnn; [ $((i % 2)) = 0 ] && o=cudnn,auto; [ $SECONDS -gt 75 ] && break
  PYTHONUNBUFFERED=1 timeout 30 python3 kernels/bench/hopper_bench.py --lib .carry-hopper/v36/libattnd_kernels_c.so \
    --configs auto --peers cudnn --rep 100 --settle_ms 500 --order $o --no-gqa --head_dims 128 --seqs 16384 \
    --json $OUT/h/head_$i.json > $OUT/h/head_$i.txt 2>&1
  echo "head $i ($o) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref cudnn $OUT/h/head_*.json | cut -c1-200

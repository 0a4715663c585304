#!/usr/bin/env bash
# v21 call 5 (session 18, on the machine call 4 left warm): the headline rows alone, the final library, four
# processes, the order of attnd and cuDNN alternating.
W=/tmp/hl; mkdir -p $W; export LD_LIBRARY_PATH=$PWD/.carry-hopper/lib
for i in 1 2 3 4; do
  o=""; [ $((i%2)) = 1 ] && o=--peers_last
  PYTHONUNBUFFERED=1 timeout 80 python3 kernels/bench/hopper_bench.py --lib .carry-hopper/v23/libattnd_kernels_c.so \
    --configs auto --peers cudnn --rep 100 --settle_ms 500 $o --no-gqa --head_dims 128 --seqs 16384 --json $W/h_$i.json \
    > $W/h_$i.txt 2>&1
  echo "h $i rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref cudnn $W/h_*.json | tee $W/summary.txt; cp -r $W $OUT/

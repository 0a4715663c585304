#!/usr/bin/env bash
# Session 25, call 5: the whole table on main's library (38affe5; kernels as in session 24), the columns rotated
# through every position as in session 22's call 2; then more processes of the d64 1k-2k rows, the ones nearest the
# bar, attnd and cuDNN alternating first. .carry-hopper: table/ (the library timed) and lib/ (abseil .so files).
set -u
C=.carry-hopper; W=/tmp/s25c5; mkdir -p $W
trap 'tar czf $OUT/s25c5.tgz -C /tmp s25c5' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
N=$C/table/libattnd_kernels_c.so
orders=(auto,cudnn,fa2 cudnn,fa2,auto fa2,auto,cudnn)
for i in 1 2 3; do
  PYTHONUNBUFFERED=1 timeout 170 python3 kernels/bench/hopper_bench.py --lib $N --configs auto --peers cudnn,fa2 \
    --rep 100 --settle_ms 500 --order ${orders[$((i - 1))]} --seqs 1024,2048,4096,8192,16384 \
    --json $W/table_$i.json > $W/table_$i.txt 2>&1
  echo "table $i (${orders[$((i - 1))]}) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref cudnn $W/table_*.json > $W/table_summary.txt
for i in 1 2 3 4 5 6 7 8; do
  [ $SECONDS -gt 320 ] && break
  o=auto,cudnn; [ $((i % 2)) = 0 ] && o=cudnn,auto
  PYTHONUNBUFFERED=1 timeout 40 python3 kernels/bench/hopper_bench.py --lib $N --configs auto --peers cudnn \
    --rep 100 --settle_ms 500 --order $o --head_dims 64 --seqs 1024,2048 --no-gqa \
    --json $W/d64_$i.json > $W/d64_$i.txt 2>&1
  echo "d64 1k/2k ($o) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref cudnn $W/d64_*.json > $W/d64_summary.txt
grep -E '^\(|auto / cudnn' $W/table_summary.txt | cut -c1-200
echo "== d64 1k/2k"; grep -E '^\(|auto / cudnn' $W/d64_summary.txt | cut -c1-200

#!/usr/bin/env bash
# v33 call 7: call 5's library (uniform_wg.diff), the rows nearest their bars in more processes: d128 causal 16k
# (bar 650) with d64 causal 1k and non-causal 1k (bar 1.0x cuDNN), attnd and cuDNN order alternating. Carry: v46/.
set -u
C=.carry-hopper; W=/tmp/v33c7; mkdir -p $W
trap 'tar czf $OUT/v33c7.tgz -C /tmp v33c7' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
N=$C/v46/libattnd_kernels_c.so
for i in 1 2 3 4 5 6 7 8; do
  [ $SECONDS -gt 180 ] && break
  o=auto,cudnn; [ $((i % 2)) = 0 ] && o=cudnn,auto
  PYTHONUNBUFFERED=1 timeout 40 python3 kernels/bench/hopper_bench.py --lib $N --configs auto --peers cudnn \
    --rep 100 --settle_ms 500 --order $o --no-gqa --head_dims 64 --seqs 1024 --json $W/d64_$i.json > $W/d64_$i.txt 2>&1
  PYTHONUNBUFFERED=1 timeout 40 python3 kernels/bench/hopper_bench.py --lib $N --configs auto --peers cudnn \
    --rep 100 --settle_ms 500 --order $o --no-gqa --head_dims 128 --causal yes --seqs 16384 --json $W/d128_$i.json \
    > $W/d128_$i.txt 2>&1
  echo "process pair $i ($o) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref cudnn $W/d64_*.json $W/d128_*.json > $W/summary.txt
grep -E '^\(|auto / cudnn' $W/summary.txt | cut -c1-220

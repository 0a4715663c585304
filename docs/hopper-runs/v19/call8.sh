#!/usr/bin/env bash
# v19 call 3: the quad-max skip against base, more processes, order alternating (settled).
set -u
C=.carry-hopper; W=/tmp/v19c3; mkdir -p $W
trap 'tar czf $OUT/v19c3.tgz -C /tmp v19c3' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
N=$C/v19/libattnd_kernels_c.so; B=$C/base/libattnd_kernels_c.so
for i in 1 2 3 4 5 6 7 8; do
  [ $SECONDS -gt 430 ] && break
  order=""; cfg=auto,base:auto; [ $((i % 2)) = 1 ] && order=--peers_last
  [ $(( (i + 1) / 2 % 2)) = 0 ] && cfg=base:auto,auto
  PYTHONUNBUFFERED=1 timeout 100 python3 kernels/bench/hopper_bench.py --lib $N --base_lib $B --configs $cfg --peers cudnn \
    --rep 100 --settle_ms 500 $order --head_dims 64,128,256 --seqs 4096,16384 --no-gqa --json $W/ab_$i.json > $W/ab_$i.txt 2>&1
  echo "ab $i ($cfg $order) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref base:auto $W/ab_*.json > $W/ab_summary.txt
grep -E '^\(|auto / base' $W/ab_summary.txt

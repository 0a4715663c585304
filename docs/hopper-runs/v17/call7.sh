#!/usr/bin/env bash
# v17 call 7: the landed library (final/) beside cuDNN with every column settled before its timing
# (hopper_bench.py --settle_ms 500, --rep 100) and the order of peers and attnd alternating between processes
# (--peers_last in the odd ones): the headline rows and 8k (six processes), d128 non-causal 1k-4k (two).
set -u
C=.carry-hopper; W=/tmp/v17c7; mkdir -p $W
trap 'tar czf $OUT/v17c7.tgz -C /tmp v17c7' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > $W/env.txt
N=$C/final/libattnd_kernels_c.so
run() {  # name index extra-args...
  local name=$1 i=$2; shift 2
  [ $SECONDS -gt 330 ] && { echo "$name $i skipped (time)"; return; }
  local order=""; [ $((i % 2)) = 1 ] && order=--peers_last
  PYTHONUNBUFFERED=1 timeout 100 python3 kernels/bench/hopper_bench.py --lib $N --configs hopper --peers cudnn \
    --rep 100 --settle_ms 500 $order --json $W/${name}_$i.json "$@" > $W/${name}_$i.txt 2>&1
  echo "$name $i rc=$? $order"
}
run head 1 --head_dims 128 --seqs 8192,16384
rc=$(tail -1 $W/head_1.txt >/dev/null; grep -c 'Traceback' $W/head_1.txt)
[ "$rc" = 0 ] || { tail -20 $W/head_1.txt; exit 1; }
for i in 2 3 4 5 6; do run head $i --head_dims 128 --seqs 8192,16384; done
for i in 1 2; do run short $i --head_dims 128 --causal no --seqs 1024,2048,4096; done
python3 kernels/bench/summarize_runs.py --ref cudnn $W/head_*.json | tee $W/head_summary.txt
python3 kernels/bench/summarize_runs.py --ref cudnn $W/short_*.json | tee $W/short_summary.txt

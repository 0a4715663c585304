#!/usr/bin/env bash
# Session 26, call 4: the headline rows (d128, 16k, causal and not, GQA 16:2 too) on v41's final library, six
# processes with attnd and cuDNN alternating first, to put a settled median beside call 3's table (615-652 causal).
# Carry: .carry-hopper/s26c3.tar.xz (v41f/), lib/.
set -u
C=.carry-hopper; W=/tmp/s26c4; mkdir -p $W
trap 'tar czf $OUT/s26c4.tgz -C /tmp s26c4' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
tar xJf $C/s26c3.tar.xz -C $C || exit 1
N=$C/v41f/libattnd_kernels_c.so
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > $W/env.txt; cat $W/env.txt
for i in 1 2 3 4 5 6 7 8; do
  [ $SECONDS -gt 300 ] && break
  o=auto,cudnn; [ $((i % 2)) = 0 ] && o=cudnn,auto
  PYTHONUNBUFFERED=1 timeout 60 python3 kernels/bench/hopper_bench.py --lib $N --configs auto --peers cudnn \
    --rep 100 --settle_ms 500 --order $o --head_dims 128 --seqs 16384 --json $W/head_$i.json > $W/head_$i.txt 2>&1
  echo "headline ($o) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref cudnn $W/head_*.json > $W/head_summary.txt
grep -E '^\(|auto / cudnn' $W/head_summary.txt | cut -c1-200

#!/usr/bin/env bash
# Session 24, call 5: is d64 causal 1k lost per launch or per tile? Every FA3 row at one head_dim has the same number
# of q tiles (16k tokens), so the fit of session 21 could not tell a per-tile cost from one paid once per launch (the
# ramp with L2 cold after do_bench's flush, the tail). Here seq 1k at batches 4 / 16 / 64: a per-launch cost weighs
# 16x less at 64 than at 4, a per-tile one the same. Main's library, cuDNN beside it, the order alternating.
# .carry-hopper: table/ (main's library) and lib/.
set -u
C=.carry-hopper; W=/tmp/s24c5; mkdir -p $W
trap 'tar czf $OUT/s24c5.tgz -C /tmp s24c5' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
N=$C/table/libattnd_kernels_c.so
for i in 1 2 3 4 5 6; do
  [ $SECONDS -gt 200 ] && break
  o=auto,cudnn; [ $((i % 2)) = 0 ] && o=cudnn,auto
  PYTHONUNBUFFERED=1 timeout 80 python3 kernels/bench/hopper_bench.py --lib $N --configs auto --peers cudnn \
    --rep 100 --settle_ms 500 --order $o --head_dims 64,128 --seqs 1024 --batches 4,16,64 --no-gqa \
    --json $W/batches_$i.json > $W/batches_$i.txt 2>&1
  echo "batches $i ($o) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref cudnn $W/batches_*.json > $W/batches_summary.txt
grep -E '^\(|auto / cudnn' $W/batches_summary.txt | cut -c1-220

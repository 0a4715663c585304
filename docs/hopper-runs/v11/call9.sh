#!/usr/bin/env bash
# Session 10 call 9: the headline rows (d128, 16k, one sequence of 16 heads) on the final library, six processes,
# cuDNN in each: their spread, with the GPU idle before the first and busy for the rest.
set -u
C=.carry-hopper; W=/tmp/s10c9; mkdir -p $W
export LD_LIBRARY_PATH=$PWD/$C/lib
for i in 1 2 3 4 5 6; do
  PYTHONUNBUFFERED=1 timeout 60 python3 kernels/bench/hopper_bench.py --lib $C/new/libattnd_kernels_c.so --configs hopper \
    --peers cudnn --rep 100 --head_dims 128 --seqs 16384 --no-gqa > $W/headline_$i.txt 2>&1
  echo "process $i: $(grep -E '^ 128' $W/headline_$i.txt | awk '{printf "%s cudnn %s ours %s; ", ($2=="True"?"causal":"non-causal"), $6, $8}')"
done
tar czf $OUT/s10call9.tgz -C /tmp s10c9

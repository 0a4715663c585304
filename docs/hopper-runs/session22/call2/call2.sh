#!/usr/bin/env bash
# Session 22, call 2: docs/hopper-runs/v29/next_call.sh (prepared in session 21), run as is. Main's library with
# v29's split tail
# (12d16e2) in the whole table, the columns rotated through every position (as session 21's call 2, which ran
# before v29), then causal 8k with and without the split (v29 read it at 0.994 of main's before, 0 of 6): the same
# library, ATTND_HOPPER_SPLIT_TAIL=0 in alternate processes, cuDNN beside as the per-process reference.
# .carry-hopper: v36/ (12d16e2's kernels; rebuild from main if it is gone) and lib/ (the abseil .so files).
set -u
C=.carry-hopper; W=/tmp/v29n; mkdir -p $W
trap 'tar czf $OUT/v29n.tgz -C /tmp v29n' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
N=$C/v36/libattnd_kernels_c.so
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
  split=""; [ $((i % 2)) = 0 ] && split=0
  o=auto,cudnn; [ $(((i + 1) / 2 % 2)) = 0 ] && o=cudnn,auto
  ATTND_HOPPER_SPLIT_TAIL=$split PYTHONUNBUFFERED=1 timeout 40 python3 kernels/bench/hopper_bench.py --lib $N \
    --configs auto --peers cudnn --rep 100 --settle_ms 500 --order $o --head_dims 128 --causal yes --seqs 8192,16384 \
    --no-gqa --json $W/split${split:-1}_$i.json > $W/split${split:-1}_$i.txt 2>&1
  echo "causal 8k/16k, split mode ${split:-1} ($o) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref cudnn $W/split1_*.json > $W/split1_summary.txt
python3 kernels/bench/summarize_runs.py --ref cudnn $W/split0_*.json > $W/split0_summary.txt
grep -E '^\(|auto / cudnn' $W/table_summary.txt | cut -c1-200
for f in split1 split0; do echo "== $f"; grep -E '^\(|auto / cudnn' $W/${f}_summary.txt | cut -c1-200; done

#!/usr/bin/env bash
# v17 call 6: auto's other thresholds re-checked on the landed library (final/): d128 causal 8k, 128x176 `_os`
# against auto (s3 `_osk`); d64 causal 1k-4k, m128 against m192 (auto switches at 2k). Four processes each,
# order alternating, cuDNN beside.
set -u
C=.carry-hopper; W=/tmp/v17c6; mkdir -p $W
trap 'tar czf $OUT/v17c6.tgz -C /tmp v17c6' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
N=$C/final/libattnd_kernels_c.so
run() {  # name index configs extra-args...
  local name=$1 i=$2 cfg=$3; shift 3
  [ $SECONDS -gt 400 ] && { echo "$name $i skipped (time)"; return; }
  PYTHONUNBUFFERED=1 timeout 100 python3 kernels/bench/hopper_bench.py --lib $N --configs $cfg \
    --peers cudnn --rep 30 --json $W/${name}_$i.json "$@" > $W/${name}_$i.txt 2>&1
  echo "$name $i rc=$?"
}
A=hopper_sm90_d128_m128n176s2_os
for i in 1 2 3 4; do
  cfg=auto,$A; [ $((i % 2)) = 0 ] && cfg=$A,auto
  run c8k $i $cfg --head_dims 128 --causal yes --seqs 8192
done
for i in 1 2 3 4; do
  cfg=hopper_sm90_d64_m128n128s4,hopper_sm90_d64_m192n128s4
  [ $((i % 2)) = 0 ] && cfg=hopper_sm90_d64_m192n128s4,hopper_sm90_d64_m128n128s4
  run d64c $i $cfg --head_dims 64 --causal yes --seqs 1024,2048,4096
done
python3 kernels/bench/summarize_runs.py --ref auto $W/c8k_*.json | tee $W/c8k_summary.txt
python3 kernels/bench/summarize_runs.py --ref hopper_sm90_d64_m192n128s4 $W/d64c_*.json | tee $W/d64c_summary.txt

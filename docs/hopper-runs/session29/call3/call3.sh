#!/usr/bin/env bash
# Session 29, call 3: v48, a rejected TryStep moves the reference to the row max (softmax_sm90.cuh). Call 2's dumps:
# the slow causal tiles are the same (head, q tile) in every run, whatever the SM, and a host model of the same inputs
# has exactly those tiles rejecting TryStep on 42-99 of their ~110 blocks (1 with the fix). Checks: the whole Hopper
# suite; the kernels with two P buffers (the ones that run TryStep) and auto's cases with the split tail forced on 3
# blocks; the timeline of causal 16k (block ends, the dump); then A/B in one process, v48 (auto) against main
# (base:auto) with cuDNN beside, every d128 row of the table (GQA too) 1k-16k, the columns rotated; then d64
# non-causal 1k (auto's one d64 kernel with two P buffers) as far as time allows.
# Carry: .carry-hopper/t30.tar.xz (t30/: v48's library, gpu_attention_test and hopper_trace, Release, stripped),
# .carry-hopper/t29.tar.xz (t29/: main's library at f9d5938), lib/.
set -u
C=.carry-hopper; W=/tmp/s29c3; mkdir -p $W
trap 'tar czf $OUT/s29c3.tgz -C /tmp s29c3' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
tar xJf $C/t30.tar.xz -C $C && tar xJf $C/t29.tar.xz -C $C || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > $W/env.txt
python3 -c 'import torch; print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version())' >> $W/env.txt
cat $W/env.txt
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/t30/gpu_attention_test; N=$C/t30/libattnd_kernels_c.so; B=$C/t29/libattnd_kernels_c.so
F='*_p2_*:*auto_*'
timeout 200 $T --gtest_filter='*hopper*' > $W/hopper_all.log 2>&1; echo "hopper suite rc=$? t=$SECONDS"; pass $W/hopper_all.log
ATTND_HOPPER_SPLIT_TAIL=2 ATTND_HOPPER_MAX_BLOCKS=3 timeout 150 $T --gtest_filter="$F" > $W/split3.log 2>&1
echo "split tail forced, 3 blocks rc=$? t=$SECONDS"; pass $W/split3.log
K=hopper_sm90_d128_m128n128s3_osk_p2
ATTND_TRACE_DUMP=$W/dump_c16k.csv timeout 60 $C/t30/hopper_trace --timeline $K 1 16384 16 1 $K 4 4096 16 1 \
  $K 1 16384 16 0 > $W/tl.txt 2>&1
echo "timeline rc=$? t=$SECONDS"; grep -E '^==|block ends' $W/tl.txt
cols=(auto base:auto cudnn)
for i in 1 2 3 4 5 6; do
  [ $SECONDS -gt 400 ] && break
  o=$(for j in 0 1 2; do echo -n "${cols[$(((i - 1 + j) % 3))]},"; done); o=${o%,}
  [ $i -gt 3 ] && o=$(echo $o | tr ',' '\n' | tac | paste -sd,)
  PYTHONUNBUFFERED=1 timeout 110 python3 kernels/bench/hopper_bench.py --lib $N --base_lib $B --configs auto,base:auto \
    --peers cudnn --rep 100 --settle_ms 500 --order $o --head_dims 128 --causal both \
    --seqs 1024,2048,4096,8192,16384 --json $W/ab_$i.json > $W/ab_$i.txt 2>&1
  echo "ab $i ($o) rc=$? t=$SECONDS"
done
for i in 1 2 3 4; do
  [ $SECONDS -gt 480 ] && break
  o=auto,base:auto,cudnn; [ $((i % 2)) = 0 ] && o=cudnn,base:auto,auto
  PYTHONUNBUFFERED=1 timeout 30 python3 kernels/bench/hopper_bench.py --lib $N --base_lib $B --configs auto,base:auto \
    --peers cudnn --rep 100 --settle_ms 500 --order $o --no-gqa --head_dims 64 --causal no --seqs 1024 \
    --json $W/ab_d64_$i.json > $W/ab_d64_$i.txt 2>&1
  echo "ab d64 $i ($o) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref base:auto $W/ab_*.json > $W/ab_summary_base.txt
python3 kernels/bench/summarize_runs.py --ref cudnn $W/ab_*.json > $W/ab_summary_cudnn.txt
echo "== over main"; grep -E '^\(|/ base:auto' $W/ab_summary_base.txt | cut -c1-200
echo "== over cudnn"; grep -E '^\(|/ cudnn' $W/ab_summary_cudnn.txt | cut -c1-200

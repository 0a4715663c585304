#!/usr/bin/env bash
# v46, call 1 (session 27's call 5): softmax turns (`_sx`) on d64 s6 `_p2`: the two consumer warpgroups take turns at
# their softmax as well as at their GEMMs, so that their exponentials do not meet on the MUFU pipe (call 4: the
# consumers' warps wait mostly at MUFU.EX2 while the pipe is ~40% busy). Checks, then auto / s6 `_p2` / `_sx` / cuDNN.
# Carry: .carry-hopper/sx.tar.xz (sx/: main at 26ecf52 with ../softmax_turns.diff, Release), lib/.
set -u
C=.carry-hopper; W=/tmp/v46c1; mkdir -p $W
trap 'tar czf $OUT/v46c1.tgz -C /tmp v46c1' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
tar xJf $C/sx.tar.xz -C $C || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > $W/env.txt; cat $W/env.txt
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/sx/gpu_attention_test; N=$C/sx/libattnd_kernels_c.so; P=hopper_sm90_d64_m128n128s6_p2
timeout 60 $T --gtest_filter="*${P}_sx_*" > $W/sx.log 2>&1; echo "sx suite rc=$? t=$SECONDS"; pass $W/sx.log
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 60 $T --gtest_filter="*${P}_sx_*" > $W/sx_dyn3.log 2>&1
echo "sx dynamic forced, 3 blocks rc=$? t=$SECONDS"; pass $W/sx_dyn3.log
cols=(auto $P ${P}_sx cudnn)
for i in 1 2 3 4; do
  [ $SECONDS -gt 150 ] && break
  o=$(for j in 0 1 2 3; do echo -n "${cols[$(((i - 1 + j) % 4))]},"; done); o=${o%,}
  PYTHONUNBUFFERED=1 timeout 60 python3 kernels/bench/hopper_bench.py --lib $N --configs auto,$P,${P}_sx \
    --peers cudnn --rep 100 --settle_ms 500 --order $o --no-gqa --head_dims 64 --seqs 1024,2048,4096 \
    --json $W/ab_$i.json > $W/ab_$i.txt 2>&1
  echo "ab $i ($o) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref $P $W/ab_*.json > $W/ab_summary_p2.txt
python3 kernels/bench/summarize_runs.py --ref cudnn $W/ab_*.json > $W/ab_summary_cudnn.txt
grep -E '^\(|_sx / '$P $W/ab_summary_p2.txt | cut -c1-200
grep -E '^\(|_sx / cudnn|auto / cudnn' $W/ab_summary_cudnn.txt | cut -c1-160

#!/usr/bin/env bash
# v47, call 2 (session 28's call 2): `_wr` as in call 1 (now outside Run, the other kernels byte-identical to main's)
# and `_wrs` (causal tiles start up to two warpgroups early, so the rows past a multiple of 192 fill the first tile).
# Checks of both (full grid, dynamic forced on 3 blocks, static on 5, synccheck / racecheck / memcheck on `_wrs`), then
# auto / `_wr` / `_wrs` / cuDNN, the columns rotated, d64 causal 1k-16k.
# Carry: .carry-hopper/wr2.tar.xz (wr2/: the v47 commit's kernels, auto unchanged (plan.cc as main at a921037); Release),
# lib/.
set -u
C=.carry-hopper; W=/tmp/v47c2; mkdir -p $W
trap 'tar czf $OUT/v47c2.tgz -C /tmp v47c2' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
tar xJf $C/wr2.tar.xz -C $C || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > $W/env.txt; cat $W/env.txt
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/wr2/gpu_attention_test; N=$C/wr2/libattnd_kernels_c.so; M=hopper_sm90_d64_m192n128s4
F="*${M}_wr_*:*${M}_wrs_*"
timeout 60 $T --gtest_filter="$F" > $W/suite.log 2>&1; echo "suite rc=$? t=$SECONDS"; pass $W/suite.log
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 60 $T --gtest_filter="$F" > $W/dyn3.log 2>&1
echo "dynamic forced, 3 blocks rc=$? t=$SECONDS"; pass $W/dyn3.log
ATTND_HOPPER_SCHEDULE=static ATTND_HOPPER_MAX_BLOCKS=5 timeout 60 $T --gtest_filter="$F" > $W/st5.log 2>&1
echo "static, 5 blocks rc=$? t=$SECONDS"; pass $W/st5.log
S="*${M}_wrs_d64_sq1000_tl*:*${M}_wrs_d64_q1000kv65_br*:*${M}_wrs_d64_sq17_tl*:*${M}_wrs_d64_q63kv4097_br*"
for tool in synccheck racecheck memcheck; do
  ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 90 compute-sanitizer --tool $tool --error-exitcode 9 $T \
    --gtest_filter="$S" > $W/san_$tool.log 2>&1
  echo "$tool rc=$? t=$SECONDS"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done
cols=(auto ${M}_wr ${M}_wrs cudnn)
for i in 1 2 3 4 5 6 7 8; do
  [ $SECONDS -gt 400 ] && break
  o=$(for j in 0 1 2 3; do echo -n "${cols[$(((i - 1 + j) % 4))]},"; done); o=${o%,}
  PYTHONUNBUFFERED=1 timeout 100 python3 kernels/bench/hopper_bench.py --lib $N --configs auto,${M}_wr,${M}_wrs \
    --peers cudnn --rep 100 --settle_ms 500 --order $o --no-gqa --head_dims 64 --causal yes \
    --seqs 1024,2048,4096,8192,16384 --json $W/ab_$i.json > $W/ab_$i.txt 2>&1
  echo "ab $i ($o) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref auto $W/ab_*.json > $W/ab_summary_auto.txt
python3 kernels/bench/summarize_runs.py --ref ${M}_wr $W/ab_*.json > $W/ab_summary_wr.txt
python3 kernels/bench/summarize_runs.py --ref cudnn $W/ab_*.json > $W/ab_summary_cudnn.txt
echo "== over auto"; grep -E '/ auto' $W/ab_summary_auto.txt | cut -c1-200
echo "== wrs over wr"; grep -E '_wrs / ' $W/ab_summary_wr.txt | cut -c1-200
echo "== over cudnn"; grep -E '^\(|/ cudnn' $W/ab_summary_cudnn.txt | cut -c1-180

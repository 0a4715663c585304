#!/usr/bin/env bash
# v47, call 1 (session 28's call 1): d64 m192 with per-warpgroup key ranges (`_wr`): each consumer warpgroup visits
# only the key blocks its own 64 rows see (empty turns for the rest), none when its rows lie past q_len. Checks (the
# entry's suite on the full grid, dynamic forced on 3 blocks, static on 5, synccheck / racecheck / memcheck), then
# auto / m192 / m192 `_wr` / cuDNN, the columns rotated, d64, 1k-8k, causal and not.
# Carry: .carry-hopper/wr.tar.xz (wr/: main at a921037 with an earlier form of v47: the skip inside ConsumerSm90::Run, no
# shifted tiles; Release), lib/.
set -u
C=.carry-hopper; W=/tmp/v47c1; mkdir -p $W
trap 'tar czf $OUT/v47c1.tgz -C /tmp v47c1' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
tar xJf $C/wr.tar.xz -C $C || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > $W/env.txt; cat $W/env.txt
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/wr/gpu_attention_test; N=$C/wr/libattnd_kernels_c.so; M=hopper_sm90_d64_m192n128s4
timeout 60 $T --gtest_filter="*${M}_wr_*" > $W/wr.log 2>&1; echo "wr suite rc=$? t=$SECONDS"; pass $W/wr.log
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 60 $T --gtest_filter="*${M}_wr_*" > $W/wr_dyn3.log 2>&1
echo "wr dynamic forced, 3 blocks rc=$? t=$SECONDS"; pass $W/wr_dyn3.log
ATTND_HOPPER_SCHEDULE=static ATTND_HOPPER_MAX_BLOCKS=5 timeout 60 $T --gtest_filter="*${M}_wr_*" > $W/wr_st5.log 2>&1
echo "wr static, 5 blocks rc=$? t=$SECONDS"; pass $W/wr_st5.log
S="*${M}_wr_d64_sq1000_tl*:*${M}_wr_d64_q1000kv65_br*:*${M}_wr_d64_sq1000_none*"
for tool in synccheck racecheck memcheck; do
  ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 90 compute-sanitizer --tool $tool --error-exitcode 9 $T \
    --gtest_filter="$S" > $W/san_$tool.log 2>&1
  echo "$tool rc=$? t=$SECONDS"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done
cols=(auto $M ${M}_wr cudnn)
for i in 1 2 3 4 5 6 7 8; do
  [ $SECONDS -gt 420 ] && break
  o=$(for j in 0 1 2 3; do echo -n "${cols[$(((i - 1 + j) % 4))]},"; done); o=${o%,}
  PYTHONUNBUFFERED=1 timeout 100 python3 kernels/bench/hopper_bench.py --lib $N --configs auto,$M,${M}_wr \
    --peers cudnn --rep 100 --settle_ms 500 --order $o --no-gqa --head_dims 64 --seqs 1024,2048,4096,8192 \
    --json $W/ab_$i.json > $W/ab_$i.txt 2>&1
  echo "ab $i ($o) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref auto $W/ab_*.json > $W/ab_summary_auto.txt
python3 kernels/bench/summarize_runs.py --ref $M $W/ab_*.json > $W/ab_summary_m192.txt
python3 kernels/bench/summarize_runs.py --ref cudnn $W/ab_*.json > $W/ab_summary_cudnn.txt
echo "== over auto"; grep -E '^\(|_wr / auto' $W/ab_summary_auto.txt | cut -c1-200
echo "== over m192"; grep -E '^\(|_wr / '$M $W/ab_summary_m192.txt | cut -c1-200
echo "== over cudnn"; grep -E '^\(|/ cudnn' $W/ab_summary_cudnn.txt | cut -c1-160

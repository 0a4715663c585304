#!/usr/bin/env bash
# v44, call 1 (session 27's call 2): 64-key blocks at d64 (`m128n64s8_p2`, `m128n64s12_p2`), for the tile change's
# exposed parts (the first block's S and softmax, the last P V alone), which halve with the block. Checks (the new
# entries' suite, the dynamic order forced on 3 blocks, memcheck), then base:auto (main's library) / auto (this one:
# the same kernels) / s6 `_p2` / n64 s8 / n64 s12 / cuDNN, rotated, d64 1k-4k.
# Carry: .carry-hopper/n64.tar.xz (n64/), .carry-hopper/s26c3.tar.xz (v41f/ = main's library), lib/.
# n64/: main at 367ae19 with ../n64.diff applied, Release build.
set -u
C=.carry-hopper; W=/tmp/v44c1; mkdir -p $W
trap 'tar czf $OUT/v44c1.tgz -C /tmp v44c1' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
tar xJf $C/n64.tar.xz -C $C && tar xJf $C/s26c3.tar.xz -C $C || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > $W/env.txt; cat $W/env.txt
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/n64/gpu_attention_test; N=$C/n64/libattnd_kernels_c.so; B=$C/v41f/libattnd_kernels_c.so
P=hopper_sm90_d64_m128n128s6_p2; N8=hopper_sm90_d64_m128n64s8_p2; N12=hopper_sm90_d64_m128n64s12_p2
timeout 120 $T --gtest_filter='*m128n64s*' > $W/n64.log 2>&1; echo "n64 suite rc=$? t=$SECONDS"; pass $W/n64.log
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 90 $T --gtest_filter='*m128n64s*' > $W/n64_dyn3.log 2>&1
echo "n64, dynamic forced, 3 blocks rc=$? t=$SECONDS"; pass $W/n64_dyn3.log
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 90 compute-sanitizer --tool memcheck --error-exitcode 9 $T \
  --gtest_filter="*${N8}_d64_sq1000_tl*:*${N8}_d64_q1000kv65_br*" > $W/san_memcheck.log 2>&1
echo "memcheck rc=$?"; grep -E 'ERROR SUMMARY' $W/san_memcheck.log | tail -1; pass $W/san_memcheck.log
A=base:auto
cols=($A auto $P $N8 $N12 cudnn)
for i in 1 2 3 4 5 6; do
  [ $SECONDS -gt 400 ] && break
  o=$(for j in 0 1 2 3 4 5; do echo -n "${cols[$(((i - 1 + j) % 6))]},"; done); o=${o%,}
  PYTHONUNBUFFERED=1 timeout 80 python3 kernels/bench/hopper_bench.py --lib $N --base_lib $B --configs $A,auto,$P,$N8,$N12 \
    --peers cudnn --rep 100 --settle_ms 500 --order $o --no-gqa --head_dims 64 --seqs 1024,2048,4096 \
    --json $W/ab_$i.json > $W/ab_$i.txt 2>&1
  echo "ab $i ($o) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref $P $W/ab_*.json > $W/ab_summary_p2.txt
python3 kernels/bench/summarize_runs.py --ref cudnn $W/ab_*.json > $W/ab_summary_cudnn.txt
echo "== over s6 _p2"; grep -E '^\(|/ '$P $W/ab_summary_p2.txt | cut -c1-200
echo "== over cudnn"; grep -E '^\(|/ cudnn' $W/ab_summary_cudnn.txt | cut -c1-160

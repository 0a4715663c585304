#!/usr/bin/env bash
# v45, call 1 (session 27's call 3): where the overlapped step takes and passes its turn. `_vw`: the previous block's V
# is waited for before the turn is taken (the wait leaves the turn); `_pt`: the turn is passed once S is issued, the
# previous block's P V is issued outside it (the other warpgroup's S may enter the tensor pipe before this P V).
# d64 s6 `_p2` and d128 s3 `_osk_p2`. Checks (the new entries' suite, dynamic forced on 3 blocks, synccheck /
# racecheck), then auto / s6 `_p2` / its `_vw`, `_pt` / d128 `_vw`, `_pt` / cuDNN, rotated, d64 and d128, 1k-4k.
# Carry: .carry-hopper/tv.tar.xz (tv/), lib/.
# tv/: main at 367ae19 with ../turn_variants.diff applied, Release build.
set -u
C=.carry-hopper; W=/tmp/v45c1; mkdir -p $W
trap 'tar czf $OUT/v45c1.tgz -C /tmp v45c1' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
tar xJf $C/tv.tar.xz -C $C || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > $W/env.txt; cat $W/env.txt
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/tv/gpu_attention_test; N=$C/tv/libattnd_kernels_c.so
P=hopper_sm90_d64_m128n128s6_p2; D=hopper_sm90_d128_m128n128s3_osk_p2
timeout 150 $T --gtest_filter='*_vw_*:*_pt_*' > $W/tv.log 2>&1; echo "tv suite rc=$? t=$SECONDS"; pass $W/tv.log
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 90 $T --gtest_filter="*${P}_vw_*:*${P}_pt_*" > $W/tv_dyn3.log 2>&1
echo "d64 tv, dynamic forced, 3 blocks rc=$? t=$SECONDS"; pass $W/tv_dyn3.log
S="*${P}_pt_d64_sq1000_tl*:*${D}_pt_d128_sq1000_tl*:*${P}_vw_d64_sq1000_tl*"
for tool in synccheck racecheck; do
  ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 90 compute-sanitizer --tool $tool --error-exitcode 9 $T \
    --gtest_filter="$S" > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done
cols=(auto $P ${P}_vw ${P}_pt ${D}_vw ${D}_pt cudnn)
for i in 1 2 3 4 5 6 7; do
  [ $SECONDS -gt 430 ] && break
  o=$(for j in 0 1 2 3 4 5 6; do echo -n "${cols[$(((i - 1 + j) % 7))]},"; done); o=${o%,}
  PYTHONUNBUFFERED=1 timeout 100 python3 kernels/bench/hopper_bench.py --lib $N --configs auto,$P,${P}_vw,${P}_pt,${D}_vw,${D}_pt \
    --peers cudnn --rep 100 --settle_ms 500 --order $o --no-gqa --head_dims 64,128 --seqs 1024,2048,4096 \
    --json $W/ab_$i.json > $W/ab_$i.txt 2>&1
  echo "ab $i ($o) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref auto $W/ab_*.json > $W/ab_summary.txt
python3 kernels/bench/summarize_runs.py --ref $P $W/ab_*.json > $W/ab_summary_p2.txt
python3 kernels/bench/summarize_runs.py --ref cudnn $W/ab_*.json > $W/ab_summary_cudnn.txt
echo "== over auto"; grep -E '^\(|_vw / auto|_pt / auto' $W/ab_summary.txt | cut -c1-200
echo "== over s6 _p2"; grep -E '^\(|/ '$P $W/ab_summary_p2.txt | grep -E '^\(|_vw|_pt' | cut -c1-200
echo "== over cudnn"; grep -E '^\(|/ cudnn' $W/ab_summary_cudnn.txt | cut -c1-160

#!/usr/bin/env bash
# v15 calls 1, 4, 6 and 8 (session 14; written in session 13 as call1.sh), each on that call's build of the patch;
# call 8's is kv2.diff as committed. First `git apply docs/hopper-runs/v15/kv2.diff` and build .carry-hopper as for
# v14 (build-kernels: attnd_kernels_c, gpu_attention_test). Results of call 8: call8_*.
# hopper_sm90_d128_m128n128s3_osk_kv2: s3 _osk whose problems without a mask run as clusters of two blocks sharing
# K/V through TMA multicast (kClusterPairs). A smoke case first (a cluster deadlock costs 30 s, not the call), the
# kv2 cases on the full grid and on 2, 4 and 5 blocks (1, 2 and 2 clusters: blocks run several pair tiles, and odd
# q-tile counts leave a past-the-end tile on rank 1), the sanitizers on small non-causal and causal kv2 cases, then
# four bench processes of s3 _osk against kv2 without a mask (1k-8k, GQA too) beside cuDNN, the order rotated.
set -u
C=.carry-hopper; W=/tmp/v15c1; mkdir -p $W
export LD_LIBRARY_PATH=$PWD/$C/lib
T=$C/gpu_attention_test
K=hopper_sm90_d128_m128n128s3_osk_kv2
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -6; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > $W/env.txt
timeout 30 $T --gtest_filter="*${K}_d128_bhsd_none*" > $W/smoke.log 2>&1
rc=$?; echo "smoke rc=$rc"; tail -2 $W/smoke.log
[ $rc = 0 ] || { tar czf $OUT/v15call1.tgz -C /tmp v15c1; exit 1; }
timeout 150 $T --gtest_filter="*_kv2_*" > $W/suite.log 2>&1
echo "suite rc=$?"; pass $W/suite.log
for nb in 2 4 5; do
  ATTND_HOPPER_MAX_BLOCKS=$nb timeout 90 $T --gtest_filter="*_kv2_*" > $W/blocks$nb.log 2>&1
  echo "$nb blocks rc=$?"; pass $W/blocks$nb.log
done
for tool in memcheck racecheck synccheck; do
  f="*${K}_d128_sq129_none*:*${K}_d128_b2_gqa8to2_none*:*${K}_d128_sq129_tl*"
  [ $tool = racecheck ] && f="*${K}_d128_sq129_none*"
  ATTND_HOPPER_MAX_BLOCKS=4 ATTND_GPU_TEST_SMALL=1 timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 $T \
    --gtest_filter="$f" > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done
L=$C/new/libattnd_kernels_c.so
a=hopper_sm90_d128_m128n128s3_osk; b=$K
for i in 1 2 3 4; do
  cfg=$a,$b; [ $((i % 2)) = 0 ] && cfg=$b,$a
  PYTHONUNBUFFERED=1 timeout 90 python3 kernels/bench/hopper_bench.py --lib $L --configs $cfg --peers cudnn --rep 30 \
    --head_dims 128 --causal no --seqs 1024,2048,4096,8192 --json $W/nc_$i.json > $W/nc_$i.txt 2>&1
  echo "bench $i rc=$?"
done
python3 kernels/bench/summarize_runs.py --ref $a $W/nc_*.json | tee $W/nc_summary.txt
tar czf $OUT/v15call1.tgz -C /tmp v15c1

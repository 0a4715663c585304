#!/usr/bin/env bash
# v33 call 6: call 5's library (uniform_wg.diff) under the sanitizers on the auto kernels (3 blocks; d64 with the
# dynamic order), then the 1k and 16k rows of d64 / d128 in three processes with attnd, cuDNN and FA2 rotated
# through every position (as the whole table's method). Carry .carry-hopper: t46, v46/.
set -u
C=.carry-hopper; W=/tmp/v33c6; mkdir -p $W
trap 'tar czf $OUT/v33c6.tgz -C /tmp v33c6' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
T=$C/t46; N=$C/v46/libattnd_kernels_c.so
S='*/auto_d64_sq1000_tl*:*/auto_d64_q1000kv65_br*:*/auto_d128_fp16_b2_long_tl*:*/auto_d128_q65kv63_none*'
S="$S:*/auto_d256_sq129_br*:*/auto_d256_b2_gqa8to2_none*"
for tool in memcheck synccheck racecheck; do
  ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 90 compute-sanitizer --tool $tool \
    --error-exitcode 9 $T --gtest_filter="$S" > $W/san_$tool.log 2>&1
  echo "$tool rc=$? t=$SECONDS"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1
  grep -hE '^\[  (PASSED|FAILED) ' $W/san_$tool.log
done
orders=(auto,cudnn,fa2 cudnn,fa2,auto fa2,auto,cudnn)
for i in 1 2 3; do
  [ $SECONDS -gt 250 ] && break
  PYTHONUNBUFFERED=1 timeout 80 python3 kernels/bench/hopper_bench.py --lib $N --configs auto --peers cudnn,fa2 \
    --rep 100 --settle_ms 500 --order ${orders[$((i - 1))]} --no-gqa --head_dims 64,128 --seqs 1024,16384 \
    --json $W/rows_$i.json > $W/rows_$i.txt 2>&1
  echo "rows $i (${orders[$((i - 1))]}) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref cudnn $W/rows_*.json > $W/rows_summary.txt
grep -E '^\(|auto / cudnn' $W/rows_summary.txt | cut -c1-200

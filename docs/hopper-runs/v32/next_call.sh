#!/usr/bin/env bash
# v32, prepared for the next session (not run): `hopper_sm90_d64_m128n128s6_p2_fe` (a tile's first S and last P V
# without turns, no lag) against auto on the d64 rows, causal ones included (call 2 timed only non-causal rows before
# `_fe_l1` hung). Build: main + docs/hopper-runs/v32/lag_free_edges.diff; carry its gpu_attention_test as t42 and
# library in v42/, with lib/ (the abseil .so files). `_fe_l1` and `_l1` must not be timed: both deadlock (notes, v32).
set -u
C=.carry-hopper; W=/tmp/v32n; mkdir -p $W
trap 'tar czf $OUT/v32n.tgz -C /tmp v32n' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/t42; N=$C/v42/libattnd_kernels_c.so; FE=hopper_sm90_d64_m128n128s6_p2_fe
timeout 60 $T --gtest_filter='*m128n128s6_p2_fe_d64*' > $W/suite.log 2>&1; echo "suite rc=$?"; pass $W/suite.log
for i in 1 2 3 4 5 6; do
  [ $SECONDS -gt 420 ] && break
  if [ $((i % 2)) = 1 ]; then o=auto,$FE; else o=$FE,auto; fi
  PYTHONUNBUFFERED=1 timeout 100 python3 kernels/bench/hopper_bench.py --lib $N --configs $o --peers cudnn --rep 100 \
    --settle_ms 500 --peers_last --no-gqa --head_dims 64 --seqs 1024,2048,4096 --json $W/ab_$i.json > $W/ab_$i.txt 2>&1
  echo "ab $i rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref auto $W/ab_*.json > $W/ab_summary.txt
grep -E '^\(| / auto' $W/ab_summary.txt | cut -c1-220

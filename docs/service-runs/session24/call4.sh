#!/usr/bin/env bash
# Session 24, call 4: call 3's NoRequestInFlightAfterItsReply never failed on the old order (10 x 100 calls, idle
# CPUs); the test now keeps 2 busy threads per core spinning during 200 calls. Old order (fwd_old) against new
# (fwd_new), alternating, 5 repeats each, then the whole forward suite once more on the new binary.
set -u
W=/tmp/s24c4; mkdir -p $W
trap 'tar czf $OUT/s24c4.tgz -C /tmp s24c4' EXIT
for v in old new; do xz -dc .carry-cuda/fwd_$v.xz > /tmp/fwd_$v && chmod +x /tmp/fwd_$v; done
for r in 1 2; do
  for v in old new; do
    timeout 90 /tmp/fwd_$v --gtest_filter='*NoRequestInFlightAfterItsReply' --gtest_repeat=5 > $W/inflight_${v}_$r.log 2>&1
    echo "$v order, round $r, 5 repeats: rc=$? passed $(grep -c '^\[       OK \]' $W/inflight_${v}_$r.log)" \
         "failed $(grep -c '^\[  FAILED  \] GpuServerTest' $W/inflight_${v}_$r.log) t=$SECONDS"
    grep 'found still in flight' $W/inflight_${v}_$r.log | head -5
  done
done
timeout 150 /tmp/fwd_new > $W/forward_new.log 2>&1
echo "forward suite (new) rc=$? t=$SECONDS"; grep -E '^\[  (PASSED|FAILED) ' $W/forward_new.log

#!/usr/bin/env bash
# Session 24, call 3: the CUDA backend counts a request finished before its reply goes out (as the CPU backend since
# 757cf8c). The GPU server suites on the new binaries (with the new GpuServerTest.NoRequestInFlightAfterItsReply),
# that test repeated on the new binary and on one built with the old order (.carry-cuda/fwd_old.xz: can it fail?),
# then the README's quickstart over the prebuilt binaries. .carry-cuda from server/cuda/tools/pack_carry.sh (bs).
set -u
W=/tmp/s24c3; mkdir -p $W
trap 'tar czf $OUT/s24c3.tgz -C /tmp s24c3' EXIT
OUT=$W/tests SKIP_IPC=1 SKIP_SHM=1 SKIP_INLINE=1 INLINE_SEQS="" PORT=50800 timeout 300 bash server/cuda/tools/device_run.sh \
  > $W/tests_run.txt 2>&1
echo "suites rc=$? t=$SECONDS"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |=== .* rc=|^FAIL" $W/tests/tests.log
xz -dc .carry-cuda/fwd_old.xz > /tmp/fwd_old && chmod +x /tmp/fwd_old
for v in new old; do
  b=/tmp/bins/gpu_server_forward_test; [ $v = old ] && b=/tmp/fwd_old
  timeout 60 $b --gtest_filter='*NoRequestInFlightAfterItsReply' --gtest_repeat=10 > $W/inflight_$v.log 2>&1
  echo "in flight after reply, $v order, 10 repeats: rc=$? passed $(grep -c '^\[       OK \]' $W/inflight_$v.log)" \
       "failed $(grep -c '^\[  FAILED  \] GpuServerTest' $W/inflight_$v.log) t=$SECONDS"
  grep -m3 'still counted' -B2 $W/inflight_$v.log | head -6
done
ATTND_BIN_DIR=/tmp/bins timeout 120 bash scripts/quickstart.sh > $W/quickstart.log 2>&1
echo "quickstart rc=$? t=$SECONDS"; grep -E 'backend|PASS|FAIL|ok|exit' $W/quickstart.log | head -12

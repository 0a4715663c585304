#!/usr/bin/env bash
# Session 9 call 3: shm polls of 1 ms on both sides (server --shm_reply_spin_us, caller ShmChannelOptions::spin) and
# the IPC event trim, against session 8's binaries: three rounds alternating new / old, IPC over shm at 1k and 4k;
# then the GPU server suites on the new binaries.
set -u
W=/tmp/s9c3; mkdir -p $W
n=0
for round in 1 2 3; do
  for v in new old; do
    n=$((n+1)); d=$W/shm_${v}_$round; mkdir -p $d
    bins=.carry-cuda/bins.tar.xz; [ $v = old ] && bins=.carry-cuda/bins_s8.tar.xz
    OUT=$d BINS=$bins SKIP_TESTS=1 SKIP_IPC=1 SKIP_INLINE=1 INLINE_SEQS="" DUR=3s PORT=$((50210+n)) \
      timeout 120 bash server/cuda/tools/device_run.sh > $d/run.txt 2>&1
    echo "shm $v $round rc=$?"; grep -E "^csv,ipc_shm" $d/bench.txt | cut -d, -f2-8,10,12,13,16-18,21,22
  done
done
OUT=$W/tests SKIP_IPC=1 SKIP_SHM=1 SKIP_INLINE=1 INLINE_SEQS="" PORT=50300 timeout 330 bash server/cuda/tools/device_run.sh > $W/tests_run.txt 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |=== .* rc=|^FAIL" $W/tests/tests.log
tar czf $OUT/s9call3.tgz -C /tmp s9c3

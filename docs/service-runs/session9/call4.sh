#!/usr/bin/env bash
# Session 9 call 4: the caller polls 1.5x its previous call (100 us..1 ms), the server 300 us (--shm_reply_spin_us), and
# the IPC event trim, against session 8's binaries: three rounds alternating new / old, IPC over shm at 1k and 4k;
# then the GPU server suites on the new binaries.
set -u
W=/tmp/s9c4; mkdir -p $W
n=0
for round in 1 2 3; do
  for v in new old; do
    n=$((n+1)); d=$W/shm_${v}_$round; mkdir -p $d
    bins=.carry-cuda/bins.tar.xz; [ $v = old ] && bins=.carry-cuda/bins_s8.tar.xz
    OUT=$d BINS=$bins SKIP_TESTS=1 SKIP_IPC=1 SKIP_INLINE=1 INLINE_SEQS="" DUR=3s PORT=$((50410+n)) \
      timeout 120 bash server/cuda/tools/device_run.sh > $d/run.txt 2>&1
    echo "shm $v $round rc=$?"; grep -E "^csv,ipc_shm" $d/bench.txt | cut -d, -f2-8,10,12,13,16-18,21,22
  done
done
OUT=$W/tests SKIP_IPC=1 SKIP_SHM=1 SKIP_INLINE=1 INLINE_SEQS="" PORT=50500 timeout 330 bash server/cuda/tools/device_run.sh > $W/tests_run.txt 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |=== .* rc=|^FAIL" $W/tests/tests.log
tar czf $OUT/s9call4.tgz -C /tmp s9c3

#!/usr/bin/env bash
# Session 9 call 2: the service changes of this session (auto clients stream from the server's
# stream_preferred_from_bytes; the shm channel thread polls up to --shm_reply_spin_us for its reply; IPC requests
# record fewer events). GPU server suites; IPC over shm, new / new with the old 50 us reply poll / session 8's
# binaries, twice each; auto transport by size; the README quickstart's main job.
set -u
W=/tmp/s9c2; mkdir -p $W
OUT=$W/tests SKIP_IPC=1 SKIP_SHM=1 SKIP_INLINE=1 INLINE_SEQS="" PORT=50100 timeout 330 bash server/cuda/tools/device_run.sh > $W/tests_run.txt 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |=== .* rc=|^FAIL" $W/tests/tests.log
n=0
for round in 1 2; do
  for v in new spin50 old; do
    n=$((n+1)); d=$W/shm_${v}_$round; mkdir -p $d
    bins=.carry-cuda/bins.tar.xz; flags=""
    [ $v = old ] && bins=.carry-cuda/bins_s8.tar.xz
    [ $v = spin50 ] && flags="--shm_reply_spin_us=50"
    OUT=$d BINS=$bins SERVER_FLAGS="$flags" SKIP_TESTS=1 SKIP_IPC=1 SKIP_INLINE=1 INLINE_SEQS="" DUR=2s PORT=$((50110+n)) \
      timeout 120 bash server/cuda/tools/device_run.sh > $d/run.txt 2>&1
    echo "shm $v $round rc=$?"; grep -E "^csv,ipc_shm" $d/bench.txt | cut -d, -f2-6,10,12,13,16-18,21,22
  done
done
d=$W/auto; mkdir -p $d
OUT=$d SKIP_TESTS=1 SKIP_IPC=1 SKIP_SHM=1 TRANSPORTS=auto INLINE_SEQS="256 512 1024 4096" CALLERS=1 DUR=2s PORT=50130 \
  timeout 150 bash server/cuda/tools/device_run.sh > $d/run.txt 2>&1
echo "auto rc=$?"; grep -E "stream preferred|attn_bench|vs TCP|^  Forward" $d/bench.txt | cut -c1-180
mkdir -p /tmp/bins && tar xf .carry-cuda/bins.tar.xz -C /tmp/bins
ATTND_BIN_DIR=/tmp/bins timeout 150 bash scripts/quickstart.sh > $W/quickstart.log 2>&1; echo "quickstart rc=$?"
grep -E "backend:|verify:|reply:|req/s|error|transport" $W/quickstart.log | head -12
tar czf $OUT/s9call2.tgz -C /tmp s9c2

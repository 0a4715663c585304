#!/usr/bin/env bash
# Session 13 call 1: ForwardStream's reply chunks point into the backend's lent O (pinned staging) instead of
# copying each 1 MiB of it into a fresh slice. GPU server suites and the README quickstart's main job on the new
# binaries; then the stream at 1k and 4k, one caller, base (0f527be) and new servers in the order
# base new new base base new, one server each, each row with its TCP loopback baseline.
set -u
W=/tmp/s13c1; mkdir -p $W
OUT=$W/tests SKIP_IPC=1 SKIP_SHM=1 SKIP_INLINE=1 INLINE_SEQS="" PORT=50900 timeout 240 bash server/cuda/tools/device_run.sh > $W/tests_run.txt 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |=== .* rc=|^FAIL" $W/tests/tests.log
mkdir -p /tmp/qbins && tar xf .carry-cuda/bins.tar.xz -C /tmp/qbins
ATTND_BIN_DIR=/tmp/qbins timeout 120 bash scripts/quickstart.sh > $W/quickstart.log 2>&1; echo "quickstart rc=$?"
grep -E "backend:|kernel|verify|PASS|FAIL|requests:|errors" $W/quickstart.log | head -12
n=0
for v in base new new base base new; do
  n=$((n+1)); d=$W/stream_${n}_$v; mkdir -p $d
  bins=.carry-cuda/bins.tar.xz; [ $v = base ] && bins=.carry-cuda/bins_base.tar.xz
  OUT=$d BINS=$bins SKIP_TESTS=1 SKIP_IPC=1 SKIP_SHM=1 TRANSPORTS=stream INLINE_SEQS="1024 4096" CALLERS=1 DUR=3s \
    PORT=$((50910+n)) timeout 90 bash server/cuda/tools/device_run.sh > $d/run.txt 2>&1
  echo "stream $n $v rc=$?"
  grep -E '^127.0.0.1' $d/bench.txt | cut -d, -f4,6,30,33,35,36,37,38,39
  grep -E 'vs TCP' $d/bench.txt | sed -E 's/.*TCP p50 ([0-9.]+) ms.*per call at p50 \(([0-9.]+)x\).*/  TCP \1 ms, per call \2x/'
done
tar czf $OUT/s13call1.tgz -C /tmp s13c1

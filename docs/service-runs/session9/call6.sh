#!/usr/bin/env bash
# Session 9 call 6: a stream's O lent from the pinned block and copied straight into the reply's chunks (ForwardJob::
# o_loan) against 1cd129e's binaries (base): GPU server suites on the new binaries, then stream and unary at 1k and 4k,
# one caller, two rounds alternating new / base.
set -u
W=/tmp/s9c6; mkdir -p $W
OUT=$W/tests SKIP_IPC=1 SKIP_SHM=1 SKIP_INLINE=1 INLINE_SEQS="" PORT=50800 timeout 200 bash server/cuda/tools/device_run.sh > $W/tests_run.txt 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |=== .* rc=|^FAIL" $W/tests/tests.log
n=0
for round in 1 2; do
  for v in new base; do
    n=$((n+1)); d=$W/inline_${v}_$round; mkdir -p $d
    bins=.carry-cuda/bins.tar.xz; [ $v = base ] && bins=.carry-cuda/bins_base.tar.xz
    OUT=$d BINS=$bins SKIP_TESTS=1 SKIP_IPC=1 SKIP_SHM=1 INLINE_SEQS="1024 4096" CALLERS=1 DUR=3s PORT=$((50810+n)) \
      timeout 100 bash server/cuda/tools/device_run.sh > $d/run.txt 2>&1
    echo "inline $v $round rc=$?"
    grep -E '^127.0.0.1' $d/bench.txt | cut -d, -f4,6,30,33,35,36,37,38,39
    grep -E 'vs TCP' $d/bench.txt | sed -E 's/.*TCP p50 ([0-9.]+) ms.*per call at p50 \(([0-9.]+)x\).*/  TCP \1 ms, per call \2x/'
  done
done
tar czf $OUT/s9call6.tgz -C /tmp s9c6

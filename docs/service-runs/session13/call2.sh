#!/usr/bin/env bash
# Session 13 call 2: the client's stream chunk (attn bench --chunk_bytes) 1 MiB (default) against 256 KiB, on the
# new binaries of call 1, stream at 1k and 4k, one caller, in the order 1M 256K 256K 1M 1M 256K, one server each.
set -u
W=/tmp/s13c2; mkdir -p $W
n=0
for v in 1048576 262144 262144 1048576 1048576 262144; do
  n=$((n+1)); d=$W/stream_${n}_$v; mkdir -p $d
  OUT=$d CHUNK_BYTES=$v SKIP_TESTS=1 SKIP_IPC=1 SKIP_SHM=1 TRANSPORTS=stream INLINE_SEQS="1024 4096" CALLERS=1 DUR=3s \
    PORT=$((50920+n)) timeout 80 bash server/cuda/tools/device_run.sh > $d/run.txt 2>&1
  echo "stream $n chunk $v rc=$?"
  grep -E '^127.0.0.1' $d/bench.txt | awk -F, '{printf "  seq %s p50 %.2f p99 %.2f srv_total %.3f tcp %.2f ratio %.2f\n", $6, $30/1000, $33/1000, $39/1000, $41/1000, $41/$30}'
done
tar czf $OUT/s13call2.tgz -C /tmp s13c2

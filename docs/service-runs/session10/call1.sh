#!/usr/bin/env bash
# Session 10 call 1: the client writes O into memory the caller keeps (CallOptions::outputs; attn bench
# --reuse_outputs, on by default). GPU server suites and the README quickstart's main job on the new binaries; then
# stream and unary at 1k and 4k, one caller, with outputs reused / fresh per call (the old behaviour) / reused with
# gRPC's HTTP/2 write buffer at 8 MiB on both sides, two rounds, one server each.
set -u
W=/tmp/s10c1; mkdir -p $W
body() {
  OUT=$W/tests SKIP_IPC=1 SKIP_SHM=1 SKIP_INLINE=1 INLINE_SEQS="" PORT=50900 timeout 200 bash server/cuda/tools/device_run.sh > $W/tests_run.txt 2>&1
  echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |=== .* rc=|^FAIL" $W/tests/tests.log
  mkdir -p /tmp/bins && tar xf .carry-cuda/bins.tar.xz -C /tmp/bins
  ATTND_BIN_DIR=/tmp/bins timeout 120 bash scripts/quickstart.sh > $W/quickstart.log 2>&1; echo "quickstart rc=$?"
  grep -E "backend:|verify:|PASS|FAIL|req/s|errors|transport" $W/quickstart.log | head -12
  n=0
  for round in 1 2; do
    for v in reuse fresh wbuf; do
      n=$((n+1)); d=$W/inline_${v}_$round; mkdir -p $d
      cf=""; ga=""
      [ $v = fresh ] && cf="--reuse_outputs=false"
      [ $v = wbuf ] && ga="grpc.http2.write_buffer_size=8388608"
      OUT=$d CLIENT_FLAGS="$cf" SERVER_GRPC_ARGS="$ga" CLIENT_GRPC_ARGS="$ga" SKIP_TESTS=1 SKIP_IPC=1 SKIP_SHM=1 \
        INLINE_SEQS="1024 4096" CALLERS=1 DUR=3s PORT=$((50910+n)) timeout 90 bash server/cuda/tools/device_run.sh > $d/run.txt 2>&1
      echo "inline $v $round rc=$?"
      grep -E '^127.0.0.1' $d/bench.txt | cut -d, -f4,6,30,33,35,36,37,38,39
      grep -E 'vs TCP' $d/bench.txt | sed -E 's/.*TCP p50 ([0-9.]+) ms.*per call at p50 \(([0-9.]+)x\).*/  TCP \1 ms, per call \2x/'
    done
  done
}
export -f body 2>/dev/null
body
tar czf $OUT/s10call1.tgz -C /tmp s10c1

#!/usr/bin/env bash
# One device session of the CUDA backend (issue 4): the GPU tests, then the service measurements of
# docs/benchmarks.md ("Service"). Runs on the GPU host from the repo root, over binaries built statically
# here and carried as .carry-cuda/bins.tar.xz (see server/cuda/tools/pack_carry.sh). Writes under $OUT:
# env.txt, tests.log, attnd.log, bench.txt (all measurements, CSV rows). SERVER_GRPC_ARGS / CLIENT_GRPC_ARGS
# (comma-separated name=value) go to --grpc_arg of attnd / attn, to compare transport settings. SKIP_TESTS,
# SKIP_IPC, SKIP_SHM (the IPC bench over the shared-memory channel), STREAMS, PORT, DUR, SERVER_FLAGS (more attnd
# flags), CONNECTIONS (attn bench --connections), INLINE_SEQS, TRANSPORTS (of unary, stream): further variants
# in one device call. CHUNK_BYTES: attn bench --chunk_bytes (stream chunk size);
# CALLERS: the concurrencies of the inline rows (default "1 16"). CLIENT_FLAGS: more `attn bench` flags
# (e.g. --reuse_outputs=false).
set -u
OUT=${OUT:-/tmp/attnd-out}
mkdir -p "$OUT" /tmp/bins
# BINS: another archive of the same binaries (an A/B against an older server); tar detects the compression.
tar xf "${BINS:-.carry-cuda/bins.tar.xz}" -C /tmp/bins
B=/tmp/bins
{
  date -u +"date %Y-%m-%dT%H:%M:%SZ"
  echo "commit $(cat .carry-cuda/commit 2>/dev/null)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  nvcc --version 2>/dev/null | tail -1
  nproc; uname -r
} > "$OUT/env.txt" 2>&1

# 1. Tests (each bounded, so the measurements always run).
export ATTND_IPC_PEER=$B/ipc_peer
# FORWARD_FILTER narrows the longest suite (a gtest filter) when device time is short.
# SKIP_TESTS=1: measurements only (a second configuration in the same device call).
for t in $([ -n "${SKIP_TESTS:-}" ] || echo gpu_server_parts_test gpu_server_forward_test gpu_server_ipc_test); do
  echo "=== $t" >> "$OUT/tests.log"
  f=""
  [ "$t" = gpu_server_forward_test ] && [ -n "${FORWARD_FILTER:-}" ] && f="--gtest_filter=$FORWARD_FILTER"
  timeout 100 "$B/$t" $f >> "$OUT/tests.log" 2>&1
  echo "=== $t rc=$?" >> "$OUT/tests.log"
done
[ -n "${SKIP_TESTS:-}" ] || grep -E "^\[  (PASSED|FAILED|SKIPPED) |=== .* rc=|^FAIL" "$OUT/tests.log"

# 2. Measurements: one server, warm shapes for the measured problems.
SOCK=/tmp/attnd_bench_${PORT:-50051}.sock
SHM=/tmp/attnd_shm_${PORT:-50051}.sock
"$B/attnd" --listen=127.0.0.1:${PORT:-50051} --unix_socket=$SOCK --shm_socket=$SHM --enable_cuda_ipc --streams=${STREAMS:-8} \
  --warm_shapes=1x1024x1024x32x32x128,1x4096x4096x32x32x128 --log_level=info \
  ${SERVER_GRPC_ARGS:+--grpc_arg=$SERVER_GRPC_ARGS} ${SERVER_FLAGS:-} > "$OUT/attnd.log" 2>&1 &
SERVER=$!
for i in $(seq 1 100); do
  "$B/attn" info --target=unix:$SOCK > /tmp/info.txt 2>&1 && break
  sleep 0.2
done
R="$OUT/bench.txt"
cat /tmp/info.txt > "$R"
DUR=${DUR:-2s}
[ -n "${SKIP_IPC:-}" ] || timeout 120 "$B/ipc_peer" bench --target=unix:$SOCK --seqs=1024,4096 --concurrency=1,16 --duration_s=${DUR%s} \
  --warmup_s=${WARM_S:-0.5} --verify_every=25 >> "$R" 2>&1
[ -n "${SKIP_SHM:-}" ] || timeout 120 "$B/ipc_peer" bench --target=unix:$SOCK --transport=shm --shm_socket=$SHM \
  --seqs=1024,4096 --concurrency=1,16 --duration_s=${DUR%s} --warmup_s=${WARM_S:-0.5} --verify_every=25 >> "$R" 2>&1
[ -n "${SKIP_INLINE:-}" ] || timeout 60 "$B/ipc_peer" tcp --seqs=1024,4096 --tcp_iters=20 >> "$R" 2>&1
for seq in ${INLINE_SEQS-1024 4096}; do
  for tr in ${TRANSPORTS:-unary stream}; do
    for c in ${CALLERS:-1 16}; do
      timeout 60 "$B/attn" bench --target=127.0.0.1:${PORT:-50051} --transport=$tr --q_len=$seq --q_heads=32 --head_dim=128 \
        --causal --concurrency=$c --duration=$DUR --warmup=0.5s --verify_every=5 --progress=false \
        --tcp_baseline --rpc_floor ${CLIENT_GRPC_ARGS:+--grpc_arg=$CLIENT_GRPC_ARGS} ${CONNECTIONS:+--connections=$CONNECTIONS} \
        ${CHUNK_BYTES:+--chunk_bytes=$CHUNK_BYTES} ${CLIENT_FLAGS:-} \
        --csv=/tmp/b.csv > /tmp/b.txt 2>&1
      echo "attn_bench,$tr,$seq,$c,rc=$?" >> "$R"
      cat /tmp/b.csv >> "$R" 2>/dev/null || cat /tmp/b.txt >> "$R"
      grep -E "verified|error|TCP loopback|RPC floor" /tmp/b.txt >> "$R"
    done
  done
done
"$B/attn" stats --target=unix:$SOCK >> "$R" 2>&1
kill -TERM $SERVER
wait $SERVER
echo "attnd exit rc=$?" >> "$R"
cat "$R"

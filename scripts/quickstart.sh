#!/usr/bin/env bash
# The README's main job on a fresh Debian/Ubuntu machine: install the dependencies, build (Release), start
# attnd on the best backend present, make one verified call and a short load test with the bundled `attn`
# client, print the reports, then stop the server with SIGTERM and check it exited cleanly.
# Exits non-zero on any failure. Environment: BUILD_DIR (default build-release), JOBS (default nproc),
# ATTND_BIN_DIR (use prebuilt attnd and attn from there; no install, no build).
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build-release}
JOBS=${JOBS:-$(nproc)}
step() { printf '\n== %s\n' "$*"; }

if [ -n "${ATTND_BIN_DIR:-}" ]; then
  # Prebuilt binaries (e.g. a static build copied to a GPU host that has no build tools): skip install+build.
  ATTND="$ATTND_BIN_DIR/attnd"
  ATTN="$ATTND_BIN_DIR/attn"
  [ -x "$ATTND" ] && [ -x "$ATTN" ] || { echo "quickstart: no attnd/attn in $ATTND_BIN_DIR" >&2; exit 1; }
else
  step "dependencies"
  bash scripts/install_deps.sh

  step "build ($BUILD_DIR, Release)"
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DATTND_BUILD_TESTS=OFF >/dev/null
  cmake --build "$BUILD_DIR" -j "$JOBS" --target attnd attn
  ATTND="$BUILD_DIR/server/attnd"
  ATTN="$BUILD_DIR/client/attn"
fi

work=$(mktemp -d)
server_pid=""
cleanup() {
  # Only reached with the server still up when something failed: stop it, keep its log visible.
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
    kill -TERM "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT
fail() {
  echo "quickstart: FAILED: $*" >&2
  if [ -f "$work/attnd.log" ]; then
    echo "--- attnd log (tail)" >&2
    tail -n 30 "$work/attnd.log" >&2
  fi
  exit 1
}

step "start attnd --backend=auto on a free loopback port"
"$ATTND" --backend=auto --listen=127.0.0.1:0 >"$work/attnd.log" 2>&1 &
server_pid=$!
# The server logs the port it bound; wait for it and for `attn info` to answer (bounded: 60 s).
target=""
info=""
for _ in $(seq 1 120); do
  kill -0 "$server_pid" 2>/dev/null || fail "attnd exited during startup"
  if [ -z "$target" ]; then
    port=$(grep -o 'port [0-9]*' "$work/attnd.log" | head -n1 | awk '{print $2}' || true)
    [ -n "$port" ] && target="127.0.0.1:$port"
  fi
  if [ -n "$target" ] && info=$("$ATTN" info --target="$target" --deadline_ms=2000 2>&1); then
    break
  fi
  info=""
  sleep 0.5
done
[ -n "$info" ] || fail "attnd did not answer 'attn info' within 60 s"
echo "$info"
backend=$(awk '/^  backend:/ {print $2}' <<<"$info")

# Shapes sized for the backend: the CPU reference backend must stay well under a second per request on a
# small machine; a GPU gets a realistic prefill shape (GQA 4:1, causal). --verify recomputes on the CPU in
# double precision, so the verified call stays moderate in both cases.
if [ "$backend" = "cuda" ]; then
  call_shape=(--batch=2 --q_len=1024 --kv_len=1024 --q_heads=16 --kv_heads=4 --head_dim=128 --causal --lse)
  bench_shape=(--batch=4 --q_len=4096 --kv_len=4096 --q_heads=32 --kv_heads=8 --head_dim=128 --causal)
  bench_load=(--concurrency=8 --duration=5s --warmup=2s --verify_every=0)
else
  call_shape=(--batch=1 --q_len=384 --kv_len=512 --q_heads=8 --kv_heads=2 --head_dim=128
              --mask=causal_bottom_right --lse)
  bench_shape=(--batch=1 --q_len=256 --kv_len=256 --q_heads=8 --kv_heads=2 --head_dim=128 --causal)
  bench_load=(--concurrency=2 --duration=3s --warmup=1s --verify_every=10)
fi

step "attn call --verify ($backend backend)"
"$ATTN" call --target="$target" "${call_shape[@]}" --verify || fail "attn call --verify"

step "attn bench ($backend backend)"
"$ATTN" bench --target="$target" "${bench_shape[@]}" "${bench_load[@]}" --max_duration=60s \
  --json="$work/bench.json" --csv="$work/bench.csv" || fail "attn bench"
echo "-- bench.json"
cat "$work/bench.json"
echo "-- bench.csv"
cat "$work/bench.csv"

step "attn stats"
"$ATTN" stats --target="$target" || fail "attn stats"

step "stop attnd (SIGTERM)"
kill -TERM "$server_pid"
rc=0
# Bounded: the server finishes accepted requests (none are left here) and exits.
for _ in $(seq 1 60); do
  kill -0 "$server_pid" 2>/dev/null || break
  sleep 0.5
done
if kill -0 "$server_pid" 2>/dev/null; then
  fail "attnd still running 30 s after SIGTERM"
fi
wait "$server_pid" || rc=$?
server_pid=""
[ "$rc" -eq 0 ] || fail "attnd exited with status $rc after SIGTERM"
tail -n 3 "$work/attnd.log"
echo
echo "quickstart: OK (backend $backend, server at $target exited 0)"

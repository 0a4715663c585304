#!/usr/bin/env bash
# Soak: starts a CPU-backend attnd on loopback, runs attnd_soak's mixed traffic against it for a given time
# (every RPC, verified answers, cancellations, deadlines, bad input; tests/soak/soak.cc says what and the leak
# rules), samples the server's RSS, descriptors and threads, then stops it with SIGTERM and checks a clean exit.
#
#   bash scripts/soak.sh                 # 10 minutes
#   bash scripts/soak.sh --duration 120  # CI
#
# Options: --duration S (traffic after a 60 s warm-up), --clients N (default 4), --build-dir DIR (default build;
# builds attnd and attnd_soak there when missing), --out DIR (server log and samples CSV; default
# /var/tmp/attnd-soak). Exits non-zero on an unexpected outcome, a wrong answer, a leak (the quiet server holding
# more memory, descriptors or threads after the run than after the warm-up), or an unclean server exit.
set -euo pipefail
cd "$(dirname "$0")/.."

duration=600
clients=4
build=${BUILD_DIR:-build}
out=/var/tmp/attnd-soak
while [ "$#" -gt 0 ]; do
  case "$1" in
    --duration) duration=$2; shift 2 ;;
    --clients) clients=$2; shift 2 ;;
    --build-dir) build=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "soak.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
if [ ! -x "$build/server/attnd" ] || [ ! -x "$build/tests/soak/attnd_soak" ]; then
  [ -f "$build/CMakeCache.txt" ] || cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
  cmake --build "$build" -j "$(nproc)" --target attnd attnd_soak
fi

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# Two compute threads and a short queue: the run reaches the queue limit and the shutdown path, not only the
# fast path. The access log goes to the log file like everything else (one line per call).
"$build/server/attnd" --listen="127.0.0.1:${port}" --backend=cpu --threads=2 --max_queue=32 \
  --shutdown_grace_s=30 > "$out/server.log" 2>&1 &
server=$!
stop() { kill -0 "$server" 2>/dev/null && kill -TERM "$server" 2>/dev/null; wait "$server" 2>/dev/null || true; }
trap stop EXIT
deadline=$(( $(date +%s) + 60 ))
until "$build/client/attn" health --target="127.0.0.1:${port}" >/dev/null 2>&1; do
  kill -0 "$server" 2>/dev/null || { tail -20 "$out/server.log"; echo "soak.sh: the server exited"; exit 1; }
  [ "$(date +%s)" -lt "$deadline" ] || { echo "soak.sh: the server is not SERVING after 60 s"; exit 1; }
  sleep 0.5
done

rc=0
"$build/tests/soak/attnd_soak" --target="127.0.0.1:${port}" --server_pid="$server" --duration_s="$duration" \
  --clients="$clients" --csv="$out/samples.csv" || rc=$?

kill -TERM "$server"
code=0
wait "$server" || code=$?
trap - EXIT
if [ "$code" != 0 ]; then
  tail -20 "$out/server.log"
  echo "soak.sh: attnd exited with $code after SIGTERM"
  rc=1
fi
if grep -E '\[(error|critical)\]' "$out/server.log" | head -5; then
  echo "soak.sh: errors in the server log ($out/server.log)"
  rc=1
fi
echo "soak.sh: server log $out/server.log, samples $out/samples.csv"
exit "$rc"

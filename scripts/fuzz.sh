#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/, clang with ASan and UBSan) and runs each for a given time, starting from
# its committed seed corpus (fuzz/corpus/<target>/), after replaying the inputs that once failed
# (fuzz/crashes/<target>/). Exits non-zero when any target found a crash, a leak or a failed property; the input
# that did it is kept under the work folder's artifacts/<target>/ (commit it to fuzz/crashes/ with the fix).
#
#   bash scripts/fuzz.sh                      # every target, 30 minutes each
#   bash scripts/fuzz.sh --time 60            # every target, 60 s each (CI)
#   bash scripts/fuzz.sh --time 600 fuzz_shm_hello fuzz_auth
#   bash scripts/fuzz.sh --seeds              # rewrite fuzz/corpus/ from real messages (fuzz_make_seeds), then stop
#
# Options: --time S (per target), --build-dir DIR (default build-fuzz), --work DIR (the growing corpora and the
# artifacts; default /var/tmp/attnd-fuzz), --jobs N (compile jobs, default nproc). The committed corpus is only
# read: what a run discovers stays in the work folder (copy the interesting inputs into fuzz/corpus/ by hand).
set -euo pipefail
cd "$(dirname "$0")/.."

TARGETS_ALL=(fuzz_forward_request fuzz_stream_chunk fuzz_validation fuzz_shm_channel fuzz_shm_hello fuzz_auth)
time_s=1800
build=build-fuzz
work=/var/tmp/attnd-fuzz
jobs=$(nproc)
seeds=0
targets=()
while [ "$#" -gt 0 ]; do
  case "$1" in
    --time) time_s=$2; shift 2 ;;
    --build-dir) build=$2; shift 2 ;;
    --work) work=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --seeds) seeds=1; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $1" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
[ "${#targets[@]}" -gt 0 ] || targets=("${TARGETS_ALL[@]}")

# clang and its runtime (libFuzzer, the sanitizers) from Debian, beside the build dependencies.
bash scripts/install_deps.sh --build-only >/dev/null
need=()
for p in clang libclang-rt-14-dev; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if [ "${#need[@]}" -gt 0 ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  echo "fuzz.sh: installing ${need[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
# CPU-only, no tests: only the libraries the targets link are built, all instrumented.
CC=clang CXX=clang++ cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DATTND_CUDA=OFF \
  -DATTND_BUILD_TESTS=OFF -DATTND_FUZZ=ON "${launcher[@]}" >/dev/null
if [ "$seeds" = 1 ]; then
  cmake --build "$build" -j "$jobs" --target fuzz_make_seeds
  rm -rf fuzz/corpus
  "$build/fuzz/fuzz_make_seeds" fuzz/corpus
  exit 0
fi
cmake --build "$build" -j "$jobs" --target "${targets[@]}"

passed=0
failed=0
summary=()
for t in "${targets[@]}"; do
  corpus="$work/corpus/$t"
  artifacts="$work/artifacts/$t"
  mkdir -p "$corpus" "$artifacts"
  log="$work/$t.log"
  echo "fuzz.sh: $t for ${time_s}s (corpus $corpus, log $log)"
  rc=0
  # Inputs that once failed (fuzz/crashes/<target>/) are replayed first: each must pass for good.
  if [ -d "fuzz/crashes/$t" ]; then
    "$build/fuzz/$t" -runs=1 fuzz/crashes/"$t"/* > "$work/$t.replay.log" 2>&1 || rc=$?
    if [ "$rc" != 0 ]; then
      failed=$((failed + 1))
      grep -E 'property failed|ERROR: |SUMMARY|leaked|Running: ' "$work/$t.replay.log" | head -5 | sed 's/^/  /'
      summary+=("$(printf '%-22s a committed reproducer in fuzz/crashes/%s still fails (log %s)' "$t" "$t" \
                   "$work/$t.replay.log")")
      continue
    fi
  fi
  # -timeout: one input taking 10 s is a hang; -rss_limit_mb: bounded memory whatever the input says.
  "$build/fuzz/$t" -max_total_time="$time_s" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$artifacts/" "$corpus" "fuzz/corpus/$t" > "$log" 2>&1 || rc=$?
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
  if [ "$rc" = 0 ]; then
    passed=$((passed + 1))
    summary+=("$(printf '%-22s %10s executions  cov %5s  ok' "$t" "${runs:-?}" "${cov:-?}")")
  else
    failed=$((failed + 1))
    grep -E 'property failed|ERROR: |SUMMARY|leaked' "$log" | head -5 | sed 's/^/  /'
    summary+=("$(printf '%-22s %10s executions  cov %5s  FAILED (rc %s; input: %s)' "$t" "${runs:-?}" "${cov:-?}" \
                 "$rc" "$(ls -t "$artifacts" | head -1)")")
  fi
done
printf '%s\n' "${summary[@]}"
echo "fuzz: ${passed} passed, ${failed} failed"
[ "$failed" = 0 ]

#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, everything the kernels need checked there in one call:
# the GPU test binary, compute-sanitizer memcheck/racecheck on small shapes, and the benchmark.
# Expects the ATTND_STATIC=ON builds in .carry/ (gpu_attention_test, libattnd_kernels_c.so); logs go to $OUT.
#   STEPS=test,bench,memcheck,racecheck  CONFIGS=seed|all|names  TABLES=seed,fa3,gqa
set -u
OUT=${OUT:-/tmp/attnd-out}
mkdir -p "$OUT"
BIN=${BIN:-.carry}
STEPS=${STEPS:-test,bench,memcheck,racecheck}
export PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH="$PWD/$BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"  # the abseil .so files beside libattnd_kernels_c.so
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv | tee "$OUT/env.txt"
has() { [[ ",$STEPS," == *",$1,"* ]]; }

if has test; then
  echo "== gpu_attention_test"
  timeout "${TEST_TIMEOUT:-150}" "$BIN/gpu_attention_test" --gtest_brief=1 --gtest_output="xml:$OUT/test.xml" \
    ${TEST_FILTER:+--gtest_filter=$TEST_FILTER} \
    > "$OUT/test.log" 2>&1
  echo "rc=$?"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]|tests? from|Failure|max \|O|Expected|Which is|error" "$OUT/test.log" | head -60
fi
if has bench; then
  echo "== bench"
  timeout "${BENCH_TIMEOUT:-240}" python3 kernels/bench/bench_attention.py --lib "$BIN/libattnd_kernels_c.so" \
    --configs "${CONFIGS:-seed}" --tables "${TABLES:-seed,fa3,gqa}" --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
fi
SMALL_FILTER=${SMALL_FILTER:-'*_sq17_*:*_sq65_br:*q65kv63_br:*q129kv17_tl:*b2_mqa4to1_br:*packed_qkv_tl:*bhsd_br:*neg_scale'}
if has memcheck; then
  echo "== compute-sanitizer memcheck"
  ATTND_GPU_TEST_SMALL=1 timeout "${MEMCHECK_TIMEOUT:-100}" compute-sanitizer --tool memcheck --error-exitcode 3 \
    "$BIN/gpu_attention_test" --gtest_brief=1 --gtest_filter="$SMALL_FILTER" > "$OUT/memcheck.log" 2>&1
  echo "rc=$?"
  grep -E "ERROR SUMMARY|^\[  (PASSED|FAILED) |^\[==========\]" "$OUT/memcheck.log" | tail -5
fi
if has racecheck; then
  echo "== compute-sanitizer racecheck"
  ATTND_GPU_TEST_SMALL=1 timeout "${RACECHECK_TIMEOUT:-90}" compute-sanitizer --tool racecheck --racecheck-report all \
    --error-exitcode 3 "$BIN/gpu_attention_test" --gtest_brief=1 \
    --gtest_filter="${RACE_FILTER:-*_sq129_tl:*q65kv63_br:*bhsd_br}" > "$OUT/racecheck.log" 2>&1
  echo "rc=$?"
  grep -E "RACECHECK SUMMARY|ERROR SUMMARY|^\[  (PASSED|FAILED) |^\[==========\]" "$OUT/racecheck.log" | tail -5
fi

#!/usr/bin/env bash
# The GPU checks of attnd. `build` runs here, where the build dependencies are installed; `kernels` and
# `service` run on the GPU machine, from the repository root, over what `build` packed into .carry/.
#
# The GPU machine has no gRPC, protobuf or abseil, so the test binaries, attnd, attn and ipc_peer are linked
# statically (-DATTND_STATIC=ON). The kernels' C ABI (libattnd_kernels_c.so, for kernels/bench/hopper_bench.py)
# is built shared, because Debian's static abseil cannot go into a shared object, and travels with the abseil
# libraries it names. Everything is stripped and packed into .carry/attnd.tar.xz; `build --base REV` adds
# .carry/base.tar.xz, the same library (and with --base-service the service binaries) of another revision, so
# that `kernels ab` and `service ab` measure old and new in one device call (the kernels in one process).
set -uo pipefail
cd "$(dirname "$0")/.."

usage() {
  cat <<'EOF'
usage:
  scripts/device.sh build [--base REV] [--base-service] [--type BUILD_TYPE] [--jobs N]
      Here. The static build (gpu tests, attnd, attn, ipc_peer) and the shared libattnd_kernels_c.so, stripped
      and packed into .carry/attnd.tar.xz. --base REV: REV's libattnd_kernels_c.so too, built in a temporary
      worktree, into .carry/base.tar.xz; --base-service: REV's attnd, attn and ipc_peer with it. Build trees
      under $BUILD_ROOT (build-device/), build type Release. Name .carry in the device call's carry.
  scripts/device.sh kernels [test|sanitize|sass|bench|ab|mmabench|decode|decodebench|raggedbench|fp8bench]...
                                                                          (default: test sanitize sass)
      On the GPU machine. test: gpu_attention_test, after a 30 s smoke run; sanitize: compute-sanitizer memcheck,
      racecheck and synccheck on small cases; sass: every Hopper kernel has wgmma (HGMMA, QGMMA) and no LDL/STL;
      bench: auto against torch SDPA cuDNN and FA2 (kernels/bench/hopper_bench.py) in 3 processes that rotate the
      columns; ab: the same rows, new against .carry/base's library in one process (--base_lib), AB_PROCS processes
      alternating which goes first, each row's new/base ratio flagged outside 2%; mmabench: the mma_sync family's
      tables (kernels/bench/bench_attention.py); decode: gpu_decode_test, then memcheck and racecheck on its small
      cases; decodebench: kernels/bench/decode_bench.py; raggedbench: kernels/bench/ragged_prefill_bench.py;
      fp8bench: the float8 forward's speed and accuracy (kernels/bench/fp8_bench.py). bench and ab take about 5
      minutes each.
  scripts/device.sh service [test|bench|ab|python|decode|pyoverhead|torch|move|soak]...  (default: test bench)
      On the GPU machine. test: gpu_server_parts_test, gpu_server_forward_test, gpu_server_ipc_test,
      gpu_sequences_test, gpu_sequence_moves_test (two attnd processes on the GPU, moves by CUDA IPC); bench: one
      attnd, then CUDA IPC over gRPC and over the shm channel (ipc_peer bench), the TCP baseline (ipc_peer tcp)
      and inline unary/stream calls (attn bench); ab: bench with the new binaries, then with .carry/base's;
      python: the Python client's pytest suite (client/python/tests) with the GPU machine's Python and torch;
      torch (TORCH_RUNS: which of python_steps cpp_ordered cpp_ipc engine; STEPS_FLAGS: cuda_steps.py's; TORCH_TAG:
      a suffix for its JSON): KV-sequence steps from PyTorch and C++ callers with CUDA tensors, ordered on their streams
      (client/python/bench/cuda_steps.py, ordered_steps, ipc_peer decode beside them) and the engine example
      (client/python/examples/llama_engine.py) against in-process SDPA, then alone with steps that wait; move: two
      attnd on the GPU and client/python/bench/move_bench.py between them (MOVE_FLAGS: its shape and count); soak:
      the CI soak's verified traffic against a CUDA attnd for SOAK_S seconds (1800) after a 60 s warm-up, RSS
      sampled into soak_samples.csv.
Logs: $OUT/kernels.log, $OUT/service.log, and the benchmarks' rows as kernels_bench.json, kernels_ab.json and
kernels_mmabench.json; a summary table is printed last. The exit status is 0 when every check passed.
Parameters (environment of this script):
  kernels: TEST_FILTER, TEST_TIMEOUT (300 s), SANITIZE_TOOLS ("memcheck racecheck synccheck"), SANITIZE_FILTER,
           RACE_FILTER, SANITIZE_TIMEOUT (150 s a tool), BENCH_CONFIG (auto), AB_CONFIGS (auto; comma-separated),
           AB_PROCS (4), BENCH_SEQS (1024,2048,4096,8192,16384), BENCH_REP (100 ms), BENCH_SETTLE_MS (500),
           BENCH_TIMEOUT (300 s a process)
  service: FORWARD_FILTER, SERVICE_TEST_TIMEOUT (150 s a binary), PORT (50051), STREAMS (8), DUR (2s),
           SEQS ("1024 4096"), CALLERS ("1 16"), TRANSPORTS ("unary stream"), SERVER_FLAGS, CLIENT_FLAGS
EOF
}

die() { echo "device.sh: $*" >&2; exit 2; }

# ---------------------------------------------------------------------------------------------------------------
# build (here)

STATIC_TARGETS="gpu_attention_test gpu_decode_test gpu_sequences_test gpu_server_parts_test gpu_server_forward_test
  gpu_server_ipc_test gpu_sequence_moves_test attnd attn ipc_peer ordered_steps attnd_soak"
SERVICE_TARGETS="attnd attn ipc_peer"

# configure_and_build SRC BUILD_DIR STATIC(ON|OFF) TARGETS...
configure_and_build() {
  local src=$1 dir=$2 static=$3
  shift 3
  local launcher=()
  command -v ccache > /dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
  local tests=ON
  [ "$static" = OFF ] && tests=OFF  # the shared tree builds only the C ABI library
  echo "== configure $dir (static $static, $src)"
  cmake -S "$src" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE="$BUILD_TYPE" -DATTND_CUDA=ON -DATTND_STATIC="$static" \
    -DATTND_BUILD_TESTS="$tests" "${launcher[@]}" > "$dir.configure.log" 2>&1 \
    || { tail -30 "$dir.configure.log"; die "configure of $dir failed"; }
  echo "== build $dir: $*"
  nice cmake --build "$dir" -j "$JOBS" --target "$@" || die "build of $dir failed"
}

# stage_binary BUILD_DIR NAME STAGE: the built executable NAME (wherever its folder is in that revision), stripped.
stage_binary() {
  local f
  f=$(find "$1" -type f -name "$2" -perm -u+x ! -path '*/CMakeFiles/*' | head -1)
  [ -n "$f" ] || die "$2 not found under $1"
  strip -o "$3/$2" "$f"
}

# stage_c_library BUILD_DIR STAGE: libattnd_kernels_c.so and the abseil libraries it loads (its RUNPATH is $ORIGIN).
stage_c_library() {
  local f
  f=$(find "$1" -type f -name libattnd_kernels_c.so ! -path '*/CMakeFiles/*' | head -1)
  [ -n "$f" ] || die "libattnd_kernels_c.so not found under $1"
  strip --strip-unneeded -o "$2/libattnd_kernels_c.so" "$f"
  ldd "$f" | awk '/libabsl_/ {print $3}' | while read -r lib; do
    cp -L "$lib" "$2/" && strip --strip-unneeded "$2/$(basename "$lib")"
  done
}

# pack STAGE ARCHIVE SRC: the staged files and the revision they were built from.
pack() {
  { git -C "$3" rev-parse HEAD; git -C "$3" status --porcelain --untracked-files=no | head -20; } > "$1/commit"
  tar -cJf "$2" -C "$1" .
  rm -rf "$1"
}

cmd_build() {
  local base="" base_service=""
  BUILD_TYPE=Release
  JOBS=$(nproc)
  while [ $# -gt 0 ]; do
    case $1 in
      --base) base=${2:?--base needs a revision}; shift ;;
      --base-service) base_service=1 ;;
      --type) BUILD_TYPE=${2:?}; shift ;;
      --jobs) JOBS=${2:?}; shift ;;
      -h|--help) usage; exit 0 ;;
      *) die "build: unknown argument $1" ;;
    esac
    shift
  done
  [ -n "$base_service" ] && [ -z "$base" ] && die "--base-service needs --base REV"
  local root broot
  root=$(pwd)
  broot=$root/${BUILD_ROOT:-build-device}
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$(dirname "$root")}
  rm -rf .carry  # only the archives travel
  mkdir -p "$broot" .carry

  configure_and_build "$root" "$broot/static" ON $STATIC_TARGETS
  configure_and_build "$root" "$broot/shared" OFF attnd_kernels_c attnd_decode_c attnd_python_lib
  local stage
  stage=$TMP/stage-new && mkdir -p "$stage"
  for t in $STATIC_TARGETS; do stage_binary "$broot/static" "$t" "$stage"; done
  stage_c_library "$broot/shared" "$stage"
  strip --strip-unneeded -o "$stage/libattnd_decode_c.so" "$(find "$broot/shared" -type f -name libattnd_decode_c.so | head -1)" \
    || die "libattnd_decode_c.so not found under $broot/shared"
  # The Python client's native part with the libraries it bundles (client/python/attnd/lib, written by attnd_python_lib).
  mkdir -p "$stage/pylib" && cp -a client/python/attnd/lib/. "$stage/pylib/"
  pack "$stage" .carry/attnd.tar.xz "$root"

  if [ -n "$base" ]; then
    local rev src="$broot/base-src"
    rev=$(git rev-parse --verify "$base^{commit}") || die "--base: no revision $base"
    git worktree remove --force "$src" 2> /dev/null; rm -rf "$src"; git worktree prune
    git worktree add --detach "$src" "$rev" > /dev/null || die "git worktree add $src $rev failed"
    # The worktree goes when the build ends; its build trees stay, so a rebuild at the same path hits ccache.
    BASE_SRC=$src
    configure_and_build "$src" "$broot/base-shared" OFF attnd_kernels_c
    stage=$TMP/stage-base && mkdir -p "$stage"
    stage_c_library "$broot/base-shared" "$stage"
    if [ -n "$base_service" ]; then
      configure_and_build "$src" "$broot/base-static" ON $SERVICE_TARGETS
      for t in $SERVICE_TARGETS; do stage_binary "$broot/base-static" "$t" "$stage"; done
    fi
    pack "$stage" .carry/base.tar.xz "$src"
  fi
  du -sh .carry/*.tar.xz
  local kib
  kib=$(du -sk .carry | cut -f1)
  [ "$kib" -lt 40960 ] || echo "device.sh: .carry is $((kib / 1024)) MiB; the device call carries 64 MiB with the tree" >&2
  echo "carry .carry in the device call; there: bash scripts/device.sh kernels ... / service ..."
}

# ---------------------------------------------------------------------------------------------------------------
# On the GPU machine

C=.carry
OUT=${OUT:-/tmp/attnd-device-out}
SUMMARY=()
FAILED=0

# print_new_rows N: the summary rows added since there were N (what the step just found).
print_new_rows() {
  local i
  for ((i = $1; i < ${#SUMMARY[@]}; i++)); do echo "${SUMMARY[$i]}"; done
}

# note CHECK RESULT DETAIL: one row of the summary table.
note() {
  SUMMARY+=("$(printf '%-28s %-5s %s' "$1" "$2" "$3")")
  [ "$2" = ok ] || [ "$2" = skip ] || FAILED=1
}

unpack() {
  [ -f $C/attnd.tar.xz ] || die "no $C/attnd.tar.xz: run 'scripts/device.sh build' here and carry .carry"
  tar -xJf $C/attnd.tar.xz -C $C || die "unpacking $C/attnd.tar.xz failed"
  if [ -f $C/base.tar.xz ]; then
    mkdir -p $C/base && tar -xJf $C/base.tar.xz -C $C/base || die "unpacking $C/base.tar.xz failed"
  fi
  # The abseil libraries beside libattnd_kernels_c.so load each other by name.
  export LD_LIBRARY_PATH="$PWD/$C:$PWD/$C/base${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export PYTHONUNBUFFERED=1
}

env_header() {
  {
    date -u +"date %Y-%m-%dT%H:%M:%SZ"
    echo "commit $(head -1 $C/commit 2> /dev/null)$(sed -n '2{s/.*/ (uncommitted changes)/p}' $C/commit 2> /dev/null)"
    [ -f $C/base/commit ] && echo "base commit $(head -1 $C/base/commit)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu,power.draw \
      --format=csv,noheader
    python3 -c 'import torch; print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version())' 2> /dev/null
  } 2>&1
}

# gtest_counts LOG: "passed N, failed M, skipped K" from a GoogleTest run's summary lines.
gtest_counts() {
  local p f s
  p=$(grep -oE '^\[  PASSED  \] [0-9]+' "$1" | grep -oE '[0-9]+$' | awk '{n += $1} END {print n + 0}')
  f=$(grep -oE '^\[  FAILED  \] [0-9]+ tests?,' "$1" | grep -oE '[0-9]+' | awk '{n += $1} END {print n + 0}')
  s=$(grep -oE '^\[  SKIPPED \] [0-9]+ tests?,' "$1" | grep -oE '[0-9]+' | awk '{n += $1} END {print n + 0}')
  echo "passed $p, failed $f, skipped $s"
}

# gtest_result NAME RC LOG: a summary row; a filter that matched nothing is a failure, not a pass.
gtest_result() {
  local counts
  counts=$(gtest_counts "$3")
  if [ "$2" -eq 124 ]; then
    note "$1" FAIL "timed out; $counts"
  elif grep -q '^\[==========\] 0 tests from' "$3"; then
    note "$1" FAIL "no test matched the filter"
  elif [ "$2" -ne 0 ]; then
    note "$1" FAIL "rc=$2; $counts"
  else
    note "$1" ok "$counts"
  fi
}

# The small cases that compute-sanitizer runs: kept configurations only (see kernels/cuda/src/config_registry.cc),
# each head_dim, every mask, GQA, the BHSD layout, uneven lengths, and auto's and the mma_sync family's own choice.
# A trailing * takes in a case's variants (fewer blocks, a forced split tail) where the suite has them.
SMALL_DEFAULT='*hopper_sm90_d128_m128n128s3_osk_p2_d128_bhsd_none*:*hopper_sm90_d64_m128n128s6_p2_d64_q1000kv65_tl*'
SMALL_DEFAULT+=':*hopper_sm90_d128_m128n128s3_osk_p2_d128_q1000kv65_br*:*hopper_sm90_d128_m128n128s3_osk_p2_d128_sq129_tl*'
SMALL_DEFAULT+=':*hopper_sm90_d64_m128n128s6_p2_d64_q17kv129_br*:*hopper_sm90_d256_m128n64s2_d256_q17kv129_none*'
SMALL_DEFAULT+=':*hopper_sm90_d128_m128n128s3_osk_p2_d128_b3_gqa8to2_tl*:*hopper_sm90_d64_m192n128s4_wrs_d64_sq129_br*'
SMALL_DEFAULT+=':*hopper_sm90_d64_m192n128s4_wrs_d64_b3_gqa8to2_tl*'
SMALL_DEFAULT+=':*mma_sync_*_sq17_tl*:*mma_sync_*_q65kv63_br*:*mma_sync_*_bhsd_br*:*mma_sync_*_neg_scale*:*auto_d*_sq65_br*'
# racecheck instruments every shared-memory access: one tiny case per family.
RACE_DEFAULT='*hopper_sm90_d128_m128n128s3_osk_p2_d128_sq17_none*:*mma_sync_sm90_d128_m128n64s2w4_d128_sq17_tl*'

kernels_test() {
  local t=$TMP/test.log rc
  # One small case per head_dim first: a hang here costs 30 s, not the whole call.
  timeout 30 $C/gpu_attention_test --gtest_brief=1 --gtest_filter='*hopper_sm90_d*_sq129_tl:*mma_sync_sm90_d*_sq129_tl' \
    > "$t" 2>&1
  rc=$?
  cat "$t" >> "$LOG"
  gtest_result "kernels smoke" $rc "$t"
  [ $rc -eq 0 ] || return
  timeout "${TEST_TIMEOUT:-300}" $C/gpu_attention_test --gtest_brief=1 ${TEST_FILTER:+--gtest_filter=$TEST_FILTER} \
    > "$t" 2>&1
  rc=$?
  cat "$t" >> "$LOG"
  gtest_result "kernels test" $rc "$t"
}

kernels_sanitize() {
  local t=$TMP/sanitize.log rc tool filter extra errors
  for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
    filter=${SANITIZE_FILTER:-$SMALL_DEFAULT}
    extra=()
    if [ "$tool" = racecheck ]; then
      filter=${RACE_FILTER:-$RACE_DEFAULT}
      extra=(--racecheck-report all)
    fi
    echo "== compute-sanitizer --tool $tool" >> "$LOG"
    ATTND_GPU_TEST_SMALL=1 timeout "${SANITIZE_TIMEOUT:-150}" compute-sanitizer --tool "$tool" --error-exitcode 9 \
      "${extra[@]}" $C/gpu_attention_test --gtest_brief=1 --gtest_filter="$filter" > "$t" 2>&1
    rc=$?
    cat "$t" >> "$LOG"
    errors=$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$t" | tail -1)
    if [ $rc -eq 0 ] && ! grep -q '^\[==========\] 0 tests from' "$t"; then
      note "sanitize $tool" ok "$(gtest_counts "$t"); ${errors:-no summary}"
    else
      gtest_result "sanitize $tool" $rc "$t"
      SUMMARY[-1]+="; ${errors:-no summary}"
    fi
  done
}

kernels_sass() {
  cuobjdump --dump-sass $C/gpu_attention_test > "$TMP/all.sass" 2>&1 || { note "kernels sass" FAIL "cuobjdump failed"; return; }
  local line
  line=$(python3 - "$TMP/all.sass" "$LOG" << 'PY'
import re, sys
text = '\n' + open(sys.argv[1]).read()
rows, bad = [], []
for f in re.split(r'\n\s*Function : ', text)[1:]:
    name = f.split('\n', 1)[0].strip()
    if 'kernels6hopper' not in name or 'fwd' not in name.lower():  # attnd::kernels::hopper's forward kernels
        continue
    ops = re.findall(r'/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)', f)
    # HGMMA: 16-bit wgmma; QGMMA: float8.
    n = {p: sum(1 for o in ops if o.startswith(p))
         for p in ('HGMMA', 'QGMMA', 'LDL', 'STL', 'BAR', 'SYNCS', 'USETMAXREG')}
    rows.append(f"{name}\n  instructions {len(ops)}  " + "  ".join(f"{k} {v}" for k, v in n.items()))
    if n['HGMMA'] + n['QGMMA'] == 0 or n['LDL'] or n['STL']:
        bad.append(name)
with open(sys.argv[2], 'a') as log:
    log.write('\n'.join(rows) + '\n')
    if bad:
        log.write('without wgmma or with local memory:\n  ' + '\n  '.join(bad) + '\n')
print(f"{len(rows)} {len(bad)}")
PY
)
  local kernels=${line% *} bad=${line#* }
  if [ -z "$line" ] || [ "$kernels" = 0 ]; then
    note "kernels sass" FAIL "no Hopper kernel found in the SASS"
  elif [ "$bad" != 0 ]; then
    note "kernels sass" FAIL "$bad of $kernels Hopper kernels lack wgmma (HGMMA/QGMMA) or use LDL/STL (see kernels.log)"
  else
    note "kernels sass" ok "$kernels Hopper kernels: wgmma (HGMMA/QGMMA) in each, no LDL/STL"
  fi
}

# bench_process N ORDER CONFIGS PEERS JSON [hopper_bench.py flags]: one benchmark process, its rows appended to JSON.
bench_process() {
  local n=$1 order=$2 configs=$3 peers=$4 json=$5 rc
  shift 5
  echo "== process $n: --configs $configs --peers $peers --order $order" >> "$LOG"
  timeout "${BENCH_TIMEOUT:-300}" python3 kernels/bench/hopper_bench.py --lib $C/libattnd_kernels_c.so \
    --configs "$configs" --peers "$peers" --order "$order" --rep "${BENCH_REP:-100}" \
    --settle_ms "${BENCH_SETTLE_MS:-500}" --seqs "${BENCH_SEQS:-1024,2048,4096,8192,16384}" \
    --json "$TMP/run.json" "$@" > "$TMP/bench.log" 2>&1
  rc=$?
  cat "$TMP/bench.log" >> "$LOG"
  [ $rc -eq 0 ] && python3 scripts/bench_tables.py append "$json" "$TMP/run.json" "$n" "$order"
  return $rc
}

# table_result NAME KIND JSON CONFIGS: the per-row table into the log, its SUMMARY line into the summary.
table_result() {
  local out s
  out=$(python3 scripts/bench_tables.py "$2" "$3" "$4" 2>&1)
  printf '%s\n' "$out" | grep -v '^SUMMARY' >> "$LOG"
  s=$(printf '%s\n' "$out" | sed -n 's/^SUMMARY //p')
  if [ -z "$s" ]; then
    note "$1" FAIL "no table: $(printf '%s\n' "$out" | tail -1)"
  elif [[ $s == *", 0 failed"* && $s != *"outside 2%"* ]] || [[ $s == *" 0 outside 2%, 0 failed"* ]]; then
    note "$1" ok "$s"
  else
    note "$1" FAIL "$s"
  fi
}

# The table against the peers: the processes rotate attnd's column, cuDNN and FA2 through every position.
kernels_bench() {
  local config=${BENCH_CONFIG:-auto} json=$OUT/kernels_bench.json
  local orders=("$config,cudnn,fa2" "cudnn,fa2,$config" "fa2,$config,cudnn") i ok=1
  rm -f "$json"
  for i in 0 1 2; do
    bench_process $((i + 1)) "${orders[$i]}" "$config" cudnn,fa2 "$json" || ok=0
  done
  [ $ok -eq 1 ] || note "kernels bench processes" FAIL "a process failed (see kernels.log)"
  table_result "kernels bench" bench "$json" "$config"
}

# New against base in one process per run: the attnd columns take turns going first, cuDNN is timed last as the
# reference of the row.
kernels_ab() {
  [ -f $C/base/libattnd_kernels_c.so ] || { note "kernels ab" FAIL "no $C/base: build --base REV"; return; }
  local configs=${AB_CONFIGS:-auto} json=$OUT/kernels_ab.json new="" old="" c i order ok=1
  for c in ${configs//,/ }; do
    new+="${new:+,}$c"
    old+="${old:+,}base:$c"
  done
  rm -f "$json"
  for i in $(seq 1 "${AB_PROCS:-4}"); do
    order=$new,$old,cudnn
    [ $((i % 2)) -eq 0 ] && order=$old,$new,cudnn
    bench_process "$i" "$order" "$new,$old" cudnn "$json" --base_lib $C/base/libattnd_kernels_c.so || ok=0
  done
  [ $ok -eq 1 ] || note "kernels ab processes" FAIL "a process failed (see kernels.log)"
  table_result "kernels ab" ab "$json" "$configs"
}

# The mma_sync family's tables (kernels/bench/bench_attention.py: its own method, one process).
kernels_mmabench() {
  local rc
  timeout "${BENCH_TIMEOUT:-300}" python3 kernels/bench/bench_attention.py --lib $C/libattnd_kernels_c.so \
    --configs mma_sync --tables mma_sync,fa3,gqa,d256 --json "$OUT/kernels_mmabench.json" > "$TMP/mmabench.log" 2>&1
  rc=$?
  cat "$TMP/mmabench.log" >> "$LOG"
  if [ $rc -eq 0 ]; then note "kernels mmabench" ok "table in kernels.log"; else note "kernels mmabench" FAIL "rc=$rc"; fi
}

# The decode / paged-KV kernels: their suite against the CPU reference, then memcheck and racecheck on small cases.
kernels_decode() {
  local t=$TMP/decode.log rc tool
  timeout "${TEST_TIMEOUT:-300}" $C/gpu_decode_test --gtest_brief=1 ${DECODE_FILTER:+--gtest_filter=$DECODE_FILTER} \
    > "$t" 2>&1
  rc=$?
  cat "$t" >> "$LOG"
  gtest_result "decode test" $rc "$t"
  for tool in memcheck racecheck; do
    timeout "${SANITIZE_TIMEOUT:-150}" compute-sanitizer --tool "$tool" --error-exitcode 9 $C/gpu_decode_test \
      --gtest_brief=1 --gtest_filter="${DECODE_SANITIZE_FILTER:-*q1_contig:*q4_paged16:*pages16:*shared_prefix:*kv_shorter_than_q:*append_paged}" > "$t" 2>&1
    rc=$?
    cat "$t" >> "$LOG"
    gtest_result "decode sanitize $tool" $rc "$t"
    SUMMARY[-1]+="; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$t" | tail -1)"
  done
}

# The decode benchmark: attnd's decode kernel beside SDPA cuDNN / FLASH and a read-only pass (the ceiling).
kernels_decodebench() {
  local rc
  timeout "${BENCH_TIMEOUT:-300}" python3 kernels/bench/decode_bench.py --lib $C/libattnd_decode_c.so \
    --json "$OUT/decode_bench.json" ${DECODE_BENCH_FLAGS:-} > "$TMP/decodebench.log" 2>&1
  rc=$?
  cat "$TMP/decodebench.log" >> "$LOG"
  if [ $rc -eq 0 ]; then note "kernels decodebench" ok "table in kernels.log"; else note "kernels decodebench" FAIL "rc=$rc"; fi
}

# The float8 forward beside attnd's bf16, torch SDPA cuDNN and the float8 GEMM, and its accuracy
# (kernels/bench/fp8_bench.py).
kernels_fp8bench() {
  local rc
  timeout "${BENCH_TIMEOUT:-300}" python3 kernels/bench/fp8_bench.py --lib $C/libattnd_kernels_c.so --accuracy \
    --json "$OUT/fp8_bench.json" ${FP8_BENCH_FLAGS:-} > "$TMP/fp8bench.log" 2>&1
  rc=$?
  cat "$TMP/fp8bench.log" >> "$LOG"
  if [ $rc -eq 0 ]; then note "kernels fp8bench" ok "table in kernels.log"; else note "kernels fp8bench" FAIL "rc=$rc"; fi
}

# The ragged prefill into a paged cache (append, gather, prefill per sequence) beside the same prefill kernels on
# contiguous K/V.
kernels_raggedbench() {
  local rc
  timeout "${BENCH_TIMEOUT:-300}" python3 kernels/bench/ragged_prefill_bench.py --lib-dir $C \
    --json "$OUT/ragged_prefill_bench.json" > "$TMP/raggedbench.log" 2>&1
  rc=$?
  cat "$TMP/raggedbench.log" >> "$LOG"
  if [ $rc -eq 0 ]; then note "kernels raggedbench" ok "table in kernels.log"; else note "kernels raggedbench" FAIL "rc=$rc"; fi
}

cmd_kernels() {
  local steps=("$@") s n
  [ ${#steps[@]} -eq 0 ] && steps=(test sanitize sass)
  for s in "${steps[@]}"; do
    case $s in test|sanitize|sass|bench|ab|mmabench|decode|decodebench|raggedbench|fp8bench) ;;
      *) die "kernels: unknown step $s" ;;
    esac
  done
  mkdir -p "$OUT"
  unpack
  LOG=$OUT/kernels.log
  env_header | tee -a "$LOG"
  for s in "${steps[@]}"; do
    echo "=== kernels $s" >> "$LOG"
    n=${#SUMMARY[@]}
    "kernels_$s"
    print_new_rows "$n"
  done
}

# service_measure BINDIR LABEL: one attnd from BINDIR and the measurements against it, each bounded in time.
# KV sequences on a cuda server (docs/sequences.md, docs/benchmarks.md "Decode steps"): verified samples
# (attn seq --verify), one sequence at kv 4k over shm and gRPC TCP, 64 sequences in one Step per layer and one
# message each, the engine-shaped run (32 layers x 64 sequences, prefill 2k, 256 steps), with the server's
# stats, pool and RSS before and after; then the decode kernel alone on the same rows (decode_bench.py).
service_decode() {
  local b=$1 port=${PORT:-50061} r=$OUT/decode_service.txt
  local sock=/tmp/attnd_dec_$port.sock shm=/tmp/attnd_decshm_$port.sock
  local shape="--kv_heads=8 --q_heads=32 --head_dim=128"
  rm -f "$sock" "$shm"
  "$b/attnd" --listen=127.0.0.1:$port --unix_socket=$sock --shm_socket=$shm --enable_cuda_ipc --log_level=warn \
    ${SERVER_FLAGS:-} > "$TMP/attnd_decode.log" 2>&1 &
  local server=$! i
  for i in $(seq 1 150); do "$b/attn" info --target=unix:$sock > /dev/null 2>&1 && break; sleep 0.2; done
  { echo "== attnd rss_kb at start: $(ps -o rss= -p $server)"; "$b/attn" info --target=unix:$sock; } >> "$r" 2>&1
  run_dec() {  # label, args...
    local label=$1; shift
    echo "== $label: $*" >> "$r"
    timeout ${DECODE_CMD_TIMEOUT:-150} "$b/attn" "$@" --progress=false >> "$r" 2>&1
    local rc=$?
    echo "== $label rc=$rc rss_kb=$(ps -o rss= -p $server)" >> "$r"
    if [ $rc -eq 0 ]; then note "decode $label" ok ""; else note "decode $label" FAIL "rc=$rc"; fi
  }
  run_dec verify_seq seq --target=unix:$sock --layers=2 $shape --prefill=4093 --steps=6 --verify --lse
  run_dec verify_seq_shm seq --target=unix:$sock --transport=shm --shm_socket=$shm --layers=2 $shape --prefill=100 \
    --steps=4 --verify
  run_dec one_shm bench --workload=decode --target=unix:$sock --transport=shm --shm_socket=$shm --layers=1 $shape \
    --sequences=1 --context=4096 --steps=${STEPS1:-2000}
  run_dec one_tcp bench --workload=decode --target=127.0.0.1:$port --layers=1 $shape --sequences=1 --context=4096 \
    --steps=${STEPS1:-2000}
  # The same steps as unary Step calls instead of messages on a StepStream (the client's default), and on the
  # stream with a caller that sleeps at once instead of polling for the answer (--step_poll_us, default 300).
  run_dec one_tcp_unary bench --workload=decode --target=127.0.0.1:$port --transport=unary --layers=1 $shape \
    --sequences=1 --context=4096 --steps=${STEPS1:-2000}
  run_dec one_tcp_nopoll bench --workload=decode --target=127.0.0.1:$port --step_poll_us=0 --layers=1 $shape \
    --sequences=1 --context=4096 --steps=${STEPS1:-2000}
  run_dec one_unix bench --workload=decode --target=unix:$sock --layers=1 $shape --sequences=1 --context=4096 \
    --steps=${STEPS1:-2000}
  run_dec s64_shm_onemsg bench --workload=decode --target=unix:$sock --transport=shm --shm_socket=$shm --layers=1 \
    $shape --sequences=64 --context=4096 --steps=${STEPS64:-300} --one_message
  run_dec s64_tcp_onemsg bench --workload=decode --target=127.0.0.1:$port --layers=1 $shape --sequences=64 \
    --context=4096 --steps=${STEPS64:-300} --one_message
  run_dec s64_shm_each bench --workload=decode --target=unix:$sock --transport=shm --shm_socket=$shm --layers=1 \
    $shape --sequences=60 --context=4096 --steps=${STEPS64:-300}
  run_dec s64_tcp_each bench --workload=decode --target=127.0.0.1:$port --layers=1 $shape --sequences=64 \
    --context=4096 --steps=${STEPS64:-300}
  # The same steps with Q, the new K/V and O in the caller's CUDA buffers (ipc_peer decode: kernel-only time of
  # the same batch measured in that process, replies checked against the oracle).
  # One caller stepping all sequences, then two callers stepping half each (two launches in flight).
  local tr rc callers seqs
  for tr in shm grpc; do
    for callers in 1 2; do
      seqs=${IPC_DECODE_SEQS:-1,64}
      [ $callers -gt 1 ] && seqs=64
      echo "== ipc_${tr}_c$callers: ipc_peer decode" >> "$r"
      timeout ${DECODE_CMD_TIMEOUT:-150} "$b/ipc_peer" decode --target=unix:$sock --transport=$tr --shm_socket=$shm \
        --decode_sequences=$seqs --decode_callers=$callers --context=4096 --steps=${IPC_DECODE_STEPS:-1000} >> "$r" 2>&1
      rc=$?
      echo "== ipc_${tr}_c$callers rc=$rc rss_kb=$(ps -o rss= -p $server)" >> "$r"
      note "decode ipc_${tr}_c$callers" "$([ $rc -eq 0 ] && echo ok || echo FAIL)" ""
    done
  done
  "$b/attn" stats --target=unix:$sock >> "$r" 2>&1
  run_dec engine bench --workload=decode --target=unix:$sock --transport=shm --shm_socket=$shm --layers=32 $shape \
    --sequences=64 --context=2048 --steps=${ENGINE_STEPS:-256} --one_message
  run_dec engine_verify seq --target=unix:$sock --layers=32 $shape --prefill=2048 --steps=4 --verify
  { echo "== after"; "$b/attn" stats --target=unix:$sock; echo "rss_kb=$(ps -o rss= -p $server)"; } >> "$r" 2>&1
  kill -TERM $server
  wait $server
  echo "attnd exit rc=$?" >> "$r"
  { grep -E '\[(warning|error|critical)\]' "$TMP/attnd_decode.log" | head -20; tail -5 "$TMP/attnd_decode.log"; } >> "$r"
  if command -v python3 > /dev/null && python3 -c "import torch, triton" 2> /dev/null; then
    timeout 300 python3 kernels/bench/decode_bench.py --lib $C/libattnd_decode_c.so --rows 1x4k,64x4k \
      --q-lens 1 --storages contig,paged16 --json "$OUT/decode_kernel_rows.json" > "$OUT/decode_kernel_rows.txt" 2>&1
    note "decode kernel rows" "$([ $? -eq 0 ] && echo ok || echo FAIL)" ""
  fi
  cat "$r" >> "$LOG"
}

# The Python client's per-call cost beside the C++ tools', one server, same shapes (docs/benchmarks.md): a Forward
# by CUDA IPC over the shm channel (ipc_peer, then client/python/bench/overhead.py with torch CUDA tensors) and a
# decode step over the shm channel (attn bench --workload=decode, then the Python client).
service_pyoverhead() {
  local b=$1 port=${PORT:-50071} r=$OUT/pyoverhead.txt
  local sock=/tmp/attnd_py_$port.sock shm=/tmp/attnd_pyshm_$port.sock
  rm -f "$sock" "$shm"
  "$b/attnd" --listen=127.0.0.1:$port --unix_socket=$sock --shm_socket=$shm --enable_cuda_ipc --log_level=warn \
    --warm_shapes=1x1024x1024x32x32x128 > "$TMP/attnd_py.log" 2>&1 &
  local server=$! i rc
  for i in $(seq 1 150); do "$b/attn" info --target=unix:$sock > /dev/null 2>&1 && break; sleep 0.2; done
  mkdir -p client/python/attnd/lib && cp -a $C/pylib/. client/python/attnd/lib/
  for i in 1 2; do
    timeout 120 "$b/ipc_peer" bench --target=unix:$sock --transport=shm --shm_socket=$shm --seqs=1024 \
      --concurrency=1 --duration_s=2 --warmup_s=0.5 --verify_every=25 >> "$r" 2>&1
    PYTHONPATH=$PWD/client/python PYTHONDONTWRITEBYTECODE=1 timeout 200 python3 client/python/bench/overhead.py \
      --target unix:$sock --shm-socket $shm --seq 1024 --what forward >> "$r" 2>&1
    timeout 120 "$b/attn" bench --workload=decode --target=unix:$sock --transport=shm --shm_socket=$shm --layers=1 \
      --kv_heads=8 --q_heads=32 --head_dim=128 --sequences=1 --context=4096 --steps=2000 --progress=false >> "$r" 2>&1
    PYTHONPATH=$PWD/client/python PYTHONDONTWRITEBYTECODE=1 timeout 200 python3 client/python/bench/overhead.py \
      --target unix:$sock --shm-socket $shm --context 4096 --what step >> "$r" 2>&1
    rc=$?
  done
  kill -TERM $server
  wait $server
  echo "attnd exit rc=$?" >> "$r"
  if [ $rc -eq 0 ]; then note "python overhead" ok "$(grep -c '^python' "$r") python rows"; else note "python overhead" FAIL "rc=$rc"; fi
  cat "$r" >> "$LOG"
}

# KV-sequence decode steps from callers whose tensors are CUDA memory, ordered on their streams (docs/benchmarks.md,
# "KV sequences from PyTorch"): the Python benchmark (one sequence, 64 from one and from two processes), the C++
# example (checked against the oracle, then timed), the C++ registered-buffer path (ipc_peer decode) in the same
# server for comparison, and the engine example against in-process SDPA.
service_torch() {
  local b=$1 port=${PORT:-50081} r=$OUT/torch_steps.txt rc
  local sock=/tmp/attnd_t_$port.sock shm=/tmp/attnd_tshm_$port.sock
  rm -f "$sock" "$shm"
  # MPS=1: the server and its callers as clients of one MPS daemon (one GPU context for all of them), started here
  # and stopped at the end.
  if [ "${MPS:-0}" = 1 ]; then
    nvidia-cuda-mps-control -d && echo "== MPS daemon started" >> "$r" || echo "== MPS: cannot start the daemon" >> "$r"
  fi
  "$b/attnd" --listen=127.0.0.1:$port --unix_socket=$sock --shm_socket=$shm --enable_cuda_ipc --log_level=warn \
    --kv_max_pools=2 --kv_pool_mb=${KV_POOL_MB:-49152} ${SERVER_FLAGS:-} > "$TMP/attnd_torch.log" 2>&1 &
  local server=$! i
  for i in $(seq 1 150); do "$b/attn" info --target=unix:$sock > /dev/null 2>&1 && break; sleep 0.2; done
  mkdir -p client/python/attnd/lib && cp -a $C/pylib/. client/python/attnd/lib/
  local py="env PYTHONPATH=$PWD/client/python PYTHONDONTWRITEBYTECODE=1 timeout ${TORCH_CMD_TIMEOUT:-240} python3"
  run_torch() {  # label, command...
    local label=$1; shift
    echo "== $label: $*" >> "$r"
    "$@" >> "$r" 2>&1
    rc=$?
    echo "== $label rc=$rc rss_kb=$(ps -o rss= -p $server)" >> "$r"
    note "torch $label" "$([ $rc -eq 0 ] && echo ok || echo FAIL)" \
      "$(grep -E '^(one|[0-9]+ seq|ordered_steps|attnd / sdpa|attnd  )' "$r" | tail -1)"
  }
  local runs=" ${TORCH_RUNS:-python_steps cpp_ordered cpp_ipc engine} "
  [[ $runs == *" python_steps "* ]] && run_torch python_steps $py client/python/bench/cuda_steps.py --target unix:$sock \
    --shm-socket $shm ${STEPS_FLAGS:-} --json "$OUT/cuda_steps${TORCH_TAG:-}.json"
  [[ $runs == *" cpp_ordered "* ]] && run_torch cpp_ordered timeout 120 "$b/ordered_steps" --target=unix:$sock \
    --shm_socket=$shm --context=4096 --steps=2000
  [[ $runs == *" cpp_ipc "* ]] && run_torch cpp_ipc timeout 150 "$b/ipc_peer" decode --target=unix:$sock \
    --transport=shm --shm_socket=$shm --decode_sequences=1,64 --decode_callers=1 --context=4096 \
    --steps=${IPC_DECODE_STEPS:-1000}
  if [[ $runs == *" engine "* ]] && [ -f client/python/examples/llama_engine.py ]; then
    run_torch engine $py client/python/examples/llama_engine.py --target unix:$sock --transport shm --shm_socket $shm \
      ${ENGINE_FLAGS:-} --json "$OUT/engine.json"
    # The same engine with steps that return after they ran, attnd alone (the lock step above checked the model).
    run_torch engine_wait $py client/python/examples/llama_engine.py --target unix:$sock --transport shm \
      --shm_socket $shm --backend attnd --wait ${ENGINE_FLAGS:-} --json "$OUT/engine_wait.json"
  fi
  "$b/attn" stats --target=unix:$sock >> "$r" 2>&1
  kill -TERM $server
  wait $server
  echo "attnd exit rc=$?" >> "$r"
  { grep -E '\[(warning|error|critical)\]' "$TMP/attnd_torch.log" | head -20; } >> "$r"
  [ "${MPS:-0}" = 1 ] && echo quit | nvidia-cuda-mps-control
  cat "$r" >> "$LOG"
}

# Prefill on one server, move, decode on another (docs/benchmarks.md, "Moving sequences"): two attnd on this GPU,
# each advertising its loopback address, and client/python/bench/move_bench.py between them.
service_move() {
  local b=$1 pa=${PORT:-50091} pb=$(( ${PORT:-50091} + 1 )) r=$OUT/move.txt rc
  "$b/attnd" --listen=127.0.0.1:$pa --advertise_address=127.0.0.1:$pa --log_level=warn --memory_budget_mb=32768 --kv_pool_mb=16384 \
    ${SERVER_FLAGS:-} > "$TMP/attnd_move_a.log" 2>&1 &
  local sa=$!
  "$b/attnd" --listen=127.0.0.1:$pb --advertise_address=127.0.0.1:$pb --log_level=warn --memory_budget_mb=32768 --kv_pool_mb=16384 \
    ${SERVER_FLAGS:-} > "$TMP/attnd_move_b.log" 2>&1 &
  local sb=$! i
  for i in $(seq 1 150); do
    "$b/attn" info --target=127.0.0.1:$pa > /dev/null 2>&1 && "$b/attn" info --target=127.0.0.1:$pb > /dev/null 2>&1 \
      && break
    sleep 0.2
  done
  mkdir -p client/python/attnd/lib && cp -a $C/pylib/. client/python/attnd/lib/
  PYTHONPATH=$PWD/client/python PYTHONDONTWRITEBYTECODE=1 timeout ${MOVE_TIMEOUT:-240} python3 \
    client/python/bench/move_bench.py --source 127.0.0.1:$pa --dest 127.0.0.1:$pb ${MOVE_FLAGS:-} \
    --json "$OUT/move.json" >> "$r" 2>&1
  rc=$?
  kill -TERM $sa $sb
  wait $sa $sb
  { grep -hE '\[(warning|error|critical)\]' "$TMP/attnd_move_a.log" "$TMP/attnd_move_b.log" | head -20; } >> "$r"
  note "service move" "$([ $rc -eq 0 ] && echo ok || echo FAIL)" "$(grep -E '^move ' "$r" | tail -1)"
  cat "$r" >> "$LOG"
}

# The CI soak's traffic (tests/soak/soak.cc: every RPC, every valid Forward checked against the float64 reference,
# cancellations, deadlines, bad input) against one CUDA attnd for SOAK_S seconds after its 60 s warm-up, the
# server's RSS, descriptors and threads sampled every 2 s into soak_samples.csv, the soak's leak rules applied to the
# quiet server before and after. The summary row adds the RSS under load: the run's first and last sixths and the
# spread of its second half (max / min).
service_soak() {
  local b=$1 port=$(( ${PORT:-50051} + 9 )) r=$OUT/soak.txt rc code=0 csv=$OUT/soak_samples.csv
  "$b/attnd" --listen=127.0.0.1:$port --backend=cuda --log_level=warn --shutdown_grace_s=30 ${SERVER_FLAGS:-} \
    > "$TMP/attnd_soak.log" 2>&1 &
  local s=$! i
  for i in $(seq 1 300); do "$b/attn" health --target=127.0.0.1:$port > /dev/null 2>&1 && break; sleep 0.2; done
  timeout $(( ${SOAK_S:-1800} + 240 )) $C/attnd_soak --target=127.0.0.1:$port --server_pid=$s \
    --duration_s="${SOAK_S:-1800}" --csv="$csv" > "$r" 2>&1
  rc=$?
  kill -TERM $s
  wait $s || code=$?
  { echo "attnd exit $code"; grep -hE '\[(error|critical)\]' "$TMP/attnd_soak.log" | head -20; } >> "$r"
  local load
  load=$(python3 - "$csv" <<'PY'
import csv, sys
rows = [r for r in csv.DictReader(open(sys.argv[1]))]
rss = [int(r["rss_kib"]) / 1024 for r in rows]  # every sample is taken under the run's load
if len(rss) < 12:
    print("too few samples"); sys.exit()
k = len(rss) // 6
half = rss[len(rss) // 2:]
print(f"RSS under load first sixth {sum(rss[:k]) / k:.1f} MiB, last sixth {sum(rss[-k:]) / k:.1f} MiB, "
      f"second half {min(half):.1f}-{max(half):.1f} MiB ({max(half) / min(half):.3f}x), {len(rss)} samples")
PY
)
  local ok=FAIL
  [ $rc -eq 0 ] && [ $code -eq 0 ] && ok=ok
  note "service soak" $ok "$(grep -E '^soak: [0-9]+ passed' "$r"); $load"
  cat "$r" >> "$LOG"
}

service_measure() {
  local b=$1 label=$2 port=${PORT:-50051} dur=${DUR:-2s}
  local sock=/tmp/attnd_bench_$port.sock shm=/tmp/attnd_shm_$port.sock r=$TMP/measure_$label.txt
  [ -x "$b/attnd" ] || { note "service bench $label" FAIL "no $b/attnd"; return; }
  rm -f "$sock" "$shm"
  # The unary rows hold up to 16 requests of 100 MB in gRPC's transport at once (docs/security-and-metrics.md).
  local quota=""
  "$b/attnd" --help 2>/dev/null | grep -q -- "--max_transport_memory_bytes" && quota=--max_transport_memory_bytes=8589934592
  "$b/attnd" --listen=127.0.0.1:$port --unix_socket=$sock --shm_socket=$shm --enable_cuda_ipc $quota \
    --streams=${STREAMS:-8} --warm_shapes=1x1024x1024x32x32x128,1x4096x4096x32x32x128 --log_level=info \
    ${SERVER_FLAGS:-} > "$TMP/attnd_$label.log" 2>&1 &
  local server=$! i
  for i in $(seq 1 150); do
    "$b/attn" info --target=unix:$sock > "$r" 2>&1 && break
    sleep 0.2
  done
  echo "== $label: $b" >> "$LOG"
  cat "$r" >> "$LOG"
  : > "$r"
  local seqs=${SEQS:-1024 4096} callers=${CALLERS:-1 16}
  seqs=${seqs// /,}
  callers=${callers// /,}
  timeout 120 "$b/ipc_peer" bench --target=unix:$sock --seqs=$seqs --concurrency=$callers \
    --duration_s=${dur%s} --warmup_s=0.5 --verify_every=25 >> "$r" 2>&1
  echo "ipc_peer bench grpc rc=$?" >> "$r"
  timeout 120 "$b/ipc_peer" bench --target=unix:$sock --transport=shm --shm_socket=$shm --seqs=$seqs \
    --concurrency=$callers --duration_s=${dur%s} --warmup_s=0.5 --verify_every=25 >> "$r" 2>&1
  echo "ipc_peer bench shm rc=$?" >> "$r"
  timeout 60 "$b/ipc_peer" tcp --seqs=$seqs --tcp_iters=20 >> "$r" 2>&1
  local seq tr c
  for seq in ${SEQS:-1024 4096}; do
    for tr in ${TRANSPORTS:-unary stream}; do
      for c in ${CALLERS:-1 16}; do
        rm -f "$TMP/b.csv"
        timeout 60 "$b/attn" bench --target=127.0.0.1:$port --transport=$tr --q_len=$seq --q_heads=32 --head_dim=128 \
          --causal --concurrency=$c --duration=$dur --warmup=0.5s --verify_every=5 --progress=false \
          --tcp_baseline --rpc_floor ${CLIENT_FLAGS:-} --csv="$TMP/b.csv" > "$TMP/b.txt" 2>&1
        echo "attn_bench,$tr,$seq,$c,rc=$?" >> "$r"
        if [ -f "$TMP/b.csv" ]; then sed 's/^/attn_csv,/' "$TMP/b.csv" >> "$r"; else cat "$TMP/b.txt" >> "$r"; fi
        grep -E "verified|error|TCP loopback|RPC floor" "$TMP/b.txt" >> "$r"
      done
    done
  done
  "$b/attn" stats --target=unix:$sock >> "$r" 2>&1
  kill -TERM $server
  wait $server
  echo "attnd exit rc=$?" >> "$r"
  cat "$r" >> "$LOG"
  echo "== $label: attnd's log (warnings, errors, last lines)" >> "$LOG"
  { grep -E '\[(warning|error|critical)\]' "$TMP/attnd_$label.log" | head -20; tail -5 "$TMP/attnd_$label.log"; } >> "$LOG"
  # Rows for the summary: label, mode, seq, callers, p50/p99 us, req/s.
  python3 - "$r" "$label" >> "$TMP/service_rows.txt" << 'PY'
import csv, sys
path, label = sys.argv[1], sys.argv[2]
ipc_header = attn_header = None
for f in csv.reader(open(path)):
    if not f:
        continue
    if f[0] == 'csv' and f[1:3] == ['mode', 'seq'] and 'p50_us' in f:
        ipc_header = f
    elif f[0] == 'csv' and ipc_header and f[1] in ('ipc', 'ipc_shm') and len(f) == len(ipc_header):
        d = dict(zip(ipc_header, f))
        print(f"{label:<6} {d['mode']:<13} {d['seq']:>6} {d['concurrency']:>4} {float(d['p50_us']):>10.1f} "
              f"{float(d['p99_us']):>10.1f} {float(d['req_per_s']):>9.1f}")
    elif f[0] == 'attn_csv' and 'lat_p50_us' in f:
        attn_header = f
    elif f[0] == 'attn_csv' and attn_header and len(f) == len(attn_header):
        d = dict(zip(attn_header, f))
        print(f"{label:<6} {'inline_' + d['transport']:<13} {d['q_len']:>6} {d['concurrency']:>4} "
              f"{float(d['lat_p50_us']):>10.1f} {float(d['lat_p99_us']):>10.1f} {float(d['req_per_s']):>9.1f}")
PY
  if grep -qE 'rc=[1-9]|verify_failures=[1-9]|wrong replies' "$r"; then
    note "service bench $label" FAIL "a measurement failed (see service.log)"
  else
    note "service bench $label" ok "$(grep -c "^$label " "$TMP/service_rows.txt") measurements"
  fi
}

cmd_service() {
  local steps=("$@")
  [ ${#steps[@]} -eq 0 ] && steps=(test bench)
  for s in "${steps[@]}"; do
    case $s in test|bench|ab|python|decode|pyoverhead|torch|move|soak) ;; *) die "service: unknown step $s" ;; esac
  done
  mkdir -p "$OUT"
  unpack
  LOG=$OUT/service.log
  CALLERS=${CALLERS:-1 16}
  env_header | tee -a "$LOG"
  local s t rc f n
  for s in "${steps[@]}"; do
    echo "=== service $s" >> "$LOG"
    n=${#SUMMARY[@]}
    case $s in
      test)
        export ATTND_IPC_PEER=$PWD/$C/ipc_peer
        for t in gpu_server_parts_test gpu_server_forward_test gpu_server_ipc_test gpu_sequences_test \
                 gpu_sequence_moves_test; do
          f=()
          [ $t = gpu_server_forward_test ] && [ -n "${FORWARD_FILTER:-}" ] && f=(--gtest_filter="$FORWARD_FILTER")
          timeout "${SERVICE_TEST_TIMEOUT:-150}" $C/$t --gtest_brief=1 "${f[@]}" > "$TMP/t.log" 2>&1
          rc=$?
          cat "$TMP/t.log" >> "$LOG"
          gtest_result "service $t" $rc "$TMP/t.log"
        done ;;
      bench)
        service_measure "$PWD/$C" new ;;
      decode)
        service_decode "$PWD/$C" ;;
      pyoverhead)
        service_pyoverhead "$PWD/$C" ;;
      torch)
        service_torch "$PWD/$C" ;;
      move)
        service_move "$PWD/$C" ;;
      soak)
        service_soak "$PWD/$C" ;;
      python)
        # The Python client's suite with this machine's Python and torch: CPU-backend servers, and with a GPU its CUDA
        # tests (a --backend=cuda server, torch CUDA tensors by IPC). The package loads its bundled libraries.
        mkdir -p client/python/attnd/lib && cp -a $C/pylib/. client/python/attnd/lib/
        ATTND_SERVER=$PWD/$C/attnd PYTHONPATH=$PWD/client/python PYTHONDONTWRITEBYTECODE=1 \
          timeout "${SERVICE_TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -rs client/python/tests \
          > "$TMP/py.log" 2>&1
        rc=$?
        cat "$TMP/py.log" >> "$LOG"
        if [ $rc -eq 0 ]; then
          note "service python" ok "$(grep -E '[0-9]+ passed' "$TMP/py.log" | tail -1)"
        else
          note "service python" FAIL "rc=$rc; $(grep -E '[0-9]+ (passed|failed)' "$TMP/py.log" | tail -1)"
        fi ;;
      ab)
        service_measure "$PWD/$C" new
        if [ -x $C/base/attnd ]; then
          service_measure "$PWD/$C/base" base
        else
          note "service ab base" FAIL "no $C/base/attnd: build --base REV --base-service"
        fi ;;
    esac
    print_new_rows "$n"
  done
  if [ -s "$TMP/service_rows.txt" ]; then
    {
      echo
      printf '%-6s %-13s %6s %4s %10s %10s %9s\n' build mode seq conc p50_us p99_us req_per_s
      sort -b -k2,2 -k3,3n -k4,4n -k1,1r "$TMP/service_rows.txt"
    } | tee -a "$LOG"
  fi
}

print_summary() {
  [ ${#SUMMARY[@]} -gt 0 ] || return
  {
    echo
    echo "== summary ($(date -u +%H:%M:%SZ); logs in $OUT)"
    printf '%s\n' "${SUMMARY[@]}"
  } | tee -a "${LOG:-/dev/null}"
}

TMP=$(mktemp -d /tmp/attnd-device.XXXXXX)
BASE_SRC=""
cleanup() {
  rm -rf "$TMP"
  [ -z "$BASE_SRC" ] || git worktree remove --force "$BASE_SRC" 2> /dev/null
}
trap cleanup EXIT

case ${1:-} in
  build) shift; cmd_build "$@" ;;
  kernels) shift; cmd_kernels "$@"; print_summary ;;
  service) shift; cmd_service "$@"; print_summary ;;
  -h|--help|help) usage; exit 0 ;;
  *) usage >&2; exit 2 ;;
esac
exit $FAILED

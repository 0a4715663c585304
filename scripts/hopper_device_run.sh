#!/usr/bin/env bash
# One device call for the Hopper kernel family (run on the GPU machine from the repo root, binaries built
# here with -DATTND_STATIC=ON and copied to .carry-hopper/): GPU tests of the hopper configurations,
# compute-sanitizer on small shapes, the SASS check (HGMMA, no local memory) and the benchmark against
# torch SDPA (cuDNN, FA2). Logs go to $OUT (at most 8 files come back).
#   scripts/hopper_device_run.sh [smoke|tests|fewblocks|sanitize|sass|sweep|pairsweep|schedsweep|bench|quickbench|trace|profile]...
#   (default: all but quickbench and trace)
set -uo pipefail
C=.carry-hopper
OUT=${OUT:-/tmp/hopper-out}
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(sass smoke tests sanitize bench)
export LD_LIBRARY_PATH="$PWD/$C/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"  # Debian's absl .so for the C ABI
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv \
  | tee "$OUT/env.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version())' >> "$OUT/env.txt"
for step in "${steps[@]}"; do
  case $step in
    smoke)
      # One small case per head_dim first: a hang here costs 30 s, not the whole call.
      timeout 30 "$C/gpu_attention_test" --gtest_filter='*hopper_sm90_d*_sq129_tl*' 2>&1 | tail -15
      echo "smoke rc=$?" ;;
    tests)
      # Every hopper configuration on the whole case list, the auto choice, and the host-API tests.
      timeout ${TEST_TIMEOUT:-200} "$C/gpu_attention_test" --gtest_filter='*hopper_*:*auto_*:KernelApi*' \
        --gtest_output=xml:"$OUT/gpu_test.xml" > "$OUT/gpu_test.log" 2>&1
      echo "tests rc=$?"; grep -E '^\[  (PASSED|FAILED) |tests? ran|FAILED  \]' "$OUT/gpu_test.log" | tail -40 ;;
    fewblocks)
      # The same cases on a grid of 3 blocks, so every block runs several tiles back to back (the cross-tile
      # handover, Q buffer alternation, empty tiles between full ones).
      ATTND_HOPPER_MAX_BLOCKS=3 timeout ${TEST_TIMEOUT:-200} "$C/gpu_attention_test" --gtest_filter="${FEWBLOCKS_FILTER:-*hopper_*}" \
        > "$OUT/gpu_test_fewblocks.log" 2>&1
      echo "fewblocks rc=$?"; grep -E '^\[  (PASSED|FAILED) |tests? ran|FAILED  \]' "$OUT/gpu_test_fewblocks.log" | tail -40 ;;
    sanitize)
      small='*hopper_sm90_d128_m128n128s2_x_d128_bhsd_none*:*hopper_sm90_d64_m128n128s4_x_d64_q1000kv65_tl*:*hopper_sm90_d128_m128n128s2_x_d128_q1000kv65_br*:*hopper_sm90_d128_m128n128s3_d128_sq129_tl*:*hopper_sm90_d64_m128n128s4_d64_q17kv129_br*:*hopper_sm90_d256_m128n64s2_d256_q17kv129_none*:*hopper_sm90_d128_m128n128s2_d128_b3_gqa8to2_tl*:*hopper_sm90_d64_m192n128s4_polyexp_d64_sq129_br*:*hopper_sm90_d64_m192n128s4_d64_b3_gqa8to2_tl*'
      small=${SANITIZE_FILTER:-$small}
      for tool in ${SANITIZE_TOOLS:-memcheck synccheck racecheck}; do
        # racecheck instruments every shared-memory access: one tiny case only (v1: 90 s were not enough).
        filter=$small; [ $tool = racecheck ] && filter=${RACE_FILTER:-'*hopper_sm90_d128_m128n128s2_d128_sq17_none*'}
        ATTND_HOPPER_MAX_BLOCKS=${SANITIZE_MAX_BLOCKS:-} ATTND_GPU_TEST_SMALL=1 timeout ${SANITIZE_TIMEOUT:-150} compute-sanitizer --tool $tool --error-exitcode 9 "$C/gpu_attention_test" \
          --gtest_filter="$filter" >> "$OUT/sanitizer.log" 2>&1
        echo "sanitizer $tool rc=$?" | tee -a "$OUT/sanitizer.log"
      done
      grep -E 'ERROR SUMMARY|PASSED|FAILED' "$OUT/sanitizer.log" | tail -12 ;;
    sass)
      cuobjdump --dump-sass "$C/gpu_attention_test" > /tmp/all.sass 2>&1
      python3 - "$OUT/sass_summary.txt" <<'PY'
import re, sys
text = open('/tmp/all.sass').read()
funcs = re.split(r'\n\s*Function : ', text)
out = []
for f in funcs[1:]:
    name = f.split('\n', 1)[0].strip()
    if 'HopperFwdKernel' not in name:
        continue
    ops = re.findall(r'/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)', f)
    count = lambda p: sum(1 for o in ops if o.startswith(p))
    out.append(f"{name}\n  instructions {len(ops)}  HGMMA {count('HGMMA')}  HMMA {count('HMMA')}  LDL {count('LDL')}  "
               f"STL {count('STL')}  BAR {count('BAR')}  SYNCS {count('SYNCS')}  UTMALDG {count('UTMALDG')}  "
               f"MUFU.EX2 {count('MUFU.EX2')}  USETMAXREG {count('USETMAXREG')}")
open(sys.argv[1], 'w').write('\n'.join(out) + '\n')
print('\n'.join(out))
PY
      # One kernel's full SASS for the notes (the d128 default m128n128s3, bf16).
      want='HopperFwdKernel.*TileShapeILi128ELi128ELi3ELb1ELb1E.*__nv_bfloat16'
      awk -v w="$want" '/Function : /{p = ($0 ~ w)} p' /tmp/all.sass > "$OUT/sass_d128.txt"
      wc -l "$OUT/sass_d128.txt" ;;
    sweep)
      # The non-causal L2 section budget, one process per value (read once per process): SWEEP_MB in MiB,
      # 0 = no sections (the causal order); unset = the default (24).
      for mb in ${SWEEP_MB:-0 12 24 48}; do
        echo "== ATTND_HOPPER_L2_SECTION_MB=$mb" | tee -a "$OUT/sweep.log"
        ATTND_HOPPER_L2_SECTION_MB=$mb PYTHONUNBUFFERED=1 timeout ${SWEEP_TIMEOUT:-90} python3 kernels/bench/hopper_bench.py \
          --lib "$C/libattnd_kernels_c.so" --configs "${SWEEP_CONFIGS:-hopper}" --causal no --head_dims ${SWEEP_DIMS:-64,128,256} \
          --seqs ${SWEEP_SEQS:-4096,16384} --no-gqa --peers cudnn --rep "${BENCH_REP:-60}" \
          2>&1 | grep -v '^device' | sort -u >> "$OUT/sweep.log"
      done
      cat "$OUT/sweep.log" ;;
    pairsweep)
      # The longest causal problem run in the paired order for its length (q tiles per head), one process per
      # PAIR_SWEEP value (default 16). Longer ones still pair when their K/V exceed ATTND_HOPPER_PAIR_KV_MB
      # (PAIR_KV_MB here; default 32; a huge value turns that rule off, so 0 here then means the snake only).
      for n in ${PAIR_SWEEP:-16 64 128}; do
        echo "== ATTND_HOPPER_PAIR_MAX_QTILES=$n ATTND_HOPPER_PAIR_KV_MB=${PAIR_KV_MB:-}" | tee -a "$OUT/pairsweep.log"
        ATTND_HOPPER_PAIR_KV_MB=${PAIR_KV_MB:-} ATTND_HOPPER_PAIR_MAX_QTILES=$n PYTHONUNBUFFERED=1 timeout ${SWEEP_TIMEOUT:-90} python3 kernels/bench/hopper_bench.py \
          --lib "$C/libattnd_kernels_c.so" --configs "${SWEEP_CONFIGS:-hopper}" --causal yes --head_dims ${SWEEP_DIMS:-128,256} \
          --seqs ${SWEEP_SEQS:-2048,4096,8192,16384} --peers cudnn --rep "${BENCH_REP:-60}" \
          2>&1 | grep -v '^device' | sort -u >> "$OUT/pairsweep.log"
      done
      cat "$OUT/pairsweep.log" ;;
    schedsweep)
      # How causal problems find their tiles, one process per setting (each knob is read once per process):
      # SCHED_SWEEP entries are space-separated, each a comma-separated list of VAR=value for the environment
      # (default: the static order, the dynamic default, a longer dynamic tail, one dynamic LPT section, the
      # static order again for drift).
      sweep=${SCHED_SWEEP:-"ATTND_HOPPER_SCHEDULE=static ATTND_HOPPER_SCHEDULE=dynamic ATTND_HOPPER_TAIL_TILES=8 ATTND_HOPPER_L2_SECTION_MB=0 ATTND_HOPPER_SCHEDULE=static"}
      for setting in $sweep; do
        echo "== $setting" | tee -a "$OUT/schedsweep.log"
        env ${setting//,/ } PYTHONUNBUFFERED=1 timeout ${SWEEP_TIMEOUT:-90} python3 kernels/bench/hopper_bench.py \
          --lib "$C/libattnd_kernels_c.so" --configs "${SWEEP_CONFIGS:-hopper}" --causal yes --head_dims ${SWEEP_DIMS:-64,128,256} \
          ${SWEEP_SEQS:+--seqs $SWEEP_SEQS} --peers cudnn --rep "${BENCH_REP:-60}" \
          2>&1 | grep -v '^device' | sort -u >> "$OUT/schedsweep.log"
      done
      cat "$OUT/schedsweep.log" ;;
    trace)
      # Per-phase cycles of a tile (kernels/cuda/tools/hopper_trace.cu, built by name and copied to $C):
      # TRACE_ARGS is its "config B S H causal" list; empty: d128 s3 at 1k/4k/16k, causal and not.
      timeout ${TRACE_TIMEOUT:-120} "$C/hopper_trace" ${TRACE_ARGS:-} > "$OUT/trace.log" 2>&1
      echo "trace rc=$?"; grep -E '^==|^steady|producer' "$OUT/trace.log" ;;
    profile)
      # Clocks and power under sustained load (kernels/bench/hopper_profile.py power), then one launch each of
      # ours and cuDNN's kernel under ncu (PROFILE_SHAPES, default d128 non-causal 16k). --clock-control none:
      # the card's clocks are left as they are (ncu would otherwise lock them to base).
      PYTHONUNBUFFERED=1 timeout 150 python3 kernels/bench/hopper_profile.py --lib "$C/libattnd_kernels_c.so" power \
        --shapes ${PROFILE_POWER_SHAPES:-d128nc16k,d128c16k,d256nc16k,d64nc16k,d128nc1k,d128c1k} > "$OUT/power.txt" 2>&1
      echo "power rc=$?"; cat "$OUT/power.txt"
      for shape in ${PROFILE_SHAPES:-d128nc16k}; do
        for who in ours cudnn; do
          regex=HopperFwdKernel; [ $who = cudnn ] && regex='cudnn|sdpa|fmha'
          timeout 170 ncu --clock-control none -k "regex:$regex" -s 1 -c 1 --set full --import-source no \
            -o "$OUT/${who}_$shape" python3 kernels/bench/hopper_profile.py --lib "$C/libattnd_kernels_c.so" once \
            --shapes $shape --launches 2 > /dev/null 2>&1
          echo "ncu $who $shape rc=$?"
          ncu --import "$OUT/${who}_$shape.ncu-rep" --page details > "$OUT/${who}_$shape.details.txt" 2>&1
          grep -E "SM Frequency|Duration|Executed Instructions  |Issue Slots Busy|highest-utilized" "$OUT/${who}_$shape.details.txt"
        done
      done ;;
    bench|quickbench)
      extra=""; [ "$step" = quickbench ] && extra="--quick"
      PYTHONUNBUFFERED=1 timeout ${BENCH_TIMEOUT:-200} python3 kernels/bench/hopper_bench.py --lib "$C/libattnd_kernels_c.so" \
        --configs "${HOPPER_BENCH_CONFIGS:-hopper,seed}" --rep "${BENCH_REP:-100}" --json "$OUT/bench.json" $extra > "$OUT/bench.log" 2>&1
      echo "bench rc=$?"; tail -45 "$OUT/bench.log" ;;
  esac
done

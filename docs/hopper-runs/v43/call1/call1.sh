#!/usr/bin/env bash
# v43, call 1 (session 27): P truncated to bf16 (one PRMT a pair, off the MUFU pipe) with O normalised by the tensor
# core's row sums of that P (`_ts`: d64 s6 `_p2`, d128 s3 `_osk_p2`). (1) bs/pipes: EX2 / F2FP / PRMT / FADD / FFMA
# throughput alone and mixed (clock64): is F2FP on the MUFU pipe? (2) ncu pipe utilisation, d64 causal 1k (s6 `_p2`
# against `_ts`) and d128 causal 4k (s3 `_osk_p2` against `_ts`). (3) The library's Hopper suite (the `_ts` entries
# are in it), `_ts` with the dynamic order forced on 3 blocks, memcheck / racecheck. (4) A/B, rotated: base:auto
# (main's library), auto (this library: the same kernels), s6 `_p2`, its `_ts`, d128 `_ts`, cuDNN; d64 / d128, 1k-4k.
# Carry: .carry-hopper/ts.tar.xz (ts/), .carry-hopper/s26c3.tar.xz (v41f/ = main's library), lib/, bs/pipes/pipes.
# bs/pipes/pipes: nvcc -O3 -arch=sm_90a -o bs/pipes/pipes docs/hopper-runs/v43/call1/pipes.cu (on this machine).
# ts/: main at 367ae19 with tensor_sums.diff applied, Release build.
set -u
C=.carry-hopper; W=/tmp/v43c1; mkdir -p $W
trap 'tar czf $OUT/v43c1.tgz -C /tmp v43c1' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
tar xJf $C/ts.tar.xz -C $C && tar xJf $C/s26c3.tar.xz -C $C || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > $W/env.txt; cat $W/env.txt
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/ts/gpu_attention_test; N=$C/ts/libattnd_kernels_c.so; B=$C/v41f/libattnd_kernels_c.so
P=hopper_sm90_d64_m128n128s6_p2; PT=${P}_ts; DT=hopper_sm90_d128_m128n128s3_osk_p2_ts
cuobjdump -sass bs/pipes/pipes | grep -oE 'MUFU\.EX2|F2FP\.[A-Z0-9_.]+|PRMT|FADD|FFMA' | sort | uniq -c > $W/pipes_sass.txt
timeout 60 bs/pipes/pipes > $W/pipes.txt 2>&1; echo "pipes rc=$?"; cat $W/pipes_sass.txt $W/pipes.txt
ncu_pipes() {  # tag lib shape config
  timeout 150 ncu --clock-control none -k "regex:HopperFwdKernel" -s 1 -c 1 --set full --import-source no -o $W/ncu_$1 \
    python3 kernels/bench/hopper_profile.py --lib $2 once --shapes $3 --configs $4 --launches 2 > $W/ncu_$1.log 2>&1
  echo "ncu $1 rc=$? t=$SECONDS"
  ncu --import $W/ncu_$1.ncu-rep --page raw --csv > $W/ncu_$1_raw.csv 2>&1
  python3 - $W/ncu_$1_raw.csv > $W/ncu_$1_pipes.txt <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
i = next(k for k, r in enumerate(rows) if 'Kernel Name' in r)
hdr, units, vals = rows[i], rows[i + 1], rows[i + 2]
for h, u, v in zip(hdr, units, vals):
    if ('pipe' in h and 'pct_of_peak_sustained_active' in h) or h in ('sm__cycles_active.avg', 'smsp__inst_executed.sum',
            'gpu__time_duration.sum', 'sm__cycles_elapsed.avg.per_second', 'Kernel Name'):
        print(f'{h:80s} {v:>16s} {u}')
PY
  gzip -f $W/ncu_$1_raw.csv; rm -f $W/ncu_$1.ncu-rep
  grep -E 'xu|tensor|fma|alu|duration|per_second' $W/ncu_$1_pipes.txt | head -16
}
ncu_pipes d64_p2 $N d64c1024 $P
ncu_pipes d64_ts $N d64c1024 $PT
ncu_pipes d128_p2 $N d128c4096 auto
ncu_pipes d128_ts $N d128c4096 $DT
timeout 240 $T --gtest_filter='*hopper*' > $W/hopper_all.log 2>&1; echo "hopper suite rc=$? t=$SECONDS"; pass $W/hopper_all.log
grep -B3 -A6 'Failure' $W/hopper_all.log | head -60 > $W/failures_head.txt
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 90 $T --gtest_filter="*_ts_*" > $W/ts_dyn3.log 2>&1
echo "_ts, dynamic forced, 3 blocks rc=$? t=$SECONDS"; pass $W/ts_dyn3.log
S="*${PT}_d64_sq1000_tl*:*${PT}_d64_q1000kv65_br*:*${DT}_d128_sq1000_tl*"
for tool in memcheck racecheck; do
  ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 90 compute-sanitizer \
    --tool $tool --error-exitcode 9 $T --gtest_filter="$S" > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done
A=base:auto
cols=($A auto $P $PT $DT cudnn)
for i in 1 2 3 4 5 6; do
  [ $SECONDS -gt 470 ] && break
  o=$(for j in 0 1 2 3 4 5; do echo -n "${cols[$(((i - 1 + j) % 6))]},"; done); o=${o%,}
  PYTHONUNBUFFERED=1 timeout 90 python3 kernels/bench/hopper_bench.py --lib $N --base_lib $B --configs $A,auto,$P,$PT,$DT \
    --peers cudnn --rep 100 --settle_ms 500 --order $o --no-gqa --head_dims 64,128 --seqs 1024,2048,4096 \
    --json $W/ab_$i.json > $W/ab_$i.txt 2>&1
  echo "ab $i ($o) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref $A $W/ab_*.json > $W/ab_summary.txt
python3 kernels/bench/summarize_runs.py --ref $P $W/ab_*.json > $W/ab_summary_p2.txt
python3 kernels/bench/summarize_runs.py --ref cudnn $W/ab_*.json > $W/ab_summary_cudnn.txt
cat $W/ab_summary.txt | cut -c1-220 | head -60
echo "== over s6 _p2"; grep -E '^\(|/ '$P $W/ab_summary_p2.txt | cut -c1-200
echo "== over cudnn"; grep -E '^\(|/ cudnn' $W/ab_summary_cudnn.txt | cut -c1-160

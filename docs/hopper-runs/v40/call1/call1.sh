#!/usr/bin/env bash
# v40, call 1: the dynamic order's tile decode moved into the scheduler thread (the ring carries q_tile / head /
# batch) and the register epilogue's 16-byte stores kept whole (PTX vector store, predicated). Local SASS (nvdisasm):
# d64 s6 `_p2` dynamic kernel, no I2F.RP / MUFU.RCP division left in the consumers' tile loop, epilogue 4 STG.E.128
# a thread where main has 8 STG.E + 2 STG.E.128; R2UR 11 / 72 and 0 LDL/STL as main. Checks, then step parts (base
# and new), then base:s6_p2 / s6_p2 / cuDNN with the order rotated. Carry: .carry-hopper/v40.tar.xz (base/ = main's
# library and hopper_trace, new/ = this tree's library, hopper_trace and stripped gpu_attention_test), lib/.
set -u
C=.carry-hopper; W=/tmp/v40c1; mkdir -p $W
trap 'tar czf $OUT/v40c1.tgz -C /tmp v40c1' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
tar xJf $C/v40.tar.xz -C $C || exit 1
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/new/gpu_attention_test; N=$C/new/libattnd_kernels_c.so; B=$C/base/libattnd_kernels_c.so
for lib in base new; do
  cuobjdump -sass $C/$lib/libattnd_kernels_c.so > $W/sass.txt 2>&1
  awk '/Function :/ {if (f) print f, n, h, u, l; f=$3; n=0; h=0; u=0; l=0} /^ +\/\*[0-9a-f]+\*\// {n++} /HGMMA/ {h++}
       /R2UR/ {u++} /LDL|STL/ {l++} /STG.E.128/ {g++} END {print f, n, h, u, l}' $W/sass.txt > $W/sass_counts_$lib.txt
  grep -c 'STG.E ' $W/sass.txt > $W/stg4_$lib.txt; grep -c 'STG.E.128' $W/sass.txt >> $W/stg4_$lib.txt
  echo "$lib: kernels with LDL/STL: $(awk '$5 > 0' $W/sass_counts_$lib.txt | wc -l); STG.E / STG.E.128: $(tr '\n' ' ' < $W/stg4_$lib.txt)"
done
rm -f $W/sass.txt
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 30 $T \
  --gtest_filter='*s6_p2_d64_packed_qkv_tl*' > $W/smoke.log 2>&1
echo "smoke (dynamic, 3 blocks) rc=$? t=$SECONDS"; pass $W/smoke.log
timeout 200 $T --gtest_filter='*hopper*' > $W/hopper_all.log 2>&1; echo "hopper suite rc=$? t=$SECONDS"; pass $W/hopper_all.log
F='*hopper_sm90_d64_m128n128s6_p2_*:*hopper_sm90_d64_m192n128s4_*'
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 90 $T --gtest_filter="$F" > $W/dyn3.log 2>&1
echo "d64 dynamic forced, 3 blocks rc=$? t=$SECONDS"; pass $W/dyn3.log
ATTND_HOPPER_MAX_BLOCKS=5 ATTND_HOPPER_SCHEDULE=static timeout 90 $T --gtest_filter="$F" > $W/static5.log 2>&1
echo "d64 static, 5 blocks rc=$? t=$SECONDS"; pass $W/static5.log
S='*s6_p2_d64_sq1000_tl*:*s6_p2_d64_q1000kv65_br*:*s6_p2_d64_b2_mqa4to1_br*:*d256_m128n64s2_d256_sq1000_tl*'
for tool in memcheck synccheck racecheck; do
  ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 90 compute-sanitizer --tool $tool \
    --error-exitcode 9 $T --gtest_filter="$S" > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done
for lib in base new; do
  ATTND_HOPPER_SPLIT_TAIL=0 timeout 60 $C/$lib/hopper_trace hopper_sm90_d64_m128n128s6_p2 16 1024 32 1 \
    hopper_sm90_d64_m128n128s6_p2 16 1024 32 0 > $W/trace_$lib.log 2>&1
  echo "trace $lib rc=$?"; grep -E '^==|^steady|^ +[0-9]+ ' $W/trace_$lib.log | cut -c1-200
done
A=base:hopper_sm90_d64_m128n128s6_p2; Bn=hopper_sm90_d64_m128n128s6_p2
orders=("$A,$Bn,cudnn" "$Bn,cudnn,$A" "cudnn,$A,$Bn")
for i in 1 2 3 4 5 6; do
  [ $SECONDS -gt 330 ] && break
  o=${orders[$(((i - 1) % 3))]}
  PYTHONUNBUFFERED=1 timeout 60 python3 kernels/bench/hopper_bench.py --lib $N --base_lib $B --configs $A,$Bn \
    --peers cudnn --rep 100 --settle_ms 500 --order $o --no-gqa --head_dims 64 --seqs 1024,2048,4096 \
    --json $W/ab_$i.json > $W/ab_$i.txt 2>&1
  echo "ab $i ($o) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref $A $W/ab_*.json > $W/ab_summary.txt
python3 kernels/bench/summarize_runs.py --ref cudnn $W/ab_*.json > $W/ab_summary_cudnn.txt
grep -E '^\(| / ' $W/ab_summary.txt | cut -c1-220
echo "== over cudnn"; grep -E '^\(| / cudnn' $W/ab_summary_cudnn.txt | cut -c1-220

#!/usr/bin/env bash
# v37, call 1: v36's `_p2_x` with its descriptors' start addresses shuffled from lane 0 before each step's waits
# (mainloop kEarlyDescs; R2UR 156 -> 37 static, 217 -> 98 dynamic, in the local nvdisasm of the d64 object; the other
# kernels' SASS unchanged). Correctness of `_p2_x`, then A/B against s6 `_p2` (auto's) in the same library, in the
# dynamic order (auto's at these shapes) and with the static order forced.
# Carry: .carry-hopper with t51 (test binary), v51/ (library), lib/.
set -u
C=.carry-hopper; W=/tmp/v37c1; mkdir -p $W
trap 'tar czf $OUT/v37c1.tgz -C /tmp v37c1' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/t51; N=$C/v51/libattnd_kernels_c.so
cuobjdump -sass $N > $W/sass.txt 2>&1
awk '/Function :/ {if (f) print f, n, h, u, l; f=$3; n=0; h=0; u=0; l=0} /^ +\/\*[0-9a-f]+\*\// {n++} /HGMMA/ {h++}
     /R2UR/ {u++} /LDL|STL/ {l++} END {print f, n, h, u, l}' $W/sass.txt > $W/sass_counts_all.txt
grep 'TileShapeILi64ELi128ELi6E' $W/sass_counts_all.txt | awk '{print $2, $3, $4, $5, substr($1, 60, 90)}'
rm -f $W/sass.txt
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 30 $T \
  --gtest_filter='*s6_p2_x_d64_packed_qkv_tl*' > $W/smoke.log 2>&1
echo "smoke (dynamic, 3 blocks) rc=$? t=$SECONDS"; pass $W/smoke.log
F='AllConfigs/GpuAttentionTest.*/*s6_p2_x_d64*'
timeout 90 $T --gtest_filter="$F" > $W/suite.log 2>&1; echo "suite rc=$? t=$SECONDS"; pass $W/suite.log
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 90 $T --gtest_filter="$F" > $W/dyn3.log 2>&1
echo "dynamic forced, 3 blocks rc=$? t=$SECONDS"; pass $W/dyn3.log
ATTND_HOPPER_MAX_BLOCKS=5 ATTND_HOPPER_SCHEDULE=static timeout 90 $T --gtest_filter="$F" > $W/static5.log 2>&1
echo "static, 5 blocks rc=$? t=$SECONDS"; pass $W/static5.log
S='*s6_p2_x_d64_sq1000_tl*:*s6_p2_x_d64_q1000kv65_br*:*s6_p2_x_d64_b2_mqa4to1_br*'
for tool in memcheck synccheck racecheck; do
  ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 90 compute-sanitizer --tool $tool \
    --error-exitcode 9 $T --gtest_filter="$S" > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done
A=hopper_sm90_d64_m128n128s6_p2; B=hopper_sm90_d64_m128n128s6_p2_x
ab() {  # ab <tag> <i> [env...]
  local tag=$1 i=$2; shift 2
  local o=$A,$B; [ $((i % 2)) = 0 ] && o=$B,$A
  env "$@" PYTHONUNBUFFERED=1 timeout 60 python3 kernels/bench/hopper_bench.py --lib $N --configs $o \
    --peers cudnn --rep 100 --settle_ms 500 --peers_last --no-gqa --head_dims 64 \
    --seqs 1024,2048,4096 --json $W/${tag}_$i.json > $W/${tag}_$i.txt 2>&1
  echo "$tag $i ($o) rc=$? t=$SECONDS"
}
for i in 1 2 3 4 5 6 7 8; do [ $SECONDS -gt 330 ] && break; ab dyn $i; done
for i in 1 2 3 4; do [ $SECONDS -gt 440 ] && break; ab static $i ATTND_HOPPER_SCHEDULE=static; done
for tag in dyn static; do
  python3 kernels/bench/summarize_runs.py --ref $A $W/${tag}_*.json > $W/${tag}_summary.txt
  echo "== $tag"; grep -E '^\(|/ hopper' $W/${tag}_summary.txt | cut -c1-200
done

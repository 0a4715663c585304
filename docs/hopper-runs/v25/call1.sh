#!/usr/bin/env bash
# v25 call 1 (prepared in session 19, not run): Q in registers (`_qr`) for d64 m128 `_p2` (auto's shape on the d64
# rows still below cuDNN) and d128 s3. .carry-hopper: that build's test binary (t28), library (v28/), hopper_trace
# (hopper_trace28), main's library (base/), the absl shared libraries (lib/). Correctness (the Q buffer now goes back
# after the tile's first S: the 3-block runs are what caught v12's early release), power and clocks (the point of
# the change is energy per FLOP), step parts, then settled A/Bs. One tarball comes back.
set -u
C=.carry-hopper; W=/tmp/v25c1; mkdir -p $W
trap 'tar czf $OUT/v25c1.tgz -C /tmp v25c1' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/t28
F='*_p2_qr_*:*s3_qr_*'
timeout 150 $T --gtest_filter="$F" > $W/suite.log 2>&1; rc=$?; echo "suite rc=$rc"; pass $W/suite.log
[ $rc = 0 ] || exit 1
for nb in 3 5; do
  ATTND_HOPPER_MAX_BLOCKS=$nb ATTND_HOPPER_SPLIT_TAIL=2 timeout 150 $T --gtest_filter="$F" > $W/blocks$nb.log 2>&1
  echo "$nb blocks, split tails rc=$?"; pass $W/blocks$nb.log
done
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 100 $T --gtest_filter='*_p2_qr_*' > $W/dyn3.log 2>&1
echo "d64 dynamic, 3 blocks rc=$?"; pass $W/dyn3.log
S='*p2_qr_d64_sq129_tl*:*p2_qr_d64_q1000kv65_br*:*s3_qr_d128_sq129_tl*:*s3_qr_d128_ramp_down_none*'
for tool in memcheck synccheck racecheck; do
  f=$S; [ $tool = racecheck ] && f='*p2_qr_d64_sq129_tl*:*s3_qr_d128_sq129_tl*'
  ATTND_HOPPER_MAX_BLOCKS=3 timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 $T --gtest_filter="$f" \
    > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done
cuobjdump -sass $C/v28/libattnd_kernels_c.so > /tmp/v28.sass 2>/dev/null
python3 - <<'PY' > $W/sass_qr.txt
import re
fn=None; out={}
for line in open('/tmp/v28.sass'):
    m=re.search(r'Function : (\S+)', line)
    if m: fn=m.group(1); out[fn]=[0,0,0,0]; continue
    if fn:
        for i,k in enumerate(('LDL','STL','HGMMA','LDSM')):
            if k in line: out[fn][i]+=1
print('[LDL, STL, HGMMA, LDSM] per kernel with Q in registers (TileShape ...Lb1EEE at the end of its parameters)')
for k,v in out.items():
    if 'ELb0ELb1EEE' in k: print(v, k[:170])
PY
head -12 $W/sass_qr.txt
(cd kernels/bench && timeout 150 python3 hopper_profile.py --lib ../../$C/v28/libattnd_kernels_c.so power --seconds 3 \
  --configs hopper_sm90_d64_m128n128s4_p2,hopper_sm90_d64_m128n128s4_p2_qr --shapes d64c1k,d64c2k,d64nc1k) > $W/power_d64.txt 2>&1
echo "power d64 rc=$?"; cat $W/power_d64.txt
(cd kernels/bench && timeout 120 python3 hopper_profile.py --lib ../../$C/v28/libattnd_kernels_c.so power --seconds 3 \
  --configs hopper_sm90_d128_m128n128s3,hopper_sm90_d128_m128n128s3_qr --shapes d128c16k,d128nc16k) > $W/power_d128.txt 2>&1
echo "power d128 rc=$?"; cat $W/power_d128.txt
ATTND_HOPPER_SPLIT_TAIL=0 timeout 100 $C/hopper_trace28 hopper_sm90_d64_m128n128s4_p2 16 1024 32 1 \
  hopper_sm90_d64_m128n128s4_p2_qr 16 1024 32 1 hopper_sm90_d128_m128n128s3 4 4096 16 0 \
  hopper_sm90_d128_m128n128s3_qr 4 4096 16 0 > $W/trace.log 2>&1
echo "trace rc=$?"; grep -E '^==|^step parts' $W/trace.log | cut -c1-260
N=$C/v28/libattnd_kernels_c.so
bench() {  # name i configs head_dims seqs
  PYTHONUNBUFFERED=1 timeout 120 python3 kernels/bench/hopper_bench.py --lib $N --configs $3 --peers cudnn \
    --rep 100 --settle_ms 500 --peers_last --no-gqa --head_dims $4 --seqs $5 --json $W/$1_$2.json > $W/$1_$2.txt 2>&1
  echo "$1 $2 rc=$? t=$SECONDS"
}
for i in 1 2 3 4; do
  [ $SECONDS -gt 450 ] && break
  if [ $((i % 2)) = 1 ]; then o1=auto,hopper_sm90_d64_m128n128s4_p2_qr; o2=hopper_sm90_d128_m128n128s3,hopper_sm90_d128_m128n128s3_qr
  else o1=hopper_sm90_d64_m128n128s4_p2_qr,auto; o2=hopper_sm90_d128_m128n128s3_qr,hopper_sm90_d128_m128n128s3; fi
  bench d64 $i $o1 64 1024,2048,4096
  [ $i -le 2 ] && bench d128 $i $o2 128 1024,16384
done
python3 kernels/bench/summarize_runs.py --ref auto $W/d64_*.json > $W/d64_summary.txt
python3 kernels/bench/summarize_runs.py --ref hopper_sm90_d128_m128n128s3 $W/d128_*.json > $W/d128_summary.txt
grep -E '^\(|_qr / ' $W/d64_summary.txt $W/d128_summary.txt | sed 's/hopper_sm90_//g' | cut -c1-220

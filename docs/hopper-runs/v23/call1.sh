#!/usr/bin/env bash
# v23 call 1 (prepared in session 18, not run): the check in place (`_ck`: exponentials over S, rescale after a failed
# check, S recomputed by mma.sync after an overflow). .carry-hopper: that build's test binary (t25), library (v25/),
# hopper_trace (hopper_trace25). Correctness (the spike case forces the recompute, ramp_down the rescale), where
# 128x176's reported spills sit in the SASS, step parts, then settled A/Bs against auto. One tarball comes back (the
# tool returns only a few files; v22's call lost its logs that way).
set -u
C=.carry-hopper; W=/tmp/v23c1; mkdir -p $W
trap 'tar czf $OUT/v23c1.tgz -C /tmp v23c1' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/t25
timeout 60 $T --gtest_filter='*_ck_*spike_none*:*_ck_*ramp_down_none*' > $W/smoke.log 2>&1
rc=$?; echo "smoke rc=$rc"; pass $W/smoke.log; [ $rc = 0 ] || exit 1
timeout 150 $T --gtest_filter='*_ck_*' > $W/suite.log 2>&1; echo "suite rc=$?"; pass $W/suite.log
timeout 100 $T --gtest_filter='*spike_none*' > $W/spike_all.log 2>&1; echo "spike_none, every config rc=$?"
pass $W/spike_all.log
ATTND_HOPPER_MAX_BLOCKS=3 ATTND_HOPPER_SPLIT_TAIL=2 timeout 150 $T --gtest_filter='*_ck_*' > $W/blocks3.log 2>&1
echo "3 blocks, split tails rc=$?"; pass $W/blocks3.log
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 100 $T --gtest_filter='*d64_m192n128s4_ck_*' \
  > $W/dyn3.log 2>&1; echo "d64 dynamic, 3 blocks rc=$?"; pass $W/dyn3.log
S='*m128n176s2_os_ck_d128_spike_none*:*m192n128s4_ck_d64_q1000kv65_br*:*m128n176s2_os_ck_d128_sq129_tl*:*d256_m128n64s2_ck_d256_sq129_tl*'
for tool in memcheck synccheck racecheck; do
  f=$S; [ $tool = racecheck ] && f='*m128n176s2_os_ck_d128_sq129_tl*:*m192n128s4_ck_d64_sq129_tl*'
  ATTND_HOPPER_MAX_BLOCKS=3 timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 $T --gtest_filter="$f" \
    > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done
# Where the spills ptxas reports for 128x176 _ck sit: local loads/stores per kernel, and the lines around them.
cuobjdump -sass $C/v25/libattnd_kernels_c.so > /tmp/v25.sass 2>/dev/null
python3 - <<'PY' > $W/sass_local.txt
import re
fn=None; out={}
for line in open('/tmp/v25.sass'):
    m=re.search(r'Function : (\S+)', line)
    if m: fn=m.group(1); out[fn]=[0,0,0]; continue
    if fn and ('_ck' in fn or 'ELb1EEE' in fn):
        if 'LDL' in line: out[fn][0]+=1
        if 'STL' in line: out[fn][1]+=1
        if 'CALL' in line: out[fn][2]+=1
for k,v in out.items():
    if v!=[0,0,0]: print(v, k[:160])
PY
grep -n -B3 -A3 'LDL\|STL' /tmp/v25.sass | grep -A6 -B6 'MUFU.EX2' | head -80 > $W/sass_local_near_mufu.txt
echo "sass: $(wc -l < $W/sass_local.txt) kernels with local memory or calls"; head -20 $W/sass_local.txt
a=hopper_sm90_d128_m128n176s2_os
timeout 100 $C/hopper_trace25 $a 1 16384 32 0 ${a}_ck 1 16384 32 0 $a 1 16384 32 1 ${a}_ck 1 16384 32 1 \
  hopper_sm90_d128_m128n128s3_osk_p2 4 4096 16 0 hopper_sm90_d128_m128n128s3_osk_ck 4 4096 16 0 \
  hopper_sm90_d64_m192n128s4 4 4096 32 0 hopper_sm90_d64_m192n128s4_ck 4 4096 32 0 \
  hopper_sm90_d256_m128n64s2 2 8192 8 0 hopper_sm90_d256_m128n64s2_ck 2 8192 8 0 > $W/trace.log 2>&1
echo "trace rc=$?"; grep -E '^==|^steady|^step parts' $W/trace.log
N=$C/v25/libattnd_kernels_c.so
bench() {  # name i configs head_dims seqs
  PYTHONUNBUFFERED=1 timeout 100 python3 kernels/bench/hopper_bench.py --lib $N --configs $3 --peers cudnn \
    --rep 100 --settle_ms 500 --peers_last --no-gqa --head_dims $4 --seqs $5 --json $W/$1_$2.json > $W/$1_$2.txt 2>&1
  echo "$1 $2 rc=$? t=$SECONDS"
}
for i in 1 2 3 4; do
  [ $SECONDS -gt 420 ] && break
  if [ $((i % 2)) = 1 ]; then o1=auto,${a}_ck,hopper_sm90_d128_m128n128s3_osk_ck; o2=auto,hopper_sm90_d64_m192n128s4_ck
    o3=auto,hopper_sm90_d256_m128n64s2_ck
  else o1=hopper_sm90_d128_m128n128s3_osk_ck,${a}_ck,auto; o2=hopper_sm90_d64_m192n128s4_ck,auto
    o3=hopper_sm90_d256_m128n64s2_ck,auto; fi
  bench d128 $i $o1 128 4096,16384
  bench d64 $i $o2 64 1024,2048,8192
  [ $i -le 2 ] && bench d256 $i $o3 256 2048,16384
done
for n in d128 d64 d256; do python3 kernels/bench/summarize_runs.py --ref auto $W/${n}_*.json > $W/${n}_summary.txt; done
grep -E '^\(|/ auto' $W/d128_summary.txt $W/d64_summary.txt $W/d256_summary.txt | grep -v cudnn | sed 's/hopper_sm90_//g'

#!/usr/bin/env bash
# v26 call 1: masked steps skip, per warp, the column runs none of its rows may see (`_sk`). Correctness (suite, few
# blocks with split tails, dynamic order, sanitizers), SASS (is the skip a branch or predicated?), power, A/Bs.
set -u
C=.carry-hopper; W=/tmp/v26c1; mkdir -p $W
trap 'tar czf $OUT/v26c1.tgz -C /tmp v26c1' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
pass() { grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' "$1" | head -12; }
T=$C/t29; N=$C/v29/libattnd_kernels_c.so
F='*_sk_*'
timeout 200 $T --gtest_filter="$F" > $W/suite.log 2>&1; rc=$?; echo "suite rc=$rc"; pass $W/suite.log
[ $rc = 0 ] || exit 1
for nb in 3 5; do
  ATTND_HOPPER_MAX_BLOCKS=$nb ATTND_HOPPER_SPLIT_TAIL=2 timeout 200 $T --gtest_filter="$F" > $W/blocks$nb.log 2>&1
  echo "$nb blocks, split tails rc=$?"; pass $W/blocks$nb.log
done
ATTND_HOPPER_DYNAMIC_MIN_TILES=0 ATTND_HOPPER_MAX_BLOCKS=3 timeout 150 $T --gtest_filter='*d64*_sk_*' > $W/dyn3.log 2>&1
echo "d64 dynamic, 3 blocks rc=$?"; pass $W/dyn3.log
S='*p2_sk_d64_sq129_tl*:*p2_sk_d64_q1000kv65_br*:*m192n128s4_sk_d64_sq1000_tl*:*osk_p2_sk_d128_sq129_tl*:*osk_p2_sk_d128_q63kv4097_br*'
for tool in memcheck synccheck racecheck; do
  f=$S; [ $tool = racecheck ] && f='*p2_sk_d64_sq129_tl*:*osk_p2_sk_d128_sq129_tl*'
  ATTND_HOPPER_MAX_BLOCKS=3 timeout 150 compute-sanitizer --tool $tool --error-exitcode 9 $T --gtest_filter="$f" \
    > $W/san_$tool.log 2>&1
  echo "$tool rc=$?"; grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' $W/san_$tool.log | tail -1; pass $W/san_$tool.log
done
cuobjdump -sass $N > /tmp/v29.sass 2>/dev/null
python3 - <<'PY' > $W/sass.txt
import re
fn=None; out={}
keys=('LDL','STL','HGMMA','MUFU.EX2','@P','BRA','F2FP','WARPGROUP.ARRIVE','WARPSYNC')
for line in open('/tmp/v29.sass'):
    m=re.search(r'Function : (\S+)', line)
    if m: fn=m.group(1); out[fn]=[0]*(len(keys)+1); continue
    if fn:
        for i,k in enumerate(keys):
            if k in line: out[fn][i]+=1
        if 'MUFU.EX2' in line and re.search(r'@!?U?P\d', line): out[fn][-1]+=1
print(list(keys)+['predicated MUFU.EX2'])
for k,v in out.items():
    if 'bfloat16' in k and ('Li64ELi128ELi4' in k or 'Li128ELi128ELi3ELb1ELb1ELi2ELi0ELb0ELi2ELb1' in k): print(v, k[40:150])
PY
cat $W/sass.txt
(cd kernels/bench && timeout 150 python3 hopper_profile.py --lib ../../$N power --seconds 3 \
  --configs hopper_sm90_d64_m128n128s4_p2,hopper_sm90_d64_m128n128s4_p2_sk --shapes d64c1k,d64c2k) > $W/power_d64.txt 2>&1
echo "power d64 rc=$?"; cat $W/power_d64.txt
bench() {  # name i configs head_dims seqs
  PYTHONUNBUFFERED=1 timeout 150 python3 kernels/bench/hopper_bench.py --lib $N --configs $3 --peers cudnn --causal yes \
    --rep 100 --settle_ms 500 --peers_last --no-gqa --head_dims $4 --seqs $5 --json $W/$1_$2.json > $W/$1_$2.txt 2>&1
  echo "$1 $2 rc=$? t=$SECONDS"
}
a64=hopper_sm90_d64_m128n128s4_p2_sk; a128=hopper_sm90_d128_m128n128s3_osk_p2_sk
for i in 1 2 3 4; do
  [ $SECONDS -gt 430 ] && break
  if [ $((i % 2)) = 1 ]; then o1=auto,$a64; o2=auto,$a128; o3=auto,hopper_sm90_d64_m192n128s4_sk
  else o1=$a64,auto; o2=$a128,auto; o3=hopper_sm90_d64_m192n128s4_sk,auto; fi
  bench d64 $i $o1 64 1024,2048,4096
  bench d128 $i $o2 128 1024,2048,4096
  [ $i -le 2 ] && bench d64l $i $o3 64 8192
done
for x in d64 d128 d64l; do python3 kernels/bench/summarize_runs.py --ref auto $W/${x}_*.json > $W/${x}_summary.txt; done
grep -hE '^\(|_sk / ' $W/d64_summary.txt $W/d128_summary.txt $W/d64l_summary.txt | sed 's/hopper_sm90_//g' | cut -c1-220

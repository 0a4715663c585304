#!/usr/bin/env bash
# Session 28, call 7: how much of a d128 causal launch its SMs sit idle (call 6's ncu: causal 4k 84.5% SM-active,
# non-causal 94.1%), by ncu's speed-of-light section (SM active / elapsed cycles) for causal 16k with and without the
# split tail, non-causal 16k, causal 4k with the split tail as chosen (off there) and forced (ATTND_HOPPER_SPLIT_TAIL=2);
# then the bench, default against the forced split tail, d128 causal 4k / 8k / 16k. Carry: .carry-hopper/t28.tar.xz
# (t28/: the library, main at f225fe1), lib/.
set -u
C=.carry-hopper; W=/tmp/s28c7; mkdir -p $W
trap 'tar czf $OUT/s28c7.tgz -C /tmp s28c7' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
tar xJf $C/t28.tar.xz -C $C || exit 1
N=$PWD/$C/t28/libattnd_kernels_c.so
sol() {  # name shape env...
  local name=$1 shape=$2; shift 2
  env "$@" timeout 90 ncu --clock-control none -k "regex:HopperFwdKernel" -s 1 -c 1 --section SpeedOfLight --csv \
    python3 kernels/bench/hopper_profile.py --lib $N once --shapes $shape --configs auto --launches 2 > $W/sol_$name.csv 2>&1
  echo "$name rc=$? t=$SECONDS: $(grep -oE 'HopperFwdKernelO?<[^(]*' $W/sol_$name.csv | head -1 | grep -oE '[0-9], [0-9]>$') \
$(grep -E '"(Elapsed Cycles|SM Active Cycles|Duration)"' $W/sol_$name.csv | awk -F'","' '{printf "%s %s; ", $(NF-2), $NF}')"
}
sol c16k d128c16k ATTND_X=0
sol c16k_nosplit d128c16k ATTND_HOPPER_SPLIT_TAIL=0
sol nc16k d128nc16k ATTND_X=0
sol c4k d128c4096 ATTND_X=0
sol c4k_split d128c4096 ATTND_HOPPER_SPLIT_TAIL=2
sol c8k d128c8192 ATTND_X=0
sol c8k_split d128c8192 ATTND_HOPPER_SPLIT_TAIL=2
for i in 1 2 3 4; do
  [ $SECONDS -gt 200 ] && break
  o=auto,cudnn; [ $((i % 2)) = 0 ] && o=cudnn,auto
  for v in default split; do
    e=ATTND_X=0; [ $v = split ] && e=ATTND_HOPPER_SPLIT_TAIL=2
    env $e PYTHONUNBUFFERED=1 timeout 60 python3 kernels/bench/hopper_bench.py --lib $N --configs auto --peers cudnn \
      --rep 100 --settle_ms 500 --order $o --head_dims 128 --seqs 4096,8192,16384 --causal yes --no-gqa \
      --json $W/${v}_$i.json > $W/${v}_$i.txt 2>&1
    echo "$v $i ($o) rc=$? t=$SECONDS"
  done
done
for v in default split; do
  echo "== $v"; python3 kernels/bench/summarize_runs.py --ref cudnn $W/${v}_*.json | grep -E '^\(|auto / cudnn' | cut -c1-160
done

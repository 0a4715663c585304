#!/usr/bin/env bash
# Session 29, call 1: where a causal d128 launch's SMs go idle (session 28 calls 6-7: ncu has them active 87-89% of
# a causal launch's cycles against 97% without a mask). (1) hopper_trace's timeline on auto's d128 kernel: when each
# block ends, and each round's time and rate per key block; causal 16k with the split tail as chosen and off, causal
# 8k and 4k, non-causal 16k. (2) ncu's per-SM spread of active cycles (min / avg / max over the SMs) and the grid,
# for the same launches through the library, so an idle share from a few idle SMs can be told from one spread over
# all of them. Carry: .carry-hopper/t29.tar.xz (t29/: hopper_trace and libattnd_kernels_c.so, main at f9d5938,
# Release, stripped), lib/ (the absl .so files).
set -u
C=.carry-hopper; W=/tmp/s29c1; mkdir -p $W
trap 'tar czf $OUT/s29c1.tgz -C /tmp s29c1' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
tar xJf $C/t29.tar.xz -C $C || exit 1
N=$PWD/$C/t29/libattnd_kernels_c.so
K=hopper_sm90_d128_m128n128s3_osk_p2
tl() {  # name env args...
  local name=$1 e=$2; shift 2
  env $e timeout 90 $C/t29/hopper_trace --timeline "$@" > $W/tl_$name.txt 2>&1
  echo "timeline $name rc=$? t=$SECONDS"; grep -E '^==|block ends' $W/tl_$name.txt
}
tl c16k ATTND_X=0 $K 1 16384 16 1
tl c16k_nosplit ATTND_HOPPER_SPLIT_TAIL=0 $K 1 16384 16 1
tl c8k ATTND_X=0 $K 2 8192 16 1
tl c4k ATTND_X=0 $K 4 4096 16 1
tl nc16k ATTND_X=0 $K 1 16384 16 0
M=sm__cycles_active.min,sm__cycles_active.avg,sm__cycles_active.max,sm__cycles_elapsed.max,sm__cycles_elapsed.avg
M=$M,launch__grid_size,launch__block_size,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem
M=$M,sm__ctas_launched.sum,sm__ctas_launched.max,sm__ctas_launched.min,gpu__time_duration.sum
spread() {  # name shape env
  env $3 timeout 90 ncu --clock-control none -k "regex:HopperFwdKernel" -s 1 -c 1 --metrics $M --csv \
    python3 kernels/bench/hopper_profile.py --lib $N once --shapes $2 --configs auto --launches 2 > $W/ncu_$1.csv 2>&1
  echo "ncu $1 rc=$? t=$SECONDS"
  grep -E '"(sm__|launch__|gpu__)' $W/ncu_$1.csv | awk -F'","' '{printf "  %s %s %s\n", $(NF-2), $(NF-1), $NF}'
}
spread c16k d128c16k ATTND_X=0
spread c16k_nosplit d128c16k ATTND_HOPPER_SPLIT_TAIL=0
spread c4k d128c4096 ATTND_X=0
spread nc16k d128nc16k ATTND_X=0

#!/usr/bin/env bash
# Session 29, call 2: call 1 found a causal d128 launch's blocks ending up to 13% apart (16k: 1,501-1,698 us, 7.9% of
# the span idle on average; non-causal 0.6%) although the paired order gives every block equal work. Which tiles
# and which SMs run slow: hopper_trace --timeline with ATTND_TRACE_DUMP (one row per block and round: tile, key
# blocks, start, length, SM), causal 16k twice (split tail on, off), 8k, 4k, non-causal 16k. Carry:
# .carry-hopper/t29.tar.xz (t29/: hopper_trace with the dump, libattnd_kernels_c.so of f9d5938), lib/.
set -u
C=.carry-hopper; W=/tmp/s29c2; mkdir -p $W
trap 'tar czf $OUT/s29c2.tgz -C /tmp s29c2' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
tar xJf $C/t29.tar.xz -C $C || exit 1
K=hopper_sm90_d128_m128n128s3_osk_p2
tl() {  # name env args...
  local name=$1 e=$2; shift 2
  env $e ATTND_TRACE_DUMP=$W/dump_$name.csv timeout 90 $C/t29/hopper_trace --timeline "$@" > $W/tl_$name.txt 2>&1
  echo "timeline $name rc=$? t=$SECONDS"; grep -E '^==|block ends' $W/tl_$name.txt
}
tl c16k ATTND_X=0 $K 1 16384 16 1
tl c16k_b ATTND_X=0 $K 1 16384 16 1
tl c16k_nosplit ATTND_HOPPER_SPLIT_TAIL=0 $K 1 16384 16 1
tl c8k ATTND_X=0 $K 2 8192 16 1
tl c4k ATTND_X=0 $K 4 4096 16 1
tl nc16k ATTND_X=0 $K 1 16384 16 0
nvidia-smi -q -d CLOCK,POWER,PERFORMANCE > $W/smi.txt 2>&1

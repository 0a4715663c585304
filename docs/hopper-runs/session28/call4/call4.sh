#!/usr/bin/env bash
# Session 28, call 4: why d128 causal runs ~12% below non-causal at 4k-16k (auto's s3 `_osk_p2`, both): clocks and power
# under sustained load (hopper_profile.py power, ours and cuDNN), and the per-step parts of the probed kernel
# (hopper_trace, split tail off) for causal and non-causal at 4k and 16k.
# Carry: .carry-hopper/t28.tar.xz (t28/: hopper_trace and the library, main at f225fe1, Release), lib/.
set -u
C=.carry-hopper; W=/tmp/s28c4; mkdir -p $W
trap 'tar czf $OUT/s28c4.tgz -C /tmp s28c4' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
tar xJf $C/t28.tar.xz -C $C || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > $W/env.txt; cat $W/env.txt
N=$C/t28/libattnd_kernels_c.so
(cd kernels/bench && timeout 120 python3 hopper_profile.py --lib ../../$N power --configs auto \
  --shapes d128c16k,d128nc16k,d128c4k,d128nc4k --seconds 2) > $W/power.txt 2>&1
echo "power rc=$? t=$SECONDS"; cat $W/power.txt | tail -20
K=hopper_sm90_d128_m128n128s3_osk_p2
ATTND_HOPPER_SPLIT_TAIL=0 timeout 200 $C/t28/hopper_trace $K 1 16384 16 1 $K 1 16384 16 0 $K 4 4096 16 1 $K 4 4096 16 0 \
  > $W/trace.txt 2>&1
echo "trace rc=$? t=$SECONDS"; grep -vE '^ +[0-9]+ ' $W/trace.txt | tail -60

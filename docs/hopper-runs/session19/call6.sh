#!/usr/bin/env bash
# Session 19, call 6: clocks and power under sustained load (hopper_profile.py power: each kernel back to back for
# 3 s, nvidia-smi every 50 ms), main's auto beside cuDNN, two passes: energy per FLOP (TFLOP/s per W) and rate per
# cycle (TFLOP/s per GHz) for the rows the bars still hang on.
set -u
C=.carry-hopper; W=/tmp/s19c6; mkdir -p $W
trap 'tar czf $OUT/s19c6.tgz -C /tmp s19c6' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
for i in 1 2; do
  (cd kernels/bench && timeout 150 python3 hopper_profile.py --lib ../../$C/base/libattnd_kernels_c.so power \
    --configs auto --seconds 3 --shapes d128c16k,d128nc16k,d64c1k,d64c2k,d64nc1k,d256nc16k) > $W/power_$i.txt 2>&1
  echo "pass $i rc=$? t=$SECONDS"; cat $W/power_$i.txt
done

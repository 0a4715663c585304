#!/usr/bin/env bash
# Session 21, call 5: clocks and power under sustained load (hopper_profile power) for main's auto (s6 on the d64
# short rows) beside cuDNN: where the d64 causal 1k gap is, per cycle or per clock.
set -u
C=.carry-hopper; W=/tmp/s21c5; mkdir -p $W
trap 'tar czf $OUT/s21c5.tgz -C /tmp s21c5' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
N=$PWD/$C/v35/libattnd_kernels_c.so
cd kernels/bench
for i in 1 2; do
  PYTHONUNBUFFERED=1 timeout 150 python3 hopper_profile.py --lib $N power --configs auto,hopper_sm90_d64_m128n128s4_p2 \
    --seconds 3 --shapes d64c1k,d64c2k,d64nc1k > $W/power_d64_$i.txt 2>&1
  echo "power d64 $i rc=$? t=$SECONDS"
  PYTHONUNBUFFERED=1 timeout 100 python3 hopper_profile.py --lib $N power --configs auto --seconds 3 --shapes d128c16k \
    > $W/power_d128_$i.txt 2>&1
  echo "power d128 $i rc=$? t=$SECONDS"
done
cat $W/power_*.txt | grep -v '^$' | tail -40

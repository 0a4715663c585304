#!/usr/bin/env bash
# Prepared in session 28, not run (no device time left): where a causal d128 launch's SMs go idle (session 28 calls
# 6-7: ncu has them active 87-89% of a causal launch's cycles against 97% without a mask). hopper_trace's timeline
# mode on auto's d128 kernel: when each block ends, and each round's mean time and rate per key block; causal 16k with
# the split tail as chosen and off, causal 4k, non-causal 16k for reference.
# Carry: .carry-hopper/t28.tar.xz (t28/: hopper_trace and libattnd_kernels_c.so from main at or after 508e2fd, Release:
# `ninja -C build-kernels hopper_trace attnd_kernels_c`, both stripped), lib/ (the absl .so files they need).
set -u
C=.carry-hopper; W=/tmp/tl; mkdir -p $W
trap 'tar czf $OUT/tl.tgz -C /tmp tl' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
tar xJf $C/t28.tar.xz -C $C || exit 1
K=hopper_sm90_d128_m128n128s3_osk_p2
timeout 120 $C/t28/hopper_trace --timeline $K 1 16384 16 1 $K 4 4096 16 1 $K 1 16384 16 0 > $W/timeline.txt 2>&1
echo "timeline rc=$? t=$SECONDS"; grep -E '^==|block ends' $W/timeline.txt
ATTND_HOPPER_SPLIT_TAIL=0 timeout 60 $C/t28/hopper_trace --timeline $K 1 16384 16 1 > $W/timeline_nosplit.txt 2>&1
echo "timeline, split tail off rc=$? t=$SECONDS"; grep -E '^==|block ends' $W/timeline_nosplit.txt

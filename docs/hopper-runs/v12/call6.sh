#!/usr/bin/env bash
# Session 11 call 6: where the O-through-shared-memory kernel's tile change goes at 1k: ncu with per-instruction
# warp-stall sampling on one launch of hopper_sm90_d128_m128n128s3_os (d128 non-causal, B16 S1k H16), as call 2 did
# for s3 and cuDNN.
set -u
C=.carry-hopper; W=/tmp/v12c6; mkdir -p $W
export LD_LIBRARY_PATH=$PWD/$C/lib
timeout 150 ncu --clock-control none -k "regex:HopperFwdKernel" -s 1 -c 1 --set full --import-source no -o $W/os_1k \
  python3 kernels/bench/hopper_profile.py --lib $C/new/libattnd_kernels_c.so once --shapes d128nc1k \
  --configs hopper_sm90_d128_m128n128s3_os --launches 2 > $W/ncu_os.log 2>&1
echo "ncu rc=$?"
ncu --import $W/os_1k.ncu-rep --page details > $W/os_1k_details.txt 2>&1
ncu --import $W/os_1k.ncu-rep --page source --csv --print-source sass > $W/os_1k_source.csv 2>&1
grep -E "SM Frequency|Duration|Executed Instructions  |Issue Slots Busy" $W/os_1k_details.txt
rm -f $W/os_1k.ncu-rep
tar czf $OUT/v12call6.tgz -C /tmp v12c6

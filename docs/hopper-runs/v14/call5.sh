#!/usr/bin/env bash
# Session 12 call 5: where v14's tile change goes. The timeline probes (hopper_trace) on s3 and s3 _osk, d128 non-causal
# 1k and 4k and causal 1k (per-phase cycles of a tile, outputs checked bit-identical to the library's); ncu with
# per-instruction warp-stall sampling on one launch of s3 _osk, non-causal 1k (B16 H16), as v12's call 2 and v13's
# call 6 did for s3 and s3 _os.
set -u
C=.carry-hopper; W=/tmp/v14c5; mkdir -p $W
export LD_LIBRARY_PATH=$PWD/$C/lib
a=hopper_sm90_d128_m128n128s3; b=${a}_osk
timeout 150 $C/hopper_trace $a 16 1024 16 0 $b 16 1024 16 0 $a 4 4096 16 0 $b 4 4096 16 0 $a 16 1024 16 1 $b 16 1024 16 1 \
  > $W/trace.log 2>&1
echo "trace rc=$?"; grep -E '^==|^steady|^ +[0-9]+ |producer' $W/trace.log | head -60
timeout 150 ncu --clock-control none -k "regex:HopperFwdKernel" -s 1 -c 1 --set full --import-source no -o $W/osk_1k \
  python3 kernels/bench/hopper_profile.py --lib $C/new/libattnd_kernels_c.so once --shapes d128nc1k \
  --configs $b --launches 2 > $W/ncu_osk.log 2>&1
echo "ncu rc=$?"
ncu --import $W/osk_1k.ncu-rep --page details > $W/osk_1k_details.txt 2>&1
ncu --import $W/osk_1k.ncu-rep --page source --csv --print-source sass > $W/osk_1k_source.csv 2>&1
gzip $W/osk_1k_source.csv
grep -E "SM Frequency|Duration|Executed Instructions  |Issue Slots Busy" $W/osk_1k_details.txt
rm -f $W/osk_1k.ncu-rep
tar czf $OUT/v14call5.tgz -C /tmp v14c5

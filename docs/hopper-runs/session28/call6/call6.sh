#!/usr/bin/env bash
# Session 28, call 6: ncu on one launch each of d128 causal 4k and non-causal 4k (auto's s3 `_osk_p2`), --set full with
# per-instruction warp samples (source page, SASS), to find the per-cycle loss of the causal launch that the probed
# kernel of call 4 does not show. Summaries by opcode: ../../session27/call4/stalls.py. Carry: .carry-hopper/t28.tar.xz
# (t28/: the library, main at f225fe1), lib/.
set -u
C=.carry-hopper; W=/tmp/s28c6; mkdir -p $W
trap 'tar czf $OUT/s28c6.tgz -C /tmp s28c6' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
tar xJf $C/t28.tar.xz -C $C || exit 1
N=$PWD/$C/t28/libattnd_kernels_c.so
for shape in d128c4096 d128nc4096; do
  timeout 200 ncu --clock-control none -k "regex:HopperFwdKernel" -s 1 -c 1 --set full --import-source no -o $W/$shape \
    python3 kernels/bench/hopper_profile.py --lib $N once --shapes $shape --configs auto --launches 2 > $W/ncu_$shape.log 2>&1
  echo "ncu $shape rc=$? t=$SECONDS"
  ncu --import $W/$shape.ncu-rep --page source --csv --print-source sass > $W/${shape}_source.csv 2>&1
  ncu --import $W/$shape.ncu-rep --page details --csv > $W/${shape}_details.csv 2>&1
  gzip -f $W/${shape}_source.csv $W/${shape}_details.csv; rm -f $W/$shape.ncu-rep
  python3 docs/hopper-runs/session27/call4/stalls.py $W/${shape}_source.csv.gz > $W/${shape}_stalls.txt 2>&1
  head -30 $W/${shape}_stalls.txt | cut -c1-150
  zcat $W/${shape}_details.csv.gz | grep -E '"(Duration|SM Frequency|Executed Instructions|Issue Slots Busy|Warp Cycles Per Issued Instruction|Compute \(SM\) Throughput|Registers Per Thread)"' | awk -F'","' '{print $(NF-2), $(NF-1), $NF}' | head -12
done

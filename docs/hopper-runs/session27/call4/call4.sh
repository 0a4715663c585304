#!/usr/bin/env bash
# Session 27, call 4: where d64 s6 `_p2`'s warps stall at causal 1k (main's library, v41f = 91fbae1's kernels): ncu's
# per-instruction warp-state samples (source page, SASS), to test the lead left by v45 (the register-sourced P V
# wgmmas' issue waiting on the tensor pipe), plus the pipe utilisation of the long d64 rows (m192, causal / none 4k).
# Carry: .carry-hopper/s26c3.tar.xz (v41f/), lib/.
set -u
C=.carry-hopper; W=/tmp/s27c4; mkdir -p $W
trap 'tar czf $OUT/s27c4.tgz -C /tmp s27c4' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
tar xJf $C/s26c3.tar.xz -C $C || exit 1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > $W/env.txt; cat $W/env.txt
B=$C/v41f/libattnd_kernels_c.so
timeout 200 ncu --clock-control none -k "regex:HopperFwdKernel" -s 1 -c 1 --set full --import-source no -o $W/p2_1k \
  python3 kernels/bench/hopper_profile.py --lib $B once --shapes d64c1024 --configs auto --launches 2 > $W/ncu_p2_1k.log 2>&1
echo "ncu p2 1k rc=$? t=$SECONDS"
ncu --import $W/p2_1k.ncu-rep --page source --csv --print-source sass > $W/p2_1k_source.csv 2>&1
ncu --import $W/p2_1k.ncu-rep --page details --csv > $W/p2_1k_details.csv 2>&1
gzip -f $W/p2_1k_source.csv $W/p2_1k_details.csv; rm -f $W/p2_1k.ncu-rep
for shape in d64c4096 d64nc4096; do
  timeout 120 ncu --clock-control none -k "regex:HopperFwdKernel" -s 1 -c 1 --section ComputeWorkloadAnalysis \
    --metrics regex:sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,regex:sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active \
    python3 kernels/bench/hopper_profile.py --lib $B once --shapes $shape --configs auto --launches 2 > $W/ncu_$shape.log 2>&1
  echo "ncu $shape rc=$? t=$SECONDS"; grep -E "HopperFwd|pipe_tensor|pipe_xu|Issue Slots|Pipe" $W/ncu_$shape.log | cut -c1-160 | head -12
done

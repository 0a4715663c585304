#!/usr/bin/env bash
# v33 call 3: where the cross-tile step stands today at d64 (v4's `_x`, static orders only): s4, s4 `_x` and s4 `_p2`
# with every order static (ATTND_HOPPER_SCHEDULE=static; without a mask the order is static anyway), d64 causal
# 1k-4k and non-causal 1k, order rotating, cuDNN last. And the SASS of the library's d64 kernels (instruction,
# HGMMA and R2UR counts per kernel; the whole listing gzipped) to compare `_hf`'s steady loop with auto's.
# Library: call 2's (v44: main + half_first.diff).
set -u
C=.carry-hopper; W=/tmp/v33c3; mkdir -p $W
trap 'tar czf $OUT/v33c3.tgz -C /tmp v33c3' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
N=$C/v44/libattnd_kernels_c.so
cuobjdump -sass $N > $W/sass.txt 2>&1
awk '/Function :/ {if (f) print f, n, h, u; f=$3; n=0; h=0; u=0} /^ +\/\*[0-9a-f]+\*\// {n++} /HGMMA/ {h++} /R2UR/ {u++}
     END {print f, n, h, u}' $W/sass.txt | grep 'ILi64E' > $W/sass_counts_d64.txt
grep -c . $W/sass_counts_d64.txt; gzip -9 $W/sass.txt
rot() { echo $1 | awk -F, -v k=$2 '{n=NF; s=""; for (j=0;j<n;j++) s=s (j?",":"") $(((j+k)%n)+1); print s}'; }
cols=hopper_sm90_d64_m128n128s4,hopper_sm90_d64_m128n128s4_x,hopper_sm90_d64_m128n128s4_p2
for i in 1 2 3 4 5 6; do
  [ $SECONDS -gt 200 ] && break
  o=$(rot $cols $(((i - 1) % 3)))
  ATTND_HOPPER_SCHEDULE=static PYTHONUNBUFFERED=1 timeout 60 python3 kernels/bench/hopper_bench.py --lib $N \
    --configs $o --peers cudnn --rep 100 --settle_ms 500 --peers_last --no-gqa --head_dims 64 --seqs 1024,2048,4096 \
    --json $W/x_$i.json > $W/x_$i.txt 2>&1
  echo "x $i ($o) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref hopper_sm90_d64_m128n128s4 $W/x_*.json > $W/x_summary.txt
grep -E '^\(| / ' $W/x_summary.txt | cut -c1-240

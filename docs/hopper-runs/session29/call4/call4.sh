#!/usr/bin/env bash
# Session 29, call 4: v48's library (the build of call 3, main at the v48 commit): device SASS counts, then the whole
# table with attnd, cuDNN and FA2 rotated through every position (as session 28's call 3), then more processes of
# the headline rows, attnd and cuDNN alternating first, as time allows.
# Carry: .carry-hopper/t30.tar.xz (t30/: v48's library, gpu_attention_test and hopper_trace, Release, stripped), lib/.
set -u
C=.carry-hopper; W=/tmp/s29c4; mkdir -p $W
trap 'tar czf $OUT/s29c4.tgz -C /tmp s29c4' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
tar xJf $C/t30.tar.xz -C $C || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv > $W/env.txt
python3 -c 'import torch; print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version())' >> $W/env.txt
cat $W/env.txt
N=$C/t30/libattnd_kernels_c.so
cuobjdump -sass $N > $W/sass.txt 2>&1
awk '/Function :/ {if (f) print f, n, h, u, l; f=$3; n=0; h=0; u=0; l=0} /^ +\/\*[0-9a-f]+\*\// {n++} /HGMMA/ {h++}
     /R2UR/ {u++} /LDL|STL/ {l++} END {print f, n, h, u, l}' $W/sass.txt > $W/sass_counts.txt
echo "hopper kernels: $(grep -c hopper $W/sass_counts.txt), with LDL/STL: $(awk '$5 > 0 && /hopper/' $W/sass_counts.txt | wc -l)"
rm -f $W/sass.txt
orders=(auto,cudnn,fa2 cudnn,fa2,auto fa2,auto,cudnn)
for i in 1 2 3; do
  PYTHONUNBUFFERED=1 timeout 170 python3 kernels/bench/hopper_bench.py --lib $N --configs auto --peers cudnn,fa2 \
    --rep 100 --settle_ms 500 --order ${orders[$((i - 1))]} --seqs 1024,2048,4096,8192,16384 \
    --json $W/table_$i.json > $W/table_$i.txt 2>&1
  echo "table $i (${orders[$((i - 1))]}) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref cudnn $W/table_*.json > $W/table_summary.txt
for i in 1 2 3 4 5 6; do
  [ $SECONDS -gt 520 ] && break
  o=auto,cudnn; [ $((i % 2)) = 0 ] && o=cudnn,auto
  PYTHONUNBUFFERED=1 timeout 40 python3 kernels/bench/hopper_bench.py --lib $N --configs auto --peers cudnn \
    --rep 100 --settle_ms 500 --order $o --head_dims 128 --seqs 16384 \
    --json $W/head_$i.json > $W/head_$i.txt 2>&1
  echo "headline ($o) rc=$? t=$SECONDS"
done
python3 kernels/bench/summarize_runs.py --ref cudnn $W/head_*.json > $W/head_summary.txt
grep -E '^\(|auto / cudnn' $W/table_summary.txt | cut -c1-200
echo "== headline"; grep -E '^\(|auto / cudnn' $W/head_summary.txt | cut -c1-200

#!/usr/bin/env bash
# v15 call 9 (session 14): is the kernel L2-bound? The final _kv2 (K/V halves multicast into both blocks) against the
# same cluster kernel with each block loading both halves itself (nomc.so: the releases still wait for both
# blocks, only the multicast is gone), each beside s3 _osk in its own process, alternating, non-causal 2k-8k.
set -u
C=.carry-hopper; export LD_LIBRARY_PATH=$PWD/$C/lib; W=/tmp/v15c9; mkdir -p $W
a=hopper_sm90_d128_m128n128s3_osk; b=hopper_sm90_d128_m128n128s3_osk_kv2
for i in 1 2 3 4; do
  lib=$C/new/libattnd_kernels_c.so; tag=mc; [ $((i % 2)) = 0 ] && { lib=$C/nomc.so; tag=nomc; }
  PYTHONUNBUFFERED=1 timeout 90 python3 kernels/bench/hopper_bench.py --lib $lib --configs $a,$b --peers cudnn --rep 30 \
    --head_dims 128 --causal no --seqs 2048,4096,8192 --json $W/${tag}_$i.json > $W/${tag}_$i.txt 2>&1
  echo "== $tag $i rc=$?"; tail -4 $W/${tag}_$i.txt
done
tar czf $OUT/v15call9.tgz -C /tmp v15c9

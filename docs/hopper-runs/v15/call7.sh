#!/usr/bin/env bash
# v15 call 7 (session 14): why _kv2 ran at 0.62x of s3 _osk (call 6). exp7 and exp8 were builds of kv2.diff made
# for this call with -DATTND_KV2_EXP=7 or 8 (the macros were not kept). exp7: the launch's cluster count printed;
# exp8: the same with the remote arrivals at the default (CTA) scope instead of .release.cluster, which kv2.diff
# has now. Both beside s3 _osk, non-causal 4k and 8k, 16 heads; exp7 also with the grid capped
# (ATTND_HOPPER_MAX_BLOCKS).
set -u
C=.carry-hopper; export LD_LIBRARY_PATH=$PWD/$C/lib
a=hopper_sm90_d128_m128n128s3_osk; b=hopper_sm90_d128_m128n128s3_osk_kv2
for n in 7 8; do
  echo "=== exp$n"
  timeout 60 python3 kernels/bench/hopper_bench.py --lib $C/exp$n.so --configs $a,$b --peers cudnn --rep 30 \
    --head_dims 128 --causal no --seqs 4096,8192 > /tmp/b.txt 2>&1
  grep "kv2 launch" /tmp/b.txt | sort | uniq -c; grep -v "kv2 launch" /tmp/b.txt | tail -4
done
for cap in 64 100 120; do
  echo "=== exp7 cap $cap"
  ATTND_HOPPER_MAX_BLOCKS=$cap timeout 60 python3 kernels/bench/hopper_bench.py --lib $C/exp7.so --configs $a,$b --rep 30 \
    --head_dims 128 --causal no --seqs 4096 > /tmp/b.txt 2>&1
  grep "kv2 launch" /tmp/b.txt | sort | uniq -c; grep -v "kv2 launch" /tmp/b.txt | tail -2
done

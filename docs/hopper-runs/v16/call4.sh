#!/usr/bin/env bash
# v16 call 4: more processes of call 3's A/B (this build against 44861c5's, both in each process, order
# alternating): d128 16k (8 processes), d128 causal 1k-8k (6), d256 causal 4k-16k (4).
set -u
C=.carry-hopper; W=/tmp/v16c4; mkdir -p $W
export LD_LIBRARY_PATH=$PWD/$C/lib
N=$C/v16/libattnd_kernels_c.so; B=$C/base/libattnd_kernels_c.so
run() {  # name index extra-args...
  local name=$1 i=$2; shift 2
  local cfg=auto,base:auto; [ $((i % 2)) = 0 ] && cfg=base:auto,auto
  PYTHONUNBUFFERED=1 timeout 100 python3 $C/hopper_bench.py --lib $N --base_lib $B --configs $cfg \
    --peers cudnn --rep 30 --json $W/${name}_$i.json "$@" > $W/${name}_$i.txt 2>&1
  echo "$name $i rc=$?"
}
for i in 1 2 3 4 5 6 7 8; do run long $i --head_dims 128 --seqs 16384; done
for i in 1 2 3 4 5 6; do run short $i --head_dims 128 --causal yes --seqs 1024,2048,4096,8192; done
for i in 1 2 3 4; do run d256 $i --head_dims 256 --causal yes --seqs 4096,8192,16384; done
for n in long short d256; do
  python3 kernels/bench/summarize_runs.py --ref base:auto $W/${n}_*.json | tee $W/${n}_summary.txt
done
tar czf $OUT/v16call4.tgz -C /tmp v16c4

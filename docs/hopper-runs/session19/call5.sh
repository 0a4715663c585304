#!/usr/bin/env bash
# Session 19, call 5: the d64 short rows (causal 1k / 2k, non-causal 1k, the table's rows below cuDNN) under the
# launcher's schedule knobs, one process each (each is read once per process), main's library; then the compiled
# alternatives beside auto.
set -u
C=.carry-hopper; W=/tmp/s19c5; mkdir -p $W
trap 'tar czf $OUT/s19c5.tgz -C /tmp s19c5' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
N=$C/base/libattnd_kernels_c.so
run() {  # tag env... ; configs from $CFG
  local tag=$1; shift
  env "$@" PYTHONUNBUFFERED=1 timeout 60 python3 kernels/bench/hopper_bench.py --lib $N --configs ${CFG:-auto} \
    --peers cudnn --rep 100 --settle_ms 500 --peers_last --no-gqa --head_dims 64 --seqs 1024,2048 \
    --json $W/$tag.json > $W/$tag.txt 2>&1
  echo "$tag rc=$? t=$SECONDS"
}
run default0 X=0
run static ATTND_HOPPER_SCHEDULE=static
run tail4 ATTND_HOPPER_TAIL_TILES=4
run tail16 ATTND_HOPPER_TAIL_TILES=16
run sect0 ATTND_HOPPER_L2_SECTION_MB=0
run sect32 ATTND_HOPPER_L2_SECTION_MB=32
run nopair ATTND_HOPPER_PAIR_MAX_QTILES=0
run default1 X=1
CFG=auto,hopper_sm90_d64_m128n128s4,hopper_sm90_d64_m192n128s4,hopper_sm90_d64_m128n128s4_x run configs X=2
CFG=hopper_sm90_d64_m128n128s4_x,hopper_sm90_d64_m192n128s4,hopper_sm90_d64_m128n128s4,auto run configs2 X=3
for f in $W/*.json; do python3 kernels/bench/summarize_runs.py --ref cudnn $f > ${f%.json}.sum; done
for f in $W/*.sum; do echo "== $(basename $f .sum)"; grep -E '^\(' $f | sed 's/hopper_sm90_//g' | cut -c1-200; done

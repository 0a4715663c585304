#!/usr/bin/env bash
# Session 28, call 5: the causal 16k headline row under the launcher's schedule knobs (main at f225fe1, auto = d128 s3
# `_osk_p2`): default (pairs + split tail), the split tail off (ATTND_HOPPER_SPLIT_TAIL=0), and the snake instead of
# pairs (ATTND_HOPPER_PAIR_KV_MB=1000000: K/V never counts as too big to snake). One knob set per process (they are read
# once), cuDNN beside each, the order alternating. Carry: .carry-hopper/t28.tar.xz (t28/: the library), lib/.
set -u
C=.carry-hopper; W=/tmp/s28c5; mkdir -p $W
trap 'tar czf $OUT/s28c5.tgz -C /tmp s28c5' EXIT
export LD_LIBRARY_PATH=$PWD/$C/lib
tar xJf $C/t28.tar.xz -C $C || exit 1
N=$C/t28/libattnd_kernels_c.so
run() {  # name env...
  local name=$1; shift
  o=auto,cudnn; [ $((i % 2)) = 0 ] && o=cudnn,auto
  env "$@" PYTHONUNBUFFERED=1 timeout 60 python3 kernels/bench/hopper_bench.py --lib $N --configs auto --peers cudnn \
    --rep 100 --settle_ms 500 --order $o --head_dims 128 --seqs 16384 --causal yes --json $W/${name}_$i.json \
    > $W/${name}_$i.txt 2>&1
  echo "$name $i ($o) rc=$? t=$SECONDS"
}
for i in 1 2 3; do
  [ $SECONDS -gt 250 ] && break
  run default ATTND_X=0
  run nosplit ATTND_HOPPER_SPLIT_TAIL=0
  run snake ATTND_HOPPER_PAIR_KV_MB=1000000
done
for n in default nosplit snake; do
  echo "== $n"; python3 kernels/bench/summarize_runs.py --ref cudnn $W/${n}_*.json | grep -E '^\(|auto / cudnn' | cut -c1-160
done

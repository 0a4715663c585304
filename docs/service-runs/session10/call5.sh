#!/usr/bin/env bash
# Session 10 call 5: the final binaries (8fd1a29: the split-tail kernels in the server). GPU server suites; the README
# quickstart's main job; one request whose last round the server splits (batch 12, 64 x 12,288 tokens, 16 heads,
# d128, no mask: 192 tiles on 132 blocks, 60 left over), verified against the double-precision oracle, with the split
# on (default) and off (ATTND_HOPPER_SPLIT_TAIL=0).
set -u
W=/tmp/s10c5; mkdir -p $W
OUT=$W/tests SKIP_IPC=1 SKIP_SHM=1 SKIP_INLINE=1 INLINE_SEQS="" PORT=51000 timeout 200 bash server/cuda/tools/device_run.sh > $W/tests_run.txt 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) |=== .* rc=|^FAIL" $W/tests/tests.log
mkdir -p /tmp/bins && tar xf .carry-cuda/bins.tar.xz -C /tmp/bins
ATTND_BIN_DIR=/tmp/bins timeout 120 bash scripts/quickstart.sh > $W/quickstart.log 2>&1; echo "quickstart rc=$?"
grep -E "backend:|verify:|PASS|FAIL|requests:|quickstart:" $W/quickstart.log | head -8
for mode in "" 0; do
  port=$((51010 + ${mode:-1}))
  ATTND_HOPPER_SPLIT_TAIL=$mode /tmp/bins/attnd --listen=127.0.0.1:$port --log_level=info > $W/attnd_split${mode:-default}.log 2>&1 &
  pid=$!
  for i in $(seq 1 100); do /tmp/bins/attn info --target=127.0.0.1:$port > /dev/null 2>&1 && break; sleep 0.2; done
  for rep in 1 2; do
    timeout 300 /tmp/bins/attn call --target=127.0.0.1:$port --batch=12 --q_len=64 --kv_len=12288 --q_heads=16 --head_dim=128 \
      --verify > $W/call_split${mode:-default}_$rep.txt 2>&1
    echo "split=${mode:-default} call $rep rc=$?"; grep -E "reply:|verify|timing|kernel" $W/call_split${mode:-default}_$rep.txt | head -5
  done
  kill -TERM $pid; wait $pid; echo "attnd exit rc=$?"
done
tar czf $OUT/s10call5.tgz -C /tmp s10c5

#!/usr/bin/env bash
# Session 11 call 4: the binaries of d7653f0, whose unary parse change (ReadForwardRequest) had run on the CPU only.
# GPU server suites; the README quickstart's main job; a request the server splits, in bf16 and fp16 (batch 12,
# 64 x 12,288 tokens, 16 heads, d128, no mask), verified over unary and over stream.
set -u
W=/tmp/s11c4; mkdir -p $W
OUT=$W/tests SKIP_IPC=1 SKIP_SHM=1 SKIP_INLINE=1 INLINE_SEQS="" PORT=51100 timeout 200 bash server/cuda/tools/device_run.sh > $W/tests_run.txt 2>&1
echo "tests rc=$?"; grep -E "^\[  (PASSED|FAILED) |=== .* rc=|^FAIL" $W/tests/tests.log
mkdir -p /tmp/bins && tar xf .carry-cuda/bins.tar.xz -C /tmp/bins
ATTND_BIN_DIR=/tmp/bins timeout 120 bash scripts/quickstart.sh > $W/quickstart.log 2>&1; echo "quickstart rc=$?"
grep -E "backend:|verify: PASS|verify: FAIL|requests:|quickstart:" $W/quickstart.log | head -6
/tmp/bins/attnd --listen=127.0.0.1:51111 --log_level=info > $W/attnd_split.log 2>&1 &
pid=$!
for i in $(seq 1 100); do /tmp/bins/attn info --target=127.0.0.1:51111 > /dev/null 2>&1 && break; sleep 0.2; done
for tr in unary stream; do
  for dt in bf16 fp16; do
    timeout 200 /tmp/bins/attn call --target=127.0.0.1:51111 --batch=12 --q_len=64 --kv_len=12288 --q_heads=16 \
      --head_dim=128 --dtype=$dt --transport=$tr --verify > $W/call_split_${tr}_$dt.txt 2>&1
    echo "$tr $dt rc=$?"; grep -E "reply:|server ms|verify: (PASS|FAIL)" $W/call_split_${tr}_$dt.txt | head -3
  done
done
kill -TERM $pid; wait $pid; echo "attnd exit rc=$?"
tar czf $OUT/s11call4.tgz -C /tmp s11c4

#!/usr/bin/env bash
# Session 11 call 8: the binaries of the commit (auto's _os rule from 4k keys): the _os, auto and API kernel cases;
# the server suites and quickstart; a non-causal request at 4k keys (auto: _os) and one at 2k (auto: s3), verified.
set -u
C=.carry-hopper; W=/tmp/v12c8; mkdir -p $W
export LD_LIBRARY_PATH=$PWD/$C/lib
timeout 150 $C/gpu_attention_test --gtest_filter='*_os_*:*auto_*:KernelApi*' > $W/suite.log 2>&1
echo "suite rc=$?"; grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' $W/suite.log | head -8
OUT=$W/server SKIP_IPC=1 SKIP_SHM=1 SKIP_INLINE=1 INLINE_SEQS="" PORT=51100 timeout 200 bash server/cuda/tools/device_run.sh > $W/server_run.txt 2>&1
echo "server tests rc=$?"; grep -E "^\[  (PASSED|FAILED) |=== .* rc=|^FAIL" $W/server/tests.log
mkdir -p /tmp/bins && tar xf .carry-cuda/bins.tar.xz -C /tmp/bins
ATTND_BIN_DIR=/tmp/bins timeout 120 bash scripts/quickstart.sh > $W/quickstart.log 2>&1; echo "quickstart rc=$?"
grep -E "backend:|verify: PASS|verify: FAIL|requests:|quickstart:" $W/quickstart.log | head -6
/tmp/bins/attnd --listen=127.0.0.1:51111 --log_level=info > $W/attnd.log 2>&1 &
pid=$!
for i in $(seq 1 100); do /tmp/bins/attn info --target=127.0.0.1:51111 > /dev/null 2>&1 && break; sleep 0.2; done
for kv in 4096 2048; do
  for dt in bf16 fp16; do
    timeout 120 /tmp/bins/attn call --target=127.0.0.1:51111 --batch=2 --q_len=2000 --kv_len=$kv --q_heads=8 \
      --kv_heads=2 --head_dim=128 --mask=none --dtype=$dt --verify > $W/call_${kv}_$dt.txt 2>&1
    echo "kv $kv $dt rc=$?"; grep -E "reply:|verify: (PASS|FAIL)" $W/call_${kv}_$dt.txt | head -2
  done
done
kill -TERM $pid; wait $pid; echo "attnd exit rc=$?"
tar czf $OUT/v12call8.tgz -C /tmp v12c8

#!/usr/bin/env bash
# Session 11 call 10: the final binaries (auto: n176 _os from 16k keys, s3 _os without a mask from 4k). The _os, auto
# and API kernel cases; the headline rows (d128 16k, both masks, 16 heads) on auto beside cuDNN, six processes;
# requests at 16k keys through the server (auto: n176 _os), causal and not, bf16 and fp16, verified.
set -u
C=.carry-hopper; W=/tmp/v12c10; mkdir -p $W
export LD_LIBRARY_PATH=$PWD/$C/lib
timeout 200 $C/gpu_attention_test --gtest_filter='*_os_*:*auto_*:KernelApi*' > $W/suite.log 2>&1
echo "suite rc=$?"; grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' $W/suite.log | head -6
for i in 1 2 3 4 5 6; do
  PYTHONUNBUFFERED=1 timeout 60 python3 kernels/bench/hopper_bench.py --lib $C/new/libattnd_kernels_c.so --configs hopper \
    --peers cudnn --rep 40 --head_dims 128 --seqs 16384 --no-gqa --json $W/head_$i.json > $W/head_$i.txt 2>&1
  echo "headline $i rc=$?"
done
python3 - $W <<'PY' | tee $W/headline.txt
import json, sys, statistics as st
w = sys.argv[1]
rows = {}
for i in range(1, 7):
    try: data = json.load(open(f'{w}/head_{i}.json'))
    except Exception as e: print('no json', i, e); continue
    for x in data:
        k = 'causal' if x['causal'] else 'none'
        rows.setdefault(k, {'hopper': [], 'cudnn': [], 'cfg': x.get('hopper_config')})
        for c in ('hopper', 'cudnn'):
            if isinstance(x.get(c), float): rows[k][c].append(x[c])
for k, r in rows.items():
    print(k, r['cfg'], 'attnd', ' '.join('%.0f' % v for v in r['hopper']), 'median %.0f' % st.median(r['hopper']),
          '| cuDNN', ' '.join('%.0f' % v for v in r['cudnn']), 'median %.0f' % st.median(r['cudnn']))
PY
mkdir -p /tmp/bins && tar xf .carry-cuda/bins.tar.xz -C /tmp/bins
/tmp/bins/attnd --listen=127.0.0.1:51111 --log_level=info > $W/attnd.log 2>&1 &
pid=$!
for i in $(seq 1 100); do /tmp/bins/attn info --target=127.0.0.1:51111 > /dev/null 2>&1 && break; sleep 0.2; done
for mask in none causal_bottom_right; do
  for dt in bf16 fp16; do
    timeout 150 /tmp/bins/attn call --target=127.0.0.1:51111 --batch=1 --q_len=256 --kv_len=16384 --q_heads=16 \
      --head_dim=128 --mask=$mask --dtype=$dt --verify > $W/call_16k_${mask}_$dt.txt 2>&1
    echo "16k $mask $dt rc=$?"; grep -E "reply:|verify: (PASS|FAIL)" $W/call_16k_${mask}_$dt.txt | head -2
  done
done
kill -TERM $pid; wait $pid; echo "attnd exit rc=$?"
tar czf $OUT/v12call10.tgz -C /tmp v12c10

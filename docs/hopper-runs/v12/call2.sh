#!/usr/bin/env bash
# Session 11 call 2: (a) the _qr fix (Q freed after the tile's first S, not right after the ldmatrix): the case that
# failed on 3 blocks, repeated, and the _qr suite on 3, 5 and 7 blocks; (b) where a tile change's cycles go at 1k:
# ncu with per-instruction warp-stall sampling on one launch each of ours (s3) and cuDNN at d128 non-causal 1k.
set -u
C=.carry-hopper; W=/tmp/v12c2; mkdir -p $W
export LD_LIBRARY_PATH=$PWD/$C/lib
F='*hopper_sm90_d128_m128n128s3_qr_d128_sections_gqa_tl*'
ATTND_HOPPER_MAX_BLOCKS=3 timeout 90 $C/gpu_attention_test --gtest_filter="$F" --gtest_repeat=30 > $W/repeat.log 2>&1
echo "repeat x30 rc=$?"; grep -c '^\[       OK' $W/repeat.log; grep -c 'FAILED  \]' $W/repeat.log
for nb in 3 5 7; do
  ATTND_HOPPER_MAX_BLOCKS=$nb timeout 90 $C/gpu_attention_test --gtest_filter='*hopper_sm90_d128_m128n128s3_qr_*' > $W/blocks$nb.log 2>&1
  echo "$nb blocks rc=$?"; grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' $W/blocks$nb.log | head -4
done
timeout 60 $C/gpu_attention_test --gtest_filter='*hopper_sm90_d128_m128n128s3_qr_*' > $W/full.log 2>&1
echo "full grid rc=$?"; grep -hE '^\[  (PASSED|FAILED) |FAILED  \]' $W/full.log | head -4
for who in ours cudnn; do
  regex=HopperFwdKernel; [ $who = cudnn ] && regex='cudnn|sdpa|fmha'
  timeout 150 ncu --clock-control none -k "regex:$regex" -s 1 -c 1 --set full --import-source no -o $W/${who}_1k \
    python3 kernels/bench/hopper_profile.py --lib $C/new/libattnd_kernels_c.so once --shapes d128nc1k \
    --configs hopper_sm90_d128_m128n128s3 --launches 2 > $W/ncu_${who}.log 2>&1
  echo "ncu $who rc=$?"
  ncu --import $W/${who}_1k.ncu-rep --page details > $W/${who}_1k_details.txt 2>&1
  ncu --import $W/${who}_1k.ncu-rep --page source --csv --print-source sass > $W/${who}_1k_source.csv 2>&1
  echo "source rows $(wc -l < $W/${who}_1k_source.csv)"
  grep -E "SM Frequency|Duration|Executed Instructions  |Issue Slots Busy|Grid Size|Registers Per" $W/${who}_1k_details.txt
done
python3 - $W <<'PY' | tee $W/stall_summary.txt
import csv, sys, collections
w = sys.argv[1]
for who in ('ours', 'cudnn'):
    try:
        rows = list(csv.reader(open(f'{w}/{who}_1k_source.csv')))
    except Exception as e:
        print(who, 'no csv', e); continue
    hi = next((i for i, r in enumerate(rows) if any('Source' == c for c in r)), None)
    if hi is None:
        print(who, 'no header; first rows:', rows[:3]); continue
    head = rows[hi]
    print(who, 'columns:', [h for h in head if 'stall' in h.lower() or 'Samp' in h][:40])
    tot = collections.Counter()
    for r in rows[hi + 1:]:
        for h, v in zip(head, r):
            if ('Warp Stall Sampling' in h or 'stall' in h.lower()) and v.replace('.', '', 1).isdigit():
                tot[h] += float(v)
    for h, v in tot.most_common(24):
        print(f'  {h:70s} {v:12.0f}')
PY
tar czf $OUT/v12call2.tgz -C /tmp v12c2

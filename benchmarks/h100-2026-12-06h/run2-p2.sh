#!/usr/bin/env bash
# session 8, call 2 (from the repository root): ncu of the owners' combine (dp_verify_finish)
# of top-k 50 rows at pad_bs=8, N=4, fp32, tp=1 with the row split into S column blocks
# (S records per row: the merge of 8 ranks' lists when S=8); SASS-level source counters
export OUT=${OUT:-out}
mkdir -p "$OUT"
cd .devtree
. scripts/device_steps.sh
{ date -u; nvidia-smi -L; cat COMMIT; } > "$OUT/misc.log" 2>&1
args="python3 -m ipc_dpsample bench --ungated --tp 1 --num-tokens 4 --vocab 152064 --pad-bs 8 --dtype fp32 --ops verify_batch_vocab --verify-mix topk50 --verify-baselines read_once --backends onesided --iters 3 --warmup 1 --mode eager --out /tmp/b"
for S in 8 1; do
  IPC_DPSAMPLE_VERIFY_SPLITS=$S IPC_DPSAMPLE_LINEINFO=1 step 120 "$OUT/ncu-fin-s$S.log" \
    ncu --kernel-name dp_verify_finish --launch-skip 2 --launch-count 1 --section SourceCounters \
    --section WarpStateStats --section SpeedOfLight --section LaunchStats --section Occupancy \
    --import-source yes -f -o /tmp/fin-s$S $args
  ncu -i /tmp/fin-s$S.ncu-rep --page source --csv --print-source sass 2>&1 | gzip > "$OUT/fin-s$S-sass.csv.gz"
  ncu -i /tmp/fin-s$S.ncu-rep --print-details all >> "$OUT/ncu-fin-s$S.log" 2>&1
  echo "S=$S $(date -u +%T)" >> "$OUT/misc.log"
done

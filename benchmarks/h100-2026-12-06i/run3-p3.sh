#!/usr/bin/env bash
# session 9, call 3 (from the repository root): the verify kernels alone on one GPU
# (scripts/bench_verify_kernels.py, tp=8 shards, no communication), the one-sided GPU
# tests of this commit, ncu of the combine and of the records kernel at the gated
# bench's pad_bs=8 top-k 50 shape
export OUT=${OUT:-out}
mkdir -p "$OUT"
cd .devtree
. scripts/device_steps.sh >/dev/null
{ date -u; nvidia-smi -L; cat COMMIT; } > "$OUT/misc.log" 2>&1
L="$OUT/bvk.log"
T="$OUT/tests.log"
py=(python3 -X faulthandler -m pytest -q -p no:cacheprovider -rfE --tb=short)
f=tests/test_verify_onesided_gpu.py
export STEP_SIGNAL=ABRT
step 60 "$L" python3 scripts/bench_verify_kernels.py --mix topk50
step 60 "$T" "${py[@]}" $f -k rank_threads
step 40 "$L" python3 scripts/bench_verify_kernels.py --mix temperature
echo "bvk, threads $(date -u +%T)" >> "$OUT/misc.log"
args="python3 scripts/bench_verify_kernels.py --mix topk50 --iters 2"
IPC_DPSAMPLE_LINEINFO=1 step 90 "$OUT/ncu-comb.log" ncu --kernel-name dp_verify_combine \
  --launch-skip 8 --launch-count 1 --section SourceCounters --section WarpStateStats \
  --section SpeedOfLight --section LaunchStats --section Occupancy --section SchedulerStats \
  --import-source yes -f -o /tmp/comb $args
ncu -i /tmp/comb.ncu-rep --page source --csv --print-source sass 2>&1 | gzip > "$OUT/comb-sass.csv.gz"
ncu -i /tmp/comb.ncu-rep --print-details all >> "$OUT/ncu-comb.log" 2>&1
echo "ncu comb $(date -u +%T)" >> "$OUT/misc.log"
step 40 "$T" "${py[@]}" $f -k "different_arguments or refused"
date -u >> "$OUT/misc.log"
cat "$OUT/misc.log"; grep -v "^###" "$L"

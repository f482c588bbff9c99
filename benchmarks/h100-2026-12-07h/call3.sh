#!/usr/bin/env bash
# (run from the repository root as .devrun2.sh, with the exports .devtree_a and .devtree_p beside it;
# OUT=$OUT TOTAL=235 AB_LIMIT=170 bash .devrun2.sh)
# call 3 (session 20): A = main (ONEPASS=1 default) against P = A + IPC_DPSAMPLE_VERIFY_ONEPASS_PREFETCH
# at 2 and 4 on temperature rows (pad_bs=256 fp32/bf16, pad_bs=8), then the GPU test commands of
# P at 4 that fit before TOTAL seconds
cd "$(dirname "$0")" || exit 2
date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader
mkdir -p "$OUT"
A=.devtree_a P=.devtree_p V=IPC_DPSAMPLE_VERIFY_ONEPASS_PREFETCH
TOTAL=${TOTAL:-320}
LIMIT=${AB_LIMIT:-230} OUT=$OUT/ab STEPS="b256 b8" MIXES=temperature \
  bash scripts/device_ab_verify.sh $A $P:$V=2 $P:$V=4 $A
echo "=== tests at $SECONDS s"
LIMIT=$((TOTAL - SECONDS)) OUT=$OUT/tests STEPS=none TESTS=$P:$V=4 \
  bash scripts/device_ab_verify.sh $P | grep -E "passed|failed|error" 
date -u

#!/usr/bin/env bash
# (run from the repository root as .devrun1.sh, with the exports .devtree_a and .devtree_b beside it)
# call 1 (session 20): GPU tests of B (HEAD + temp-queue-shared.patch) with
# IPC_DPSAMPLE_VERIFY_TEMP_ONEPASS=1, then A (main, default 0) vs B:=1 vs A vs B:=1 with
# IPC_DPSAMPLE_VERIFY_CTAS_PER_SM=4 on temperature rows
cd "$(dirname "$0")" || exit 2
date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader
mkdir -p "$OUT"
A=.devtree_a B=.devtree_b
LIMIT=250 OUT=$OUT/tests STEPS=none TESTS=$B:IPC_DPSAMPLE_VERIFY_TEMP_ONEPASS=1 \
  bash scripts/device_ab_verify.sh $B
echo "=== A/B at $SECONDS s"
LIMIT=$((545 - SECONDS)) OUT=$OUT/ab STEPS="b256 b8" MIXES=temperature \
  bash scripts/device_ab_verify.sh $A $B:IPC_DPSAMPLE_VERIFY_TEMP_ONEPASS=1 $A $B:IPC_DPSAMPLE_VERIFY_TEMP_ONEPASS=1,IPC_DPSAMPLE_VERIFY_CTAS_PER_SM=4
date -u

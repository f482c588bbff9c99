#!/usr/bin/env bash
# session 18 call 3: the temperature pass's reverse second read (default 0 vs 1), pad_bs=256
cd "$(dirname "$0")"
LIMIT=150 OUT=$OUT/rev STEPS="b256" MIXES=temperature \
  bash scripts/device_ab_verify.sh .devtree_r .devtree_r:IPC_DPSAMPLE_VERIFY_TEMP_REVERSE=1 .devtree_r

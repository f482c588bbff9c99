#!/usr/bin/env bash
# session 18 call 1: temperature stack A/B, GPU tests with stack+prefetch2, rank-count A/B
cd "$(dirname "$0")"
date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
LIMIT=330 OUT=$OUT/stack STEPS="b256 b8 bvk" MIXES=temperature TESTS=.devtree_m:IPC_DPSAMPLE_VERIFY_TEMP_STACK=1,IPC_DPSAMPLE_VERIFY_PREFETCH_LINES=2 \
  bash scripts/device_ab_verify.sh .devtree_m .devtree_m:IPC_DPSAMPLE_VERIFY_TEMP_STACK=1
echo "=== rank count"
LIMIT=$((575 - SECONDS)) OUT=$OUT/rank STEPS="b8 b256 bvk" MIXES=topk50 \
  bash scripts/device_ab_verify.sh .devtree_m .devtree_m:IPC_DPSAMPLE_VERIFY_RANK_COUNT=1
date -u

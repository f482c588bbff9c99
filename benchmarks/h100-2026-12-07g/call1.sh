#!/usr/bin/env bash
# session 19 call 1: the one-read temperature pass (IPC_DPSAMPLE_VERIFY_TEMP_ONEPASS=1) and
# the reverse second read (IPC_DPSAMPLE_VERIFY_TEMP_REVERSE=1) against the default, same
# export, temperature rows at pad_bs=256 and 8; the kernel alone; then the GPU tests of the
# one-read build
cd "$(dirname "$0")"
date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
mkdir -p "$OUT"
T=.devtree_o
LIMIT=260 OUT=$OUT/ab STEPS="b256 b8" MIXES=temperature \
  bash scripts/device_ab_verify.sh $T $T:IPC_DPSAMPLE_VERIFY_TEMP_ONEPASS=1 $T:IPC_DPSAMPLE_VERIFY_TEMP_REVERSE=1 $T
echo "=== bvk at $SECONDS s"
LIMIT=$((330 - SECONDS)) OUT=$OUT/bvk STEPS="bvk" MIXES=temperature \
  bash scripts/device_ab_verify.sh $T $T:IPC_DPSAMPLE_VERIFY_TEMP_ONEPASS=1
echo "=== tests at $SECONDS s"
LIMIT=$((545 - SECONDS)) OUT=$OUT/tests STEPS=none TESTS=$T:IPC_DPSAMPLE_VERIFY_TEMP_ONEPASS=1 \
  bash scripts/device_ab_verify.sh $T
date -u

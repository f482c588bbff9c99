#!/usr/bin/env bash
# Not run (session 19 had no device time left): the GPU tests of the build with
# IPC_DPSAMPLE_VERIFY_TEMP_ONEPASS=1 (float32 temperature rows of batches without top-k
# rows read once), then that build against the default (0) on temperature rows at
# pad_bs=256 and 8, same export. From the repository root on the device machine, with a
# `git archive` export of main in .devtree_n (its commit in .devtree_n/COMMIT):
#     OUT=out bash benchmarks/h100-2026-12-07g/next-call.sh
# If the tests pass and the bench agrees with call 1, the default becomes 1 (envs.py,
# verify.cuh, tests/test_envs.py, README).
cd "$(dirname "$0")/../.." || exit 2
date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
mkdir -p "$OUT"
T=.devtree_n
LIMIT=240 OUT=$OUT/tests STEPS=none TESTS=$T:IPC_DPSAMPLE_VERIFY_TEMP_ONEPASS=1 \
  bash scripts/device_ab_verify.sh $T
echo "=== A/B at $SECONDS s"
LIMIT=$((520 - SECONDS)) OUT=$OUT/ab STEPS="b256 b8" MIXES=temperature \
  bash scripts/device_ab_verify.sh $T $T:IPC_DPSAMPLE_VERIFY_TEMP_ONEPASS=1 $T
date -u

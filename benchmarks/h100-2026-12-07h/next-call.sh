#!/usr/bin/env bash
# Not run (session 20 had no device time left): the next device call on issue 24.
# 1. On the H200 the issue names (ask for kind nvidia-h200): main's GPU tests and the
#    issue's table (scripts/device_verify.sh without the slow swap + sampler + gather
#    baseline, which the H100 table of this folder's call 2 has).
# 2. Where a float32 temperature row's one read spends its time: ncu source counters of
#    the record kernel without lists (tp=1, V=19008, pad_bs=256), stall samples per SASS
#    instruction (read them here with scripts/ncu_sass_summary.py). Calls 1 and 3 found it
#    waiting neither on its loads (an L2 prefetch 2 or 4 rounds ahead: 3 % slower) nor on
#    registers (64 registers and more CTAs an SM: 3 % slower).
# From the repository root on the device machine, with a `git archive` export of main in
# .devtree_n (its commit in .devtree_n/COMMIT):
#     OUT=$OUT bash benchmarks/h100-2026-12-07h/next-call.sh
cd "$(dirname "$0")/../.." || exit 2
date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader
mkdir -p "$OUT/verify" "$OUT/ncu"
(cd .devtree_n && OUT=$OUT/verify DEADLINE=400 STEPS="triton threads errors b256 b8 tests" \
  bash scripts/device_verify.sh)
echo "=== ncu at $SECONDS s"
(cd .devtree_n && OUT=$OUT/ncu SOURCE=1 MIXES=temperature PADS=256 LIMIT=150 \
  bash scripts/device_ncu_verify.sh)
grep -hE "passed|failed|OK: no point|WRONG" "$OUT"/verify/*.log
date -u

#!/usr/bin/env bash
# Device call 1 for this folder's patches (not run yet: no machine was lent on 2026-12-07,
# twenty-first session). After `bash benchmarks/prepared-2026-12-07i/prep.sh`, copy this
# script to .devrun1.sh at the repository root and run it there, carrying .devtree_m,
# .devtree_f, .devtree_f1 and .devrun1.sh:
#     OUT=$OUT bash .devrun1.sh
# 1. A/B of float32 and bfloat16 temperature rows, gated tp=8 (pad_bs=256 eager, pad_bs=8
#    graph-replayed): main (M), main + the patches (F), F with DV_DRAIN_ROUNDS 1 (F1), then
#    M and F again (drift). Every bench checks each verify point bit for bit first.
# 2. The four GPU test commands of scripts/device_ab_verify.sh on F, with what is left
#    before 560 s.
cd "$(dirname "$0")" || exit 2
date -u
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader
head -n1 .devtree_m/COMMIT .devtree_f/COMMIT .devtree_f1/COMMIT
LIMIT=560 OUT=$OUT/ab STEPS="b256 b8" MIXES=temperature TESTS=.devtree_f \
  bash scripts/device_ab_verify.sh .devtree_m .devtree_f .devtree_f1 .devtree_m .devtree_f
date -u

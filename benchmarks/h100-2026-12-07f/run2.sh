#!/usr/bin/env bash
# session 18 call 2 (in priority order, self-limited to ~510 s): the Philox floor; the GPU
# tests of the default tree (prefetch 2); prefetch 2 vs 0 (and CTAS_PER_SM=2) on
# temperature rows; ncu memory of the temperature record kernel if time is left
cd "$(dirname "$0")"
date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
mkdir -p "$OUT"
(cd .devtree_p && PYTHONPATH=$PWD timeout 60 python3 scripts/bench_philox.py) > "$OUT/philox.log" 2>&1; echo "philox rc=$?"; cat "$OUT/philox.log"
LIMIT=215 OUT=$OUT/tests STEPS=none TESTS=.devtree_p bash scripts/device_ab_verify.sh .devtree_p
echo "=== A/B at $SECONDS s"
LIMIT=$((460 - SECONDS)) OUT=$OUT/ab STEPS="b256 b8" MIXES=temperature \
  bash scripts/device_ab_verify.sh .devtree_p .devtree_p:IPC_DPSAMPLE_VERIFY_PREFETCH_LINES=0 .devtree_p:IPC_DPSAMPLE_VERIFY_CTAS_PER_SM=2
echo "=== ncu at $SECONDS s"
if [ "$SECONDS" -lt 430 ]; then
  (cd .devtree_p && OUT=$OUT/ncu LIMIT=70 SECTIONS="SpeedOfLight MemoryWorkloadAnalysis" MIXES=temperature PADS=256 bash scripts/device_ncu_verify.sh)
  grep -E "dp_verify_push_nolist|DRAM Throughput|Duration|L2 Hit Rate|Memory Throughput|Mem Busy|L1/TEX Hit" -r "$OUT/ncu" | head -40
fi
date -u

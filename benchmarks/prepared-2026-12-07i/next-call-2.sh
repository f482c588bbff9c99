#!/usr/bin/env bash
# Device call 2 (not run yet): the issue's table and GPU tests on the H200 the issue names
# (scripts/device_verify.sh: Triton parity, one-sided tests, pad_bs=256 and pad_bs=8
# benches, the swap + sampler + gather baseline; before DEADLINE s, default 480), then,
# if a minute is left, ncu source counters of a float32 temperature row's one read
# (scripts/device_ncu_verify.sh, SOURCE=1; read them here with scripts/ncu_sass_summary.py).
# TREE: the export to run (.devtree_f if call 1 found F faster and its tests passed, else
# .devtree_m). From the repository root:
#     TREE=.devtree_f OUT=$OUT bash .devrun2.sh
cd "$(dirname "$0")" || exit 2
date -u
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader
tree=${TREE:-.devtree_m}
head -n1 "$tree/COMMIT"
mkdir -p "$OUT/verify" "$OUT/ncu"
(cd "$tree" && OUT=$OUT/verify DEADLINE=${DEADLINE:-480} bash scripts/device_verify.sh)
grep -hE "passed|failed|OK: no point|WRONG" "$OUT"/verify/*.log
left=$((570 - SECONDS))
if [ "$left" -ge 60 ]; then
  echo "=== ncu at $SECONDS s"
  (cd "$tree" && OUT=$OUT/ncu SOURCE=1 MIXES=temperature PADS=256 LIMIT=$left \
    bash scripts/device_ncu_verify.sh)
else
  echo "=== no time left for ncu ($left s): run it in a call of its own"
fi
date -u

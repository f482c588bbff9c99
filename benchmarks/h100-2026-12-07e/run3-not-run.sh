#!/usr/bin/env bash
# call 3 (2026-12-07 session 17): F = issue24-prefetch-temp (the record kernel without top-k
# lists asks L2 for 2 lines a thread of its next row); its GPU tests, then A/B at pad_bs=256
# temperature against A = main 7a06411 while the time lasts.
export OUT=${OUT:-out}
mkdir -p "$OUT"
. scripts/device_steps.sh >/dev/null
ab_misc .devtree_a .devtree_f
export STEP_SIGNAL=ABRT
LIMIT=${LIMIT:-240}
fits() { [ $((SECONDS + $1)) -lt "$LIMIT" ]; }
A=.devtree_a F=.devtree_f
f=tests/test_verify_onesided_gpu.py
fits 40 && step_in $F 70 tests-f.log "${GPU_PYTEST[@]}" $f -k rank_threads
fits 25 && step_in $F 40 tests-f.log "${GPU_PYTEST[@]}" $f -k "different_arguments or refused"
fits 35 && step_in $F 50 tests-f.log "${GPU_PYTEST[@]}" tests/test_nccl_verify_gpu.py tests/test_triton_parity_gpu.py
fits 100 && step_in $F 130 tests-f.log "${GPU_PYTEST[@]}" $f -k "processes or real_vocabulary or graph_replayed"
for t in $F $A; do
  fits 30 && { echo "== $t temperature" >> "$OUT/bench-b256.log"; step_in $t 45 bench-b256.log python3 -m ipc_dpsample bench "${B256[@]}" --verify-mix temperature; }
done
date -u >> "$OUT/misc.log"
cat "$OUT/misc.log"
grep -h "^== \|^onesided  \(float32\|bfloat16\)\|no point failed\|FAIL\|Error" "$OUT"/bench-b256.log 2>/dev/null | cut -c1-150
grep -h "passed\|failed\|error" "$OUT"/tests-*.log

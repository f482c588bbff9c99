#!/usr/bin/env bash
# session 16, call 2: M = main (.devtree_a, d3290f9), R = branch issue24-ring (.devtree_r):
# the first pass's cp.async ring (IPC_DPSAMPLE_VERIFY_RING, default 8; 0 = M's path).
# Benches first (each verify point checked bit for bit before timing), then R's GPU tests.
export OUT=${OUT:-out}
mkdir -p "$OUT"
{ date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; for d in .devtree_a .devtree_r; do echo "$d $(cat $d/COMMIT)"; done; } > "$OUT/misc.log" 2>&1
. scripts/device_steps.sh >/dev/null
COMMON="--gated --tp 8 --num-tokens 4 --vocab 152064 --backends onesided --iters 10 --warmup 3 --ops verify_batch_vocab"
B8="$COMMON --pad-bs 8 --mode graph --dtype fp32 --verify-baselines argmax_batch_vocab"
B256="$COMMON --pad-bs 256 --mode eager --dtype fp32,bf16 --verify-baselines read_once"
PY=(python3 -X faulthandler -m pytest -q -p no:cacheprovider -rfE --tb=short)
f=tests/test_verify_onesided_gpu.py
export STEP_SIGNAL=ABRT
LIMIT=${LIMIT:-585}
fits() { [ $((SECONDS + $1)) -lt $LIMIT ]; }
fits 40 && step_in .devtree_a 50 bvk-a.log python3 scripts/bench_verify_kernels.py --mix topk50
for r in 8 16 0; do fits 40 && IPC_DPSAMPLE_VERIFY_RING=$r step_in .devtree_r 50 bvk-r$r.log python3 scripts/bench_verify_kernels.py --mix topk50; done
fits 50 && step_in .devtree_a 70 bench-b256.log python3 -m ipc_dpsample bench $B256 --verify-mix topk50
for r in 8 16 4; do fits 50 && IPC_DPSAMPLE_VERIFY_RING=$r step_in .devtree_r 70 bench-b256-r$r.log python3 -m ipc_dpsample bench $B256 --verify-mix topk50; done
fits 40 && step_in .devtree_a 60 bench-b256.log python3 -m ipc_dpsample bench $B256 --verify-mix temperature
fits 40 && step_in .devtree_r 60 bench-b256-r8.log python3 -m ipc_dpsample bench $B256 --verify-mix temperature
for m in topk50 temperature; do
  fits 25 && step_in .devtree_a 35 bench-b8.log python3 -m ipc_dpsample bench $B8 --verify-mix $m
  fits 25 && step_in .devtree_r 35 bench-b8-r8.log python3 -m ipc_dpsample bench $B8 --verify-mix $m
done
fits 40 && step_in .devtree_r 70 tests-r.log "${PY[@]}" $f -k rank_threads
fits 25 && step_in .devtree_r 40 tests-r.log "${PY[@]}" $f -k "different_arguments or refused"
fits 35 && step_in .devtree_r 50 tests-r.log "${PY[@]}" tests/test_nccl_verify_gpu.py tests/test_triton_parity_gpu.py
fits 100 && step_in .devtree_r 130 tests-r.log "${PY[@]}" $f -k "processes or real_vocabulary or graph_replayed"
date -u >> "$OUT/misc.log"
cat "$OUT/misc.log"; grep -h "dp_verify_combine, the whole\|dp_verify_records, one\|checked bit\|WRONG\|Error" "$OUT"/bvk-*.log | cut -c1-160; for l in "$OUT"/bench-b*.log; do echo "== $l"; grep -h "^# ipc-dpsample bench\|^onesided  \(float32\|bfloat16\)\|no point failed\|FAIL\|Error" $l | cut -c1-170; done; grep -h "passed\|failed\|error" "$OUT"/tests-*.log 2>/dev/null | tail -12

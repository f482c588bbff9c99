#!/usr/bin/env bash
# session 16, call 1: M = main (.devtree_a), P = issue24-pass1 (.devtree_p),
# T = issue24-thr (.devtree_t, on P). Benches of all three, then GPU tests of T, then P.
export OUT=${OUT:-out}
mkdir -p "$OUT"
{ date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; for d in .devtree_a .devtree_p .devtree_t; do echo "$d $(cat $d/COMMIT)"; done; } > "$OUT/misc.log" 2>&1
. scripts/device_steps.sh >/dev/null
COMMON="--gated --tp 8 --num-tokens 4 --vocab 152064 --backends onesided --iters 10 --warmup 3 --ops verify_batch_vocab"
B8="$COMMON --pad-bs 8 --mode graph --dtype fp32 --verify-baselines argmax_batch_vocab"
B256="$COMMON --pad-bs 256 --mode eager --dtype fp32,bf16 --verify-baselines read_once"
PY=(python3 -X faulthandler -m pytest -q -p no:cacheprovider -rfE --tb=short)
f=tests/test_verify_onesided_gpu.py
export STEP_SIGNAL=ABRT
LIMIT=${LIMIT:-585}
fits() { [ $((SECONDS + $1)) -lt $LIMIT ]; }
for k in a p t; do fits 50 && step_in .devtree_$k 70 bvk-$k.log python3 scripts/bench_verify_kernels.py --mix topk50; done
for k in a p t; do fits 50 && step_in .devtree_$k 70 bench-b256.log python3 -m ipc_dpsample bench $B256 --verify-mix topk50; done
for k in a p t; do fits 25 && step_in .devtree_$k 35 bench-b8.log python3 -m ipc_dpsample bench $B8 --verify-mix topk50; done
for k in a p t; do fits 40 && step_in .devtree_$k 60 bench-b256.log python3 -m ipc_dpsample bench $B256 --verify-mix temperature; done
for k in a p t; do fits 25 && step_in .devtree_$k 35 bench-b8.log python3 -m ipc_dpsample bench $B8 --verify-mix temperature; done
for k in t p; do
fits 40 && step_in .devtree_$k 70 tests-$k.log "${PY[@]}" $f -k rank_threads
fits 25 && step_in .devtree_$k 40 tests-$k.log "${PY[@]}" $f -k "different_arguments or refused"
fits 35 && step_in .devtree_$k 50 tests-$k.log "${PY[@]}" tests/test_nccl_verify_gpu.py tests/test_triton_parity_gpu.py
fits 100 && step_in .devtree_$k 130 tests-$k.log "${PY[@]}" $f -k "processes or real_vocabulary or graph_replayed"
done
date -u >> "$OUT/misc.log"
cat "$OUT/misc.log"; grep -h "dp_verify_combine, the whole\|dp_verify_records, one\|checked bit\|WRONG\|Error" "$OUT"/bvk-*.log; for l in "$OUT"/bench-b*.log; do echo "== $l"; grep -h "^# ipc-dpsample bench\|^onesided  \(float32\|bfloat16\)\|no point failed\|FAIL" $l | cut -c1-200; done; grep -h "passed\|failed\|error" "$OUT"/tests-*.log 2>/dev/null

#!/usr/bin/env bash
# session 15, call 2: M = main (.devtree_a), N = issue24-lean (.devtree_n: max.NaN in the
# first pass, the top-k key list by range tests and atomics).
export OUT=${OUT:-out}
mkdir -p "$OUT"
{ date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; for d in .devtree_a .devtree_n; do echo "$d $(cat $d/COMMIT)"; done; } > "$OUT/misc.log" 2>&1
. scripts/device_steps.sh >/dev/null
COMMON="--gated --tp 8 --num-tokens 4 --vocab 152064 --backends onesided --iters 10 --warmup 3 --ops verify_batch_vocab"
B8="$COMMON --pad-bs 8 --mode graph --dtype fp32 --verify-baselines argmax_batch_vocab"
B256="$COMMON --pad-bs 256 --mode eager --dtype fp32,bf16 --verify-baselines read_once"
PY=(python3 -X faulthandler -m pytest -q -p no:cacheprovider -rfE --tb=short)
f=tests/test_verify_onesided_gpu.py
export STEP_SIGNAL=ABRT
LIMIT=${LIMIT:-580}
fits() { [ $((SECONDS + $1)) -lt $LIMIT ]; }
fits 30 && step_in .devtree_a 45 bvk-M.log python3 scripts/bench_verify_kernels.py --mix topk50
fits 30 && step_in .devtree_n 45 bvk-N.log python3 scripts/bench_verify_kernels.py --mix topk50
fits 50 && step_in .devtree_a 70 bench-b256.log python3 -m ipc_dpsample bench $B256 --verify-mix topk50
fits 50 && step_in .devtree_n 70 bench-b256.log python3 -m ipc_dpsample bench $B256 --verify-mix topk50
fits 40 && step_in .devtree_n 70 tests-N.log "${PY[@]}" $f -k rank_threads
fits 30 && step_in .devtree_n 40 tests-N.log "${PY[@]}" $f -k "different_arguments or refused"
fits 40 && step_in .devtree_n 50 tests-N.log "${PY[@]}" tests/test_nccl_verify_gpu.py tests/test_triton_parity_gpu.py
fits 110 && step_in .devtree_n 130 tests-N.log "${PY[@]}" $f -k "processes or real_vocabulary or graph_replayed"
fits 50 && IPC_DPSAMPLE_VERIFY_UNROLL=4 step_in .devtree_n 70 bench-b256-u4.log python3 -m ipc_dpsample bench $B256 --verify-mix topk50
fits 40 && step_in .devtree_a 60 bench-b256.log python3 -m ipc_dpsample bench $B256 --verify-mix temperature
fits 40 && step_in .devtree_n 60 bench-b256.log python3 -m ipc_dpsample bench $B256 --verify-mix temperature
for k in a n; do fits 25 && step_in .devtree_$k 35 bench-b8.log python3 -m ipc_dpsample bench $B8 --verify-mix topk50; done
for k in a n; do fits 25 && step_in .devtree_$k 35 bench-b8.log python3 -m ipc_dpsample bench $B8 --verify-mix temperature; done
date -u >> "$OUT/misc.log"
cat "$OUT/misc.log"; grep -h "dp_verify_combine, the whole\|dp_verify_records, one\|checked bit\|WRONG\|Error" "$OUT"/bvk-*.log; for l in "$OUT"/bench-b*.log; do echo "== $l"; grep -h "onesided verify_batch_vocab \[\|onesided read_once \|onesided argmax_batch_vocab \|no point failed\|FAIL" $l | cut -c1-200; done; grep -h "passed\|failed\|error" "$OUT"/tests-*.log 2>/dev/null

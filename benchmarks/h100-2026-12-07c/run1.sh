#!/usr/bin/env bash
# session 15, call 1: M = main (.devtree_a), P = issue24-prefetch (.devtree_p: record CTAs
# prefetch their next row into L2), L = issue24-list-unroll (.devtree_l).
export OUT=${OUT:-out}
mkdir -p "$OUT"
{ date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; for d in .devtree_a .devtree_p .devtree_l; do echo "$d $(cat $d/COMMIT)"; done; } > "$OUT/misc.log" 2>&1
. scripts/device_steps.sh >/dev/null
COMMON="--gated --tp 8 --num-tokens 4 --vocab 152064 --backends onesided --iters 10 --warmup 3 --ops verify_batch_vocab"
B8="$COMMON --pad-bs 8 --mode graph --dtype fp32 --verify-baselines argmax_batch_vocab"
B256="$COMMON --pad-bs 256 --mode eager --dtype fp32,bf16 --verify-baselines read_once"
PY=(python3 -X faulthandler -m pytest -q -p no:cacheprovider -rfE --tb=short)
f=tests/test_verify_onesided_gpu.py
export STEP_SIGNAL=ABRT
LIMIT=${LIMIT:-575}
fits() { [ $((SECONDS + $1)) -lt $LIMIT ]; }
fits 30 && step_in .devtree_a 45 bvk-M.log python3 scripts/bench_verify_kernels.py --mix topk50
fits 30 && step_in .devtree_p 45 bvk-P.log python3 scripts/bench_verify_kernels.py --mix topk50
fits 50 && step_in .devtree_a 70 bench-b256.log python3 -m ipc_dpsample bench $B256 --verify-mix topk50
fits 50 && step_in .devtree_p 70 bench-b256.log python3 -m ipc_dpsample bench $B256 --verify-mix topk50
fits 50 && step_in .devtree_a 70 bench-b256.log python3 -m ipc_dpsample bench $B256 --verify-mix temperature
fits 50 && step_in .devtree_p 70 bench-b256.log python3 -m ipc_dpsample bench $B256 --verify-mix temperature
fits 50 && IPC_DPSAMPLE_VERIFY_PREFETCH=2 step_in .devtree_p 70 bench-b256-p2.log python3 -m ipc_dpsample bench $B256 --verify-mix topk50
fits 50 && IPC_DPSAMPLE_VERIFY_UNROLL=4 step_in .devtree_p 70 bench-b256-u4.log python3 -m ipc_dpsample bench $B256 --verify-mix topk50
fits 40 && step_in .devtree_p 50 tests-P.log "${PY[@]}" $f -k rank_threads
fits 30 && step_in .devtree_p 40 tests-P.log "${PY[@]}" $f -k "different_arguments or refused"
fits 30 && step_in .devtree_a 40 bench-b8.log python3 -m ipc_dpsample bench $B8 --verify-mix topk50
fits 30 && step_in .devtree_p 40 bench-b8.log python3 -m ipc_dpsample bench $B8 --verify-mix topk50
date -u >> "$OUT/misc.log"
cat "$OUT/misc.log"; grep -h "dp_verify_combine, the whole\|dp_verify_records, one\|checked bit\|WRONG\|Error" "$OUT"/bvk-*.log; for l in "$OUT"/bench-b*.log; do echo "== $l"; grep -h "onesided verify_batch_vocab \[\|read_once \[\|argmax_batch_vocab \[\|no point failed\|FAIL\|^### python" $l | cut -c1-220; done; grep -h "passed\|failed\|error" "$OUT"/tests-*.log 2>/dev/null

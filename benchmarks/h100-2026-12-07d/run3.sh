#!/usr/bin/env bash
# session 16, call 3: M = main (.devtree_a, d3290f9) against C = issue24-cand1024
# (.devtree_c): 1024 top-k candidates in shared memory (33 KB a CTA: 6 128-thread CTAs
# an SM instead of 5). Benches (checked bit for bit before timing), then C's GPU tests.
export OUT=${OUT:-out}
mkdir -p "$OUT"
{ date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; for d in .devtree_a .devtree_c; do echo "$d $(cat $d/COMMIT)"; done; } > "$OUT/misc.log" 2>&1
. scripts/device_steps.sh >/dev/null
COMMON="--gated --tp 8 --num-tokens 4 --vocab 152064 --backends onesided --iters 10 --warmup 3 --ops verify_batch_vocab"
B256="$COMMON --pad-bs 256 --mode eager --dtype fp32,bf16 --verify-baselines read_once"
PY=(python3 -X faulthandler -m pytest -q -p no:cacheprovider -rfE --tb=short)
f=tests/test_verify_onesided_gpu.py
export STEP_SIGNAL=ABRT
LIMIT=${LIMIT:-330}
fits() { [ $((SECONDS + $1)) -lt $LIMIT ]; }
for k in a c a c; do fits 45 && step_in .devtree_$k 60 bench-b256-$k.log python3 -m ipc_dpsample bench $B256 --verify-mix topk50; done
fits 40 && step_in .devtree_c 60 tests-c.log "${PY[@]}" $f -k rank_threads
fits 25 && step_in .devtree_c 40 tests-c.log "${PY[@]}" $f -k "different_arguments or refused"
fits 100 && step_in .devtree_c 120 tests-c.log "${PY[@]}" $f -k "processes or real_vocabulary or graph_replayed"
date -u >> "$OUT/misc.log"
cat "$OUT/misc.log"; for l in "$OUT"/bench-b*.log; do echo "== $l"; grep -h "^# ipc-dpsample bench\|^onesided  \(float32\|bfloat16\)\|no point failed\|FAIL\|Error" $l | cut -c1-150; done; grep -h "passed\|failed\|error" "$OUT"/tests-*.log 2>/dev/null | tail -8

#!/usr/bin/env bash
# session 10, call 1 (from the repository root): M = main (.devtree_a), P = issue24-merge-prune
# (.devtree); P's GPU tests, the verify kernels alone (P's script, graph-timed, on both trees'
# kernels), the gated bench at pad_bs=8 top-k (M P M P) and pad_bs=256 top-k (M P)
export OUT=${OUT:-out}
mkdir -p "$OUT"
{ date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; for d in .devtree_a .devtree; do echo "$d $(cat $d/COMMIT)"; done; } > "$OUT/misc.log" 2>&1
COMMON="--gated --tp 8 --num-tokens 4 --vocab 152064 --backends onesided --iters 10 --warmup 3 --ops verify_batch_vocab"
B8="$COMMON --pad-bs 8 --mode graph --dtype fp32 --verify-baselines argmax_batch_vocab"
B256="$COMMON --pad-bs 256 --mode eager --dtype fp32,bf16 --verify-baselines read_once"
PY=(python3 -X faulthandler -m pytest -q -p no:cacheprovider -rfE --tb=short)
f=tests/test_verify_onesided_gpu.py
export STEP_SIGNAL=ABRT
tr_() {  # in TREE SECONDS LOG CMD...: one step inside a tree
  local tree=$1 t=$2 log=$3; shift 3
  ( cd "$tree" && . scripts/device_steps.sh >/dev/null && step "$t" "$OUT/$log" "$@" )
  echo "$log $(date -u +%T)" >> "$OUT/misc.log"
}
tr_ .devtree 90 tests-P.log "${PY[@]}" $f -k rank_threads
tr_ .devtree 40 bvk.log python3 scripts/bench_verify_kernels.py --mix topk50
tr_ .devtree_a 40 bvk.log python3 scripts/bench_verify_kernels_p.py --mix topk50
tr_ .devtree 40 bvk.log python3 scripts/bench_verify_kernels.py --mix topk50 --cap 0
tr_ .devtree_a 40 bvk.log python3 scripts/bench_verify_kernels_p.py --mix topk50 --cap 0
for r in 1 2; do
  tr_ .devtree_a 60 bench-b8-M.log python3 -m ipc_dpsample bench $B8 --verify-mix topk50
  tr_ .devtree 60 bench-b8-P.log python3 -m ipc_dpsample bench $B8 --verify-mix topk50
done
tr_ .devtree_a 80 bench-b256-M.log python3 -m ipc_dpsample bench $B256 --verify-mix topk50,topk50-topp0.9
tr_ .devtree 80 bench-b256-P.log python3 -m ipc_dpsample bench $B256 --verify-mix topk50,topk50-topp0.9
tr_ .devtree 40 tests-P.log "${PY[@]}" $f -k "different_arguments or refused"
tr_ .devtree 40 tests-P.log "${PY[@]}" tests/test_nccl_verify_gpu.py tests/test_triton_parity_gpu.py
left=$((560 - SECONDS)); [ $left -gt 150 ] && left=150
[ $left -gt 20 ] && tr_ .devtree $left tests-P.log "${PY[@]}" $f -k "processes or real_vocabulary or graph_replayed"
date -u >> "$OUT/misc.log"
cat "$OUT/misc.log"; grep -v "^###" "$OUT/bvk.log" | tail -40

#!/usr/bin/env bash
# session 11, call 1 (from the repository root): M = main (.devtree_a), K = branch
# issue24-pool-packed before the kept columns (.devtree_b: the packed pool, the warp cut,
# phase clocks), N = its tip (.devtree: + a top-k row's first pass keeps 4 columns per
# thread). Phases of N; the verify kernels alone (M K N, twice); the gated pad_bs=8 top-k
# bench (M K N, twice; N with 2 record CTAs per SM); N's GPU tests.
# (Reconstructed for the record from the session's edits: the script itself was in the
# exported tree, which was replaced before the logs were archived.)
export OUT=${OUT:-out}
mkdir -p "$OUT"
{ date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; for d in .devtree_a .devtree_b .devtree; do echo "$d $(cat $d/COMMIT)"; done; } > "$OUT/misc.log" 2>&1
COMMON="--gated --tp 8 --num-tokens 4 --vocab 152064 --backends onesided --iters 10 --warmup 3 --ops verify_batch_vocab"
B8="$COMMON --pad-bs 8 --mode graph --dtype fp32 --verify-baselines argmax_batch_vocab"
PY=(python3 -X faulthandler -m pytest -q -p no:cacheprovider -rfE --tb=short)
f=tests/test_verify_onesided_gpu.py
export STEP_SIGNAL=ABRT
tr_() {  # tr_ TREE SECONDS LOG CMD...: one step inside a tree
  local tree=$1 t=$2 log=$3; shift 3
  ( cd "$tree" && . scripts/device_steps.sh >/dev/null && step "$t" "$OUT/$log" "$@" )
  echo "$log $tree $(date -u +%T)" >> "$OUT/misc.log"
}
tr_ .devtree 90 phases.log python3 scripts/bench_verify_kernels.py --mix topk50 --phases 20
tr_ .devtree 90 phases.log python3 scripts/bench_verify_kernels.py --mix temperature --phases 20
for r in 1 2; do
  for t in .devtree_a .devtree_b .devtree; do
    tr_ $t 40 bvk.log python3 scripts/bench_verify_kernels.py --mix topk50
  done
done
for r in 1 2; do
  for t in .devtree_a .devtree_b .devtree; do
    tr_ $t 40 bench-b8.log python3 -m ipc_dpsample bench $B8 --verify-mix topk50
  done
done
( export IPC_DPSAMPLE_VERIFY_CTAS_PER_SM=2; tr_ .devtree 40 bench-b8-c2.log python3 -m ipc_dpsample bench $B8 --verify-mix topk50 )
tr_ .devtree 60 tests-N.log "${PY[@]}" $f -k rank_threads
tr_ .devtree 40 tests-N.log "${PY[@]}" $f -k "different_arguments or refused"
tr_ .devtree 40 tests-N.log "${PY[@]}" tests/test_nccl_verify_gpu.py tests/test_triton_parity_gpu.py
B256="$COMMON --pad-bs 256 --mode eager --dtype fp32,bf16 --verify-baselines read_once"
for t in .devtree_a .devtree; do
  [ $SECONDS -lt 380 ] && tr_ $t 60 bench-b256.log python3 -m ipc_dpsample bench $B256 --verify-mix topk50
done
for t in .devtree_a .devtree; do
  [ $SECONDS -lt 400 ] && tr_ $t 30 bench-b8-temp.log python3 -m ipc_dpsample bench $B8 --verify-mix temperature
done
left=$((560 - SECONDS)); [ $left -gt 140 ] && left=140
[ $left -gt 20 ] && tr_ .devtree $left tests-N.log "${PY[@]}" $f -k "processes or real_vocabulary or graph_replayed"
date -u >> "$OUT/misc.log"

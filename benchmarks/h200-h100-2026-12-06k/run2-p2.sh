#!/usr/bin/env bash
# session 11, call 2 (from the repository root): P = branch issue24-phases (.devtree_a:
# main's kernels, byte-identical cubins, plus phase clocks), C = branch issue24-combine512
# (.devtree: P + the combine at 512 threads). Phases of P (top-k 50, temperature) and C;
# the verify kernels alone (P C, twice); the gated benches (pad_bs=8 top-k 50 P C twice,
# temperature P C; pad_bs=256 top-k 50 and temperature P C); C's GPU tests; P's NCCL and
# Triton GPU tests.
export OUT=${OUT:-out}
mkdir -p "$OUT"
{ date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; for d in .devtree_a .devtree; do echo "$d $(cat $d/COMMIT)"; done; } > "$OUT/misc.log" 2>&1
COMMON="--gated --tp 8 --num-tokens 4 --vocab 152064 --backends onesided --iters 10 --warmup 3 --ops verify_batch_vocab"
B8="$COMMON --pad-bs 8 --mode graph --dtype fp32 --verify-baselines argmax_batch_vocab"
B256="$COMMON --pad-bs 256 --mode eager --dtype fp32,bf16 --verify-baselines read_once"
PY=(python3 -X faulthandler -m pytest -q -p no:cacheprovider -rfE --tb=short)
f=tests/test_verify_onesided_gpu.py
export STEP_SIGNAL=ABRT
tr_() {  # tr_ TREE SECONDS LOG CMD...: one step inside a tree
  local tree=$1 t=$2 log=$3; shift 3
  ( cd "$tree" && . scripts/device_steps.sh >/dev/null && step "$t" "$OUT/$log" "$@" )
  echo "$log $tree $(date -u +%T)" >> "$OUT/misc.log"
}
tr_ .devtree_a 60 phases-P.log python3 scripts/bench_verify_kernels.py --mix topk50 --phases 20
tr_ .devtree_a 60 phases-P.log python3 scripts/bench_verify_kernels.py --mix temperature --phases 20
tr_ .devtree 60 phases-C.log python3 scripts/bench_verify_kernels.py --mix topk50 --phases 20
for r in 1 2; do
  for t in .devtree_a .devtree; do tr_ $t 40 bvk.log python3 scripts/bench_verify_kernels.py --mix topk50; done
done
for r in 1 2; do
  for t in .devtree_a .devtree; do tr_ $t 40 bench-b8.log python3 -m ipc_dpsample bench $B8 --verify-mix topk50; done
done
for t in .devtree_a .devtree; do tr_ $t 40 bench-b8.log python3 -m ipc_dpsample bench $B8 --verify-mix temperature; done
tr_ .devtree 60 tests-C.log "${PY[@]}" $f -k rank_threads
tr_ .devtree 40 tests-C.log "${PY[@]}" $f -k "different_arguments or refused"
tr_ .devtree 40 tests-C.log "${PY[@]}" tests/test_nccl_verify_gpu.py tests/test_triton_parity_gpu.py
tr_ .devtree 140 tests-C.log "${PY[@]}" $f -k "processes or real_vocabulary or graph_replayed"
for t in .devtree_a .devtree; do [ $SECONDS -lt 300 ] && tr_ $t 60 bench-b256.log python3 -m ipc_dpsample bench $B256 --verify-mix topk50; done
[ $SECONDS -lt 340 ] && tr_ .devtree_a 40 tests-P.log "${PY[@]}" tests/test_nccl_verify_gpu.py tests/test_triton_parity_gpu.py
for t in .devtree_a .devtree; do [ $SECONDS -lt 340 ] && tr_ $t 60 bench-b256.log python3 -m ipc_dpsample bench $B256 --verify-mix temperature; done
date -u >> "$OUT/misc.log"
cat "$OUT/misc.log"; grep -h "dp_verify_combine, the whole\|dp_verify_records, one\|checked bit\|WRONG" "$OUT/bvk.log"; grep -h "onesided verify_batch_vocab \[\|no point failed\|FAIL" "$OUT"/bench-b*.log | grep -v "^###"; grep -h "passed\|failed\|error" "$OUT"/tests-*.log; grep -hv "^###\|checked bit\|dp_verify_records, every\|one owner\|times:" "$OUT"/phases-*.log

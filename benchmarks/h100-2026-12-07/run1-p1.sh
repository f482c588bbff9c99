#!/usr/bin/env bash
# session 12, call 1 (from the repository root): M = main 5e5c4ec, kernels as df5c8d3
# (.devtree_a); V = branch issue24-vkeys 6e42b18 (.devtree: the top-k record's first pass
# keeps vector keys, the candidates pass reads again only the vectors at or above the
# threshold). V's GPU tests; the verify kernels alone (M V, twice); the gated pad_bs=8
# top-k 50 (M V, twice); V's multi-process GPU tests; pad_bs=256 top-k 50 (M V); phases.
export OUT=${OUT:-out}
mkdir -p "$OUT"
{ date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; for d in .devtree_a .devtree; do echo "$d $(cat $d/COMMIT)"; done; } > "$OUT/misc.log" 2>&1
. scripts/device_steps.sh >/dev/null
COMMON="--gated --tp 8 --num-tokens 4 --vocab 152064 --backends onesided --iters 10 --warmup 3 --ops verify_batch_vocab"
B8="$COMMON --pad-bs 8 --mode graph --dtype fp32 --verify-baselines argmax_batch_vocab"
B256="$COMMON --pad-bs 256 --mode eager --dtype fp32,bf16 --verify-baselines read_once"
PY=(python3 -X faulthandler -m pytest -q -p no:cacheprovider -rfE --tb=short)
f=tests/test_verify_onesided_gpu.py
export STEP_SIGNAL=ABRT
step_in .devtree 60 tests-V.log "${PY[@]}" $f -k rank_threads
step_in .devtree 40 tests-V.log "${PY[@]}" $f -k "different_arguments or refused"
step_in .devtree 40 tests-V.log "${PY[@]}" tests/test_nccl_verify_gpu.py tests/test_triton_parity_gpu.py
for r in 1; do
  for t in .devtree_a .devtree; do step_in $t 40 bvk.log python3 scripts/bench_verify_kernels.py --mix topk50; done
done
for r in 1; do
  for t in .devtree_a .devtree; do step_in $t 40 bench-b8.log python3 -m ipc_dpsample bench $B8 --verify-mix topk50; done
done
for t in .devtree_a .devtree; do [ $SECONDS -lt 200 ] && step_in $t 60 bench-b256.log python3 -m ipc_dpsample bench $B256 --verify-mix topk50; done
[ $SECONDS -lt 300 ] && step_in .devtree 130 tests-V.log "${PY[@]}" $f -k "processes or real_vocabulary or graph_replayed"
[ $SECONDS -lt 330 ] && step_in .devtree 40 phases-V.log python3 scripts/bench_verify_kernels.py --mix topk50 --phases 20
[ $SECONDS -lt 350 ] && step_in .devtree_a 40 phases-M.log python3 scripts/bench_verify_kernels.py --mix topk50 --phases 20
for t in .devtree_a .devtree; do [ $SECONDS -lt 360 ] && step_in $t 40 bench-b8.log python3 -m ipc_dpsample bench $B8 --verify-mix topk50; done
date -u >> "$OUT/misc.log"
cat "$OUT/misc.log"; grep -h "dp_verify_combine, the whole\|dp_verify_records, one\|checked bit\|WRONG" "$OUT/bvk.log"; grep -h "onesided verify_batch_vocab \[\|no point failed\|FAIL" "$OUT"/bench-b*.log | grep -v "^###"; grep -h "passed\|failed\|error" "$OUT"/tests-*.log; grep -hv "^###\|checked bit\|dp_verify_records, every\|one owner\|times:" "$OUT"/phases-*.log

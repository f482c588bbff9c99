#!/usr/bin/env bash
# session 14, one call (from the repository root): A/B of four `git archive` trees, each
# with its commit in COMMIT: M = main (.devtree_a), T = issue24-vkeys (.devtree_t: vector
# keys + per-warp lists in the records' first/second pass), R = issue24-rank-scan
# (.devtree_r: the combine's ranks counted in turn), C = issue24-both (.devtree: T + R).
# 1. bvk (verify kernels alone, checked bit for bit) of M T R C; the tree of T/R/C with
#    the least (records one shard + combine whole batch) is chosen when it beats M's by 1 %.
# 2. B8 and B256 top-k 50 of M and the chosen tree; 3. the chosen tree's GPU tests;
# 4. what time is left: B8/B256 of the other trees, a second B8 of M and the chosen one.
export OUT=${OUT:-out}
mkdir -p "$OUT"
{ date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; for d in .devtree_a .devtree_t .devtree_r .devtree; do echo "$d $(cat $d/COMMIT)"; done; } > "$OUT/misc.log" 2>&1
. scripts/device_steps.sh >/dev/null
COMMON="--gated --tp 8 --num-tokens 4 --vocab 152064 --backends onesided --iters 10 --warmup 3 --ops verify_batch_vocab"
B8="$COMMON --pad-bs 8 --mode graph --dtype fp32 --verify-baselines argmax_batch_vocab"
B256="$COMMON --pad-bs 256 --mode eager --dtype fp32,bf16 --verify-baselines read_once"
PY=(python3 -X faulthandler -m pytest -q -p no:cacheprovider -rfE --tb=short)
f=tests/test_verify_onesided_gpu.py
export STEP_SIGNAL=ABRT
LIMIT=${LIMIT:-560}
fits() { [ $((SECONDS + $1)) -lt $LIMIT ]; }
declare -A TREE=([M]=.devtree_a [T]=.devtree_t [R]=.devtree_r [C]=.devtree)
for k in M T R C; do fits 20 && step_in ${TREE[$k]} 40 bvk-$k.log python3 scripts/bench_verify_kernels.py --mix topk50; done
cost() {  # records one shard + combine whole batch (us) of bvk-$1.log, empty when it failed
  grep -q "checked bit for bit" "$OUT/bvk-$1.log" 2>/dev/null || return
  awk '/dp_verify_records, one shard/ {r=$(NF-6)} /dp_verify_combine, the whole batch/ {c=$(NF-6)} END {if (r!="" && c!="") printf "%.2f\n", r+c}' "$OUT/bvk-$1.log"
}
best=""; bc=$(cost M); echo "cost M $bc" >> "$OUT/misc.log"
lim=$(awk -v m="$bc" 'BEGIN {if (m!="") printf "%.3f", 0.99*m}')
for k in T R C; do
  c=$(cost $k); echo "cost $k $c" >> "$OUT/misc.log"
  [ -n "$c" ] && [ -n "$lim" ] && awk -v c="$c" -v l="$lim" 'BEGIN {exit !(c < l)}' && { best=$k; lim=$c; }
done
echo "chosen: ${best:-none}" >> "$OUT/misc.log"
B=${best:-C}
for k in M $B; do fits 30 && step_in ${TREE[$k]} 40 bench-b8.log python3 -m ipc_dpsample bench $B8 --verify-mix topk50; done
for k in M $B; do fits 40 && step_in ${TREE[$k]} 60 bench-b256.log python3 -m ipc_dpsample bench $B256 --verify-mix topk50; done
if [ -n "$best" ]; then
  t=${TREE[$best]}
  fits 60 && step_in $t 70 tests-$best.log "${PY[@]}" $f -k rank_threads
  fits 25 && step_in $t 40 tests-$best.log "${PY[@]}" $f -k "different_arguments or refused"
  fits 40 && step_in $t 50 tests-$best.log "${PY[@]}" tests/test_nccl_verify_gpu.py tests/test_triton_parity_gpu.py
  fits 110 && step_in $t 130 tests-$best.log "${PY[@]}" $f -k "processes or real_vocabulary or graph_replayed"
fi
for k in T R C; do [ $k = $B ] || { fits 40 && step_in ${TREE[$k]} 60 bench-b256.log python3 -m ipc_dpsample bench $B256 --verify-mix topk50; }; done
for k in M $B; do fits 30 && step_in ${TREE[$k]} 40 bench-b8.log python3 -m ipc_dpsample bench $B8 --verify-mix topk50; done
for k in T R C; do [ $k = $B ] || { fits 30 && step_in ${TREE[$k]} 40 bench-b8.log python3 -m ipc_dpsample bench $B8 --verify-mix topk50; }; done
date -u >> "$OUT/misc.log"
cat "$OUT/misc.log"; grep -h "dp_verify_combine, the whole\|dp_verify_records, one\|checked bit\|WRONG\|Error" "$OUT"/bvk-*.log; grep -h "onesided verify_batch_vocab \[\|read_once\|argmax_batch_vocab \[\|no point failed\|FAIL" "$OUT"/bench-b*.log | grep -v "^###"; grep -h "passed\|failed\|error" "$OUT"/tests-*.log 2>/dev/null

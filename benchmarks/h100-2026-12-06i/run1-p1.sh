#!/usr/bin/env bash
# session 9, call 1 (from the repository root): A = main (1a3264d), D = both (top-k slots +
# lean queue), T = tk2 (top-k slots only), L = lq2 (lean queue only); then D's GPU tests
export OUT=${OUT:-out}
mkdir -p "$OUT"
{ date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; for d in .devtree_a .devtree .devtree_t .devtree_l; do echo "$d $(cat $d/COMMIT)"; done; } > "$OUT/misc.log" 2>&1
COMMON="--gated --tp 8 --num-tokens 4 --vocab 152064 --backends onesided --iters 10 --warmup 3 --ops verify_batch_vocab"
B8="$COMMON --pad-bs 8 --mode graph --dtype fp32 --verify-baselines argmax_batch_vocab"
B256="$COMMON --pad-bs 256 --mode eager --dtype fp32,bf16 --verify-baselines read_once"
run() {  # run TREE SECONDS TAG ARGS...
  local tree=$1 t=$2 tag=$3; shift 3
  ( cd "$tree" && . scripts/device_steps.sh >/dev/null && step "$t" "$OUT/bench-$tag.log" python3 -m ipc_dpsample bench "$@" )
  echo "$tag $(date -u +%T)" >> "$OUT/misc.log"
}
run .devtree_a 100 b8-A $B8 --verify-mix greedy,temperature,topk50
run .devtree 100 b8-D $B8 --verify-mix greedy,temperature,topk50
run .devtree_t 60 b8-T $B8 --verify-mix topk50
run .devtree_l 60 b8-L $B8 --verify-mix temperature
run .devtree_a 90 b256-A $B256 --verify-mix temperature,topk50
run .devtree 90 b256-D $B256 --verify-mix temperature,topk50
for mix in topk50 temperature; do
  ( cd .devtree && . scripts/device_steps.sh >/dev/null && step 60 "$OUT/kernels-b8-D-$mix.log" python3 scripts/profile_kernels.py -- bench $B8 --verify-mix $mix )
done
echo "profiles $(date -u +%T)" >> "$OUT/misc.log"
cd .devtree && . scripts/device_steps.sh >/dev/null
export STEP_SIGNAL=ABRT
step 90 "$OUT/gpu-D-rank-threads.log" python3 -X faulthandler -m pytest -q tests/test_verify_onesided_gpu.py -k rank_threads
step 60 "$OUT/gpu-D-errors.log" python3 -X faulthandler -m pytest -q tests/test_verify_onesided_gpu.py -k "different_arguments or refused"
step 60 "$OUT/gpu-D-nccl.log" python3 -X faulthandler -m pytest -q tests/test_nccl_verify_gpu.py
step 50 "$OUT/gpu-D-triton.log" python3 -X faulthandler -m pytest -q tests/test_triton_parity_gpu.py
step 150 "$OUT/gpu-D-procs.log" python3 -X faulthandler -m pytest -q tests/test_verify_onesided_gpu.py -k "processes or real_vocabulary or graph_replayed"
date -u >> "$OUT/misc.log"
cat "$OUT/misc.log"

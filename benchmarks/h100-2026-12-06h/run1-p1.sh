#!/usr/bin/env bash
# session 8, call 1 (from the repository root): A = d4314af (the session's start), B = HEAD
# (merge searches interleaved; knobs for the temperature pass's loads ahead and for splits)
export OUT=${OUT:-out}
mkdir -p "$OUT"
{ date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; cat .devtree/COMMIT; } > "$OUT/misc.log" 2>&1
COMMON="--gated --tp 8 --num-tokens 4 --vocab 152064 --backends onesided --iters 10 --warmup 3 --ops verify_batch_vocab"
B8="$COMMON --pad-bs 8 --mode graph --dtype fp32 --verify-baselines argmax_batch_vocab"
B256="$COMMON --pad-bs 256 --mode eager --dtype fp32,bf16 --verify-baselines read_once --verify-mix temperature"
run() {  # run TREE SECONDS TAG ARGS...: a bench in TREE under the current environment
  local tree=$1 t=$2 tag=$3; shift 3
  ( cd "$tree" && . scripts/device_steps.sh >/dev/null && step "$t" "$OUT/bench-$tag.log" python3 -m ipc_dpsample bench "$@" )
  echo "$tag $(date -u +%T)" >> "$OUT/misc.log"
}
run .devtree_a 100 b8-A $B8 --verify-mix greedy,temperature,topk50
run .devtree 100 b8-B $B8 --verify-mix greedy,temperature,topk50
IPC_DPSAMPLE_VERIFY_PREFETCH=2 run .devtree 80 b8-B-pf2 $B8 --verify-mix temperature
IPC_DPSAMPLE_VERIFY_BLOCK=128 IPC_DPSAMPLE_VERIFY_SPLITS=3 run .devtree 80 b8-B-blk128-s3 $B8 --verify-mix temperature,topk50
for mix in topk50 temperature; do
  ( cd .devtree && . scripts/device_steps.sh >/dev/null && step 80 "$OUT/kernels-b8-$mix.log" python3 scripts/profile_kernels.py -- bench $B8 --verify-mix $mix )
done
echo "profiles $(date -u +%T)" >> "$OUT/misc.log"
run .devtree_a 90 b256-A $B256
IPC_DPSAMPLE_VERIFY_PREFETCH=2 run .devtree 90 b256-B-pf2 $B256
date -u >> "$OUT/misc.log"

#!/usr/bin/env bash
# session 9, call 2 (from the repository root): main at 6748158 (the top-k rows combined
# together): the GPU tests and the benchmarks (scripts/device_verify.sh), the NCCL
# verify tests, the pad_bs=8 kernel times, the fused Triton sampler baseline and the swap /
# gather at pad_bs=256; extra.log holds the steps after device_verify.sh
export OUT=${OUT:-out}
mkdir -p "$OUT"
cd .devtree
OUT=$OUT DEADLINE=330 STEPS="triton threads errors b256 b8 tests" bash scripts/device_verify.sh
. scripts/device_steps.sh >/dev/null
x="$OUT/extra.log"
STEP_SIGNAL=ABRT step 50 "$x" python3 -X faulthandler -m pytest -q -p no:cacheprovider -rfE tests/test_nccl_verify_gpu.py
COMMON="--gated --tp 8 --num-tokens 4 --vocab 152064 --backends onesided --iters 10 --warmup 3"
B8="$COMMON --ops verify_batch_vocab --pad-bs 8 --mode graph --dtype fp32 --verify-baselines argmax_batch_vocab"
for mix in topk50 temperature; do
  step 40 "$x" python3 scripts/profile_kernels.py -- bench $B8 --verify-mix $mix --out /tmp/prof-$mix
done
step 60 "$x" python3 scripts/bench_triton_sampler.py --pad-bs 256 --dtype fp32,bf16
step 60 "$x" python3 -m ipc_dpsample bench $COMMON --ops swap_batch_vocab,gather_verify_outputs,verify_batch_vocab --verify-baselines read_once --verify-mix temperature --pad-bs 256 --dtype fp32,bf16 --mode eager --out /tmp/bsg
date -u >> "$OUT/misc.log"
cat "$OUT/misc.log"

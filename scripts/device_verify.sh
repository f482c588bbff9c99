#!/usr/bin/env bash
# verify_batch_vocab on the GPU (issue 24): the one-sided tests, the Triton parity test
# and the benchmarks of the issue, in order of importance, each step under its own time
# limit and all of them before DEADLINE seconds (default 540); logs land in $OUT.
# STEPS picks some (default: all, in this order: triton threads errors b256 b8 swap tests).
# Run from the repository root on the device machine:
#     OUT=out bash scripts/device_verify.sh
# or from a clean export carried to it (uncommitted work stays behind):
#     git archive HEAD | tar -x -C .devtree && git rev-parse --short HEAD > .devtree/COMMIT
# The swap + sampler + gather baseline is the package's torch sampler, launched from 8
# Python threads: seconds per call at pad_bs=256, so it runs late, on few samples.
set -u
# shellcheck source=scripts/device_steps.sh
. "$(dirname "$0")/device_steps.sh"
py=(python3 -X faulthandler -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning -rfE --tb=short)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/misc.log"
echo "commit $GIT_COMMIT" >> "$out/misc.log"
end=${DEADLINE:-540}
steps=" ${STEPS:-triton threads errors b256 b8 swap tests} "
lim() {  # lim NAME SECONDS: SECONDS, or what is left before the deadline (0: skip)
  case "$steps" in *" $1 "*) ;; *) echo 0; return ;; esac
  local l=$((end - SECONDS))
  [ "$l" -gt "$2" ] && l=$2
  [ "$l" -lt 5 ] && l=0
  echo "$l"
}
f=tests/test_verify_onesided_gpu.py
STEP_SIGNAL=ABRT step "$(lim triton 40)" "$out/tests.log" "${py[@]}" -s tests/test_triton_parity_gpu.py
STEP_SIGNAL=ABRT step "$(lim threads 180)" "$out/threads.log" "${py[@]}" --durations=0 $f -k rank_threads
STEP_SIGNAL=ABRT step "$(lim errors 70)" "$out/tests.log" "${py[@]}" $f -k "different_arguments or refused"
bench=(python3 -X faulthandler -m ipc_dpsample bench --gated --tp 8 --num-tokens 4 --vocab 152064 --backends onesided --iters "${BENCH_ITERS:-10}" --warmup 3 --ops verify_batch_vocab)
STEP_SIGNAL=ABRT step "$(lim b256 90)" "$out/bench.log" "${bench[@]}" --verify-baselines read_once,argmax_batch_vocab --pad-bs 256 --dtype fp32,bf16 --mode eager --verify-mix temperature,topk50,topk50-topp0.9 --out /tmp/b256
STEP_SIGNAL=ABRT step "$(lim b8 40)" "$out/bench.log" "${bench[@]}" --verify-baselines argmax_batch_vocab --pad-bs 8 --dtype fp32 --mode graph --verify-mix greedy,temperature,topk50 --out /tmp/b8
STEP_SIGNAL=ABRT step "$(lim swap 180)" "$out/bench.log" "${bench[@]}" --iters 3 --warmup 1 --verify-baselines swap_sample_gather --pad-bs 256 --dtype fp32 --mode eager --verify-mix temperature,topk50,topk50-topp0.9 --out /tmp/bsw
STEP_SIGNAL=ABRT step "$(lim tests 180)" "$out/tests.log" "${py[@]}" $f -k "processes or real_vocabulary or graph_replayed"
for d in /tmp/b256 /tmp/b8 /tmp/bsw; do [ -f "$d/bench.csv" ] && cp "$d/bench.csv" "$out/$(basename "$d").csv"; done
exit 0

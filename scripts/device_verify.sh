#!/usr/bin/env bash
# verify_batch_vocab on the GPU (issue 24): the one-sided tests and the benchmarks of
# the issue, each step with its own time limit (environment T_<STEP> seconds, 0 skips
# it); logs land in $OUT. Run from the repository root on the device machine:
#     OUT=out bash scripts/device_verify.sh
# or from a clean export carried to it (uncommitted work stays behind):
#     git archive HEAD | tar -x -C .devtree && git rev-parse --short HEAD > .devtree/COMMIT
set -u
# shellcheck source=scripts/device_steps.sh
. "$(dirname "$0")/device_steps.sh"
py=(python3 -X faulthandler -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning -rfE --tb=short)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/misc.log"
echo "commit $GIT_COMMIT" >> "$out/misc.log"
STEP_SIGNAL=ABRT step "${T_VTEST:-300}" "$out/verify.log" "${py[@]}" tests/test_verify_onesided_gpu.py ${VTEST_K:+-k "$VTEST_K"}
bench=(python3 -X faulthandler -m ipc_dpsample bench --gated --tp 8 --num-tokens 4 --vocab 152064 --backends onesided --iters "${BENCH_ITERS:-10}" --ops verify_batch_vocab)
STEP_SIGNAL=ABRT step "${T_VBENCH:-200}" "$out/vbench.log" "${bench[@]}" --pad-bs 256 --dtype "${BENCH_DTYPES:-fp32,bf16}" --mode eager --verify-mix "${BENCH_MIXES:-temperature,topk50,topk50-topp0.9}" --out /tmp/vb256
STEP_SIGNAL=ABRT step "${T_VBENCH8:-100}" "$out/vbench.log" "${bench[@]}" --pad-bs 8 --dtype fp32 --mode eager,graph --verify-mix temperature,topk50 --out /tmp/vb8
for d in /tmp/vb256 /tmp/vb8; do for f in "$d"/*.md; do [ -f "$f" ] && cp "$f" "$out/$(basename "$d")-$(basename "$f")"; done; done
exit 0

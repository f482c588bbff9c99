#!/usr/bin/env bash
# One device call that compares exported trees of verify_batch_vocab's kernels on the same
# GPU (BENCHMARKS.md's A/B sections), then runs the GPU tests of one of them.
#
#   LIMIT=SECONDS TESTS=TREE STEPS="bvk b8 b256" MIXES="topk50 temperature" \
#     bash scripts/device_ab_verify.sh TREE...
#
# Each TREE is a `git archive` export (its commit in TREE/COMMIT) carried to the device;
# run it from the repository root there. A TREE (and TESTS) may name environment knobs
# for its steps: DIR:VAR=VALUE[,VAR=VALUE...], e.g. `.devtree_a
# .devtree_a:IPC_DPSAMPLE_VERIFY_CTAS_PER_SM=4` compares a knob on one tree (device_steps.sh's
# spec_in); STEPS=none runs the tests alone. Every tree runs each step in turn (so the trees'
# runs of a step are minutes apart at most), in this order:
#   bvk   scripts/bench_verify_kernels.py --mix MIX --phases 20 (bvk-TREE.log)
#   b8    the gated pad_bs=8 bench, graph-replayed (bench-b8.log)
#   b256  the gated pad_bs=256 bench, fp32 and bf16 (bench-b256.log)
# then, for TESTS (a tree; none when empty), the four GPU test commands of
# tests/test_verify_onesided_gpu.py, tests/test_nccl_verify_gpu.py and
# tests/test_triton_parity_gpu.py (tests-TREE.log). A step starts only while it fits
# before LIMIT seconds (default 570); the summary (misc.log, bench tables, bit-for-bit
# checks, pytest summary lines) is printed at the end. Every bench checks each verify
# point bit for bit against the NumPy reference before timing it.
export OUT=${OUT:-out}
mkdir -p "$OUT"
# shellcheck source=scripts/device_steps.sh
. "$(dirname "$0")/device_steps.sh" >/dev/null
[ "$#" -gt 0 ] || { echo "usage: $0 TREE..." >&2; exit 2; }
ab_misc "$@"
export STEP_SIGNAL=ABRT
LIMIT=${LIMIT:-570}
fits() { [ $((SECONDS + $1)) -lt "$LIMIT" ]; }
for step in ${STEPS:-bvk b8 b256}; do
  [ "$step" = none ] && continue
  for mix in ${MIXES:-topk50 temperature}; do
    for tree in "$@"; do
      case $step in
        bvk) fits 40 && spec_in "$tree" 60 "bvk-$(spec_name "$tree").log" \
          python3 scripts/bench_verify_kernels.py --mix "$mix" --phases 20 ;;
        b8) fits 25 && spec_in "$tree" 40 bench-b8.log \
          python3 -m ipc_dpsample bench "${B8[@]}" --verify-mix "$mix" ;;
        b256) fits 45 && spec_in "$tree" 70 bench-b256.log \
          python3 -m ipc_dpsample bench "${B256[@]}" --verify-mix "$mix" ;;
        *) echo "unknown step $step" >&2; exit 2 ;;
      esac
    done
  done
done
if [ -n "${TESTS:-}" ]; then
  f=tests/test_verify_onesided_gpu.py
  log="tests-$(spec_name "$TESTS").log"
  fits 40 && spec_in "$TESTS" 70 "$log" "${GPU_PYTEST[@]}" $f -k rank_threads
  fits 25 && spec_in "$TESTS" 40 "$log" "${GPU_PYTEST[@]}" $f -k "different_arguments or refused"
  fits 35 && spec_in "$TESTS" 50 "$log" "${GPU_PYTEST[@]}" tests/test_nccl_verify_gpu.py \
    tests/test_triton_parity_gpu.py
  fits 100 && spec_in "$TESTS" 130 "$log" "${GPU_PYTEST[@]}" $f \
    -k "processes or real_vocabulary or graph_replayed"
fi
date -u >> "$OUT/misc.log"
ab_summary

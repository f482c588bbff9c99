#!/usr/bin/env bash
# call 1 (2026-12-07 session 17): A = main 7a06411, W = issue24-wm 66ffb84 (warp merge;
# IPC_DPSAMPLE_VERIFY_PREFETCH_LINES knob). Env-knob runs are marked in misc.log.
export OUT=${OUT:-out}
mkdir -p "$OUT"
. scripts/device_steps.sh >/dev/null
ab_misc .devtree_a .devtree_w
export STEP_SIGNAL=ABRT
LIMIT=${LIMIT:-575}
fits() { [ $((SECONDS + $1)) -lt "$LIMIT" ]; }
A=.devtree_a W=.devtree_w
mark() { echo "== $*" | tee -a "$OUT/$1"; }
# 1. the kernels alone, with phases (top-k 50)
for t in $A $W; do fits 40 && step_in $t 60 "bvk-$(basename $t | sed 's/.devtree_//').log" python3 scripts/bench_verify_kernels.py --mix topk50 --phases 20; done
# 2. pad_bs=8 graph, twice each
for mix in topk50 temperature; do for t in $A $W $A $W; do
  fits 20 && { mark bench-b8.log "$t $mix"; step_in $t 40 bench-b8.log python3 -m ipc_dpsample bench "${B8[@]}" --verify-mix $mix; }
done; done
# 3. pad_bs=256 top-k 50: A, W, W with the next row's head in L2 (1 and 2 lines a thread)
for cfg in "$A 0" "$W 0" "$W 1" "$W 2"; do set -- $cfg
  fits 45 && { mark bench-b256.log "$1 topk50 PREFETCH_LINES=$2"; IPC_DPSAMPLE_VERIFY_PREFETCH_LINES=$2 step_in $1 70 bench-b256.log python3 -m ipc_dpsample bench "${B256[@]}" --verify-mix topk50; }
done
# 4. pad_bs=256 temperature: A, W with 2 prefetch lines, W with 4 CTAs an SM (64 registers)
for cfg in "$A 0 3" "$W 2 3" "$W 0 4"; do set -- $cfg
  fits 45 && { mark bench-b256.log "$1 temperature PREFETCH_LINES=$2 CTAS_PER_SM=$3"; IPC_DPSAMPLE_VERIFY_PREFETCH_LINES=$2 IPC_DPSAMPLE_VERIFY_CTAS_PER_SM=$3 step_in $1 70 bench-b256.log python3 -m ipc_dpsample bench "${B256[@]}" --verify-mix temperature; }
done
# 5. W's GPU tests
f=tests/test_verify_onesided_gpu.py
fits 40 && step_in $W 70 tests-w.log "${GPU_PYTEST[@]}" $f -k rank_threads
fits 25 && step_in $W 40 tests-w.log "${GPU_PYTEST[@]}" $f -k "different_arguments or refused"
fits 35 && step_in $W 50 tests-w.log "${GPU_PYTEST[@]}" tests/test_nccl_verify_gpu.py tests/test_triton_parity_gpu.py
fits 100 && step_in $W 130 tests-w.log "${GPU_PYTEST[@]}" $f -k "processes or real_vocabulary or graph_replayed"
date -u >> "$OUT/misc.log"
cat "$OUT/misc.log"
grep -h "dp_verify_combine, the whole\|dp_verify_records, one\|checked bit\|WRONG\|Error\|^    top-k\|^    total\|^    pass\|^    the " "$OUT"/bvk-*.log | cut -c1-120
for l in "$OUT"/bench-b*.log; do echo "== $l"; grep -h "^== \|^onesided  \(float32\|bfloat16\)\|no point failed\|FAIL\|Error" "$l" | cut -c1-170; done
grep -h "passed\|failed\|error" "$OUT"/tests-*.log

#!/usr/bin/env bash
# call 2 (2026-12-07 session 17): A = main 7a06411; S = issue24-wm (warp merge, its bitonic
# network a loop of stages); C = S built with DV_WARP_SORT=0 (every slot ranked by counting).
export OUT=${OUT:-out}
mkdir -p "$OUT"
. scripts/device_steps.sh >/dev/null
ab_misc .devtree_a .devtree_s .devtree_c
export STEP_SIGNAL=ABRT
LIMIT=${LIMIT:-575}
fits() { [ $((SECONDS + $1)) -lt "$LIMIT" ]; }
A=.devtree_a S=.devtree_s C=.devtree_c
mark() { local f=$1; shift; echo "== $*" | tee -a "$OUT/$f"; }
# 0. the one-sided kernels as NVRTC builds them: registers, local memory
for t in $A $S $C; do ( cd $t && python3 -c "
import cupy as cp
from ipc_dpsample import envs
from ipc_dpsample.kernel_cache import get_kernel
o = envs.onesided_tuning().compile_options
for n in ('dp_verify_finish', 'dp_verify_push', 'dp_verify_push_nolist'):
    f = get_kernel('onesided.cu', n, 0, o)
    print('$t', n, 'regs', f.num_regs, 'local', f.local_size_bytes, 'shared', f.shared_size_bytes)
" ) >> "$OUT/misc.log" 2>&1; done
for t in $A $S $C; do fits 40 && step_in $t 60 "bvk-$(basename $t | sed 's/.devtree_//').log" python3 scripts/bench_verify_kernels.py --mix topk50 --phases 20; done
for t in $A $S $C $A $S $C; do
  fits 20 && { mark bench-b8.log "$t topk50"; step_in $t 40 bench-b8.log python3 -m ipc_dpsample bench "${B8[@]}" --verify-mix topk50; }
done
for t in $A $S $C; do
  fits 45 && { mark bench-b256.log "$t topk50"; step_in $t 70 bench-b256.log python3 -m ipc_dpsample bench "${B256[@]}" --verify-mix topk50; }
done
for cfg in "$A 0" "$S 2" "$A 0" "$S 2"; do set -- $cfg
  fits 45 && { mark bench-b256.log "$1 temperature PREFETCH_LINES=$2"; IPC_DPSAMPLE_VERIFY_PREFETCH_LINES=$2 step_in $1 70 bench-b256.log python3 -m ipc_dpsample bench "${B256[@]}" --verify-mix temperature; }
done
f=tests/test_verify_onesided_gpu.py
fits 40 && step_in $S 70 tests-s.log "${GPU_PYTEST[@]}" $f -k rank_threads
fits 25 && step_in $S 40 tests-s.log "${GPU_PYTEST[@]}" $f -k "different_arguments or refused"
fits 35 && step_in $S 50 tests-s.log "${GPU_PYTEST[@]}" tests/test_nccl_verify_gpu.py tests/test_triton_parity_gpu.py
fits 100 && step_in $S 130 tests-s.log "${GPU_PYTEST[@]}" $f -k "processes or real_vocabulary or graph_replayed"
date -u >> "$OUT/misc.log"
cat "$OUT/misc.log"
grep -h "dp_verify_combine, the whole\|dp_verify_records, one\|checked bit\|WRONG\|Error\|^    top-k\|^    total" "$OUT"/bvk-*.log | cut -c1-120
for l in "$OUT"/bench-b*.log; do echo "== $l"; grep -h "^== \|^onesided  \(float32\|bfloat16\)\|no point failed\|FAIL\|Error" "$l" | cut -c1-150; done
grep -h "passed\|failed\|error" "$OUT"/tests-*.log

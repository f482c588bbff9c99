#!/usr/bin/env bash
# session 15, call 4 (informational, main at 838d1e0 from the working tree): ncu source
# counters of the record kernel (top-k 50 and temperature, pad_bs=256), and
# IPC_DPSAMPLE_VERIFY_CTAS_PER_SM 2 and 4 at pad_bs=256 top-k 50.
export OUT=${OUT:-out}
mkdir -p "$OUT"
{ date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; } > "$OUT/misc.log" 2>&1
. scripts/device_steps.sh >/dev/null
COMMON="--gated --tp 8 --num-tokens 4 --vocab 152064 --backends onesided --iters 10 --warmup 3 --ops verify_batch_vocab"
B256="$COMMON --pad-bs 256 --mode eager --dtype fp32,bf16 --verify-baselines read_once"
export STEP_SIGNAL=ABRT
LIMIT=${LIMIT:-330}
fits() { [ $((SECONDS + $1)) -lt $LIMIT ]; }
fits 90 && OUT=$OUT SOURCE=1 MIXES=topk50 PADS=256 LIMIT=80 bash scripts/device_ncu_verify.sh
fits 90 && OUT=$OUT SOURCE=1 MIXES=temperature PADS=256 LIMIT=80 bash scripts/device_ncu_verify.sh
for c in 4 2; do fits 45 && IPC_DPSAMPLE_VERIFY_CTAS_PER_SM=$c step 60 "$OUT/bench-ctas$c.log" python3 -m ipc_dpsample bench $B256 --verify-mix topk50; done
date -u >> "$OUT/misc.log"
cat "$OUT/misc.log"; grep -h "Duration\|DRAM Throughput\|rc=" "$OUT"/ncu-src.log | head; for l in "$OUT"/bench-*.log; do echo "== $l"; grep -h "onesided verify_batch_vocab \[\|onesided read_once \|no point failed\|FAIL" $l | cut -c1-200; done; ls -la "$OUT"

#!/usr/bin/env bash
# session 10, call 2 (from the repository root): M = main (.devtree_a, the pruned merge),
# X = branch issue24-pool-fill (.devtree); the verify kernels alone (M X M X), the gated
# pad_bs=8 top-k bench (M X M X), ncu of both trees' whole-batch combine and of one
# shard's top-k record kernel; X's GPU tests if time is left
export OUT=${OUT:-out}
mkdir -p "$OUT"
{ date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; for d in .devtree_a .devtree; do echo "$d $(cat $d/COMMIT)"; done; } > "$OUT/misc.log" 2>&1
COMMON="--gated --tp 8 --num-tokens 4 --vocab 152064 --backends onesided --iters 10 --warmup 3 --ops verify_batch_vocab"
B8="$COMMON --pad-bs 8 --mode graph --dtype fp32 --verify-baselines argmax_batch_vocab"
PY=(python3 -X faulthandler -m pytest -q -p no:cacheprovider -rfE --tb=short)
f=tests/test_verify_onesided_gpu.py
export STEP_SIGNAL=ABRT
tr_() {  # tr_ TREE SECONDS LOG CMD...: one step inside a tree
  local tree=$1 t=$2 log=$3; shift 3
  ( cd "$tree" && . scripts/device_steps.sh >/dev/null && step "$t" "$OUT/$log" "$@" )
  echo "$log $tree $(date -u +%T)" >> "$OUT/misc.log"
}
for r in 1 2; do
  tr_ .devtree_a 40 bvk.log python3 scripts/bench_verify_kernels.py --mix topk50
  tr_ .devtree 40 bvk.log python3 scripts/bench_verify_kernels.py --mix topk50
done
for r in 1 2; do
  tr_ .devtree_a 40 bench-b8.log python3 -m ipc_dpsample bench $B8 --verify-mix topk50
  tr_ .devtree 40 bench-b8.log python3 -m ipc_dpsample bench $B8 --verify-mix topk50
done
tr_ .devtree 60 tests-X.log "${PY[@]}" $f -k rank_threads
SEC="--section SourceCounters --section WarpStateStats --section SpeedOfLight --section LaunchStats --section Occupancy --section SchedulerStats --import-source yes"
args="python3 scripts/bench_verify_kernels.py --mix topk50 --iters 2 --reps 2"
export IPC_DPSAMPLE_LINEINFO=1
tr_ .devtree_a 80 ncu.log ncu --kernel-name dp_verify_combine --launch-skip 8 --launch-count 1 $SEC -f -o /tmp/comb-M $args
tr_ .devtree 80 ncu.log ncu --kernel-name dp_verify_combine --launch-skip 8 --launch-count 1 $SEC -f -o /tmp/comb-X $args
tr_ .devtree 80 ncu.log ncu --kernel-name dp_verify_records --launch-skip 0 --launch-count 1 $SEC -f -o /tmp/rec-X $args
unset IPC_DPSAMPLE_LINEINFO
for r in comb-M comb-X rec-X; do
  [ -f /tmp/$r.ncu-rep ] || continue
  ncu -i /tmp/$r.ncu-rep --page source --csv --print-source sass 2>&1 | gzip > "$OUT/$r-sass.csv.gz"
  { echo "##### $r"; ncu -i /tmp/$r.ncu-rep --print-details all; } >> "$OUT/ncu.log" 2>&1
done
echo "ncu exported $(date -u +%T)" >> "$OUT/misc.log"
tr_ .devtree 30 tests-X.log "${PY[@]}" $f -k "different_arguments or refused"
left=$((470 - SECONDS)); [ $left -gt 130 ] && left=130
[ $left -gt 20 ] && tr_ .devtree $left tests-X.log "${PY[@]}" $f -k "processes or real_vocabulary or graph_replayed"
date -u >> "$OUT/misc.log"
cat "$OUT/misc.log"; grep -h "dp_verify_combine, the whole\|checked bit\|WRONG" "$OUT/bvk.log"; grep -h "onesided  float32  8 .*topk50" "$OUT/bench-b8.log"; grep -h "passed\|failed" "$OUT/tests-X.log"

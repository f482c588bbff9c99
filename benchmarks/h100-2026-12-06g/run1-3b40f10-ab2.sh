#!/usr/bin/env bash
# One tree (.devtree): the record kernel with temperature rows read twice (default) and
# once (IPC_DPSAMPLE_VERIFY_ONE_PASS=1), alternating; the one-sided GPU tests with the
# one-pass kernel. Every step fits before DEADLINE seconds.
set -u
O=${OUT:-/tmp/out}; mkdir -p "$O"; T0=$SECONDS; END=${DEADLINE:-540}
cd .devtree
export PYTHONPATH=$PWD GIT_COMMIT=$(cat COMMIT)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$O/misc.log"
echo "commit $GIT_COMMIT" >> "$O/misc.log"
py=(python3 -X faulthandler -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning -rfE --tb=short)
f=tests/test_verify_onesided_gpu.py
b=(python3 -X faulthandler -m ipc_dpsample bench --gated --tp 8 --num-tokens 4 --vocab 152064 --backends onesided --iters 10 --warmup 3 --ops verify_batch_vocab)
lim() { local l=$((END - (SECONDS - T0))); [ $l -gt $1 ] && l=$1; [ $l -lt 10 ] && l=0; echo $l; }
t() { local l; l=$(lim "$1"); shift; [ "$l" -gt 0 ] && timeout "$l" "$@"; }
ab() {
 for op in 1 0; do
  echo "=== round $1 one_pass=$op b8" >> "$O/ab.log"
  IPC_DPSAMPLE_VERIFY_ONE_PASS=$op t 60 "${b[@]}" --verify-baselines argmax_batch_vocab --pad-bs 8 --dtype fp32 --mode graph --verify-mix greedy,temperature --out /tmp/b8 >> "$O/ab.log" 2>&1
  echo "=== round $1 one_pass=$op b256" >> "$O/ab.log"
  IPC_DPSAMPLE_VERIFY_ONE_PASS=$op t 70 "${b[@]}" --verify-baselines read_once --pad-bs 256 --dtype fp32,bf16 --mode eager --verify-mix temperature --out /tmp/b256 >> "$O/ab.log" 2>&1
  echo "round $1 one_pass=$op at $((SECONDS-T0)) s" >> "$O/misc.log"
 done
}
ab 1
IPC_DPSAMPLE_VERIFY_ONE_PASS=1 t 100 "${py[@]}" $f -k rank_threads > "$O/tests.log" 2>&1
echo "threads tests at $((SECONDS-T0)) s" >> "$O/misc.log"
ab 2
IPC_DPSAMPLE_VERIFY_ONE_PASS=1 t 40 "${py[@]}" $f -k "different_arguments or refused" >> "$O/tests.log" 2>&1
IPC_DPSAMPLE_VERIFY_ONE_PASS=1 t 200 "${py[@]}" $f -k "processes or real_vocabulary or graph_replayed" > "$O/tests2.log" 2>&1
echo "end at $((SECONDS-T0)) s" >> "$O/misc.log"

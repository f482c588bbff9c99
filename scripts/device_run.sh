#!/usr/bin/env bash
# One batched GPU session: tests, benchmarks, doctor, demo, sanitizer. Every step has
# its own time limit (environment T_<STEP> seconds, 0 skips it) and keeps going past
# failures; logs land in $OUT (at most 8 files come back from the device).
set -u
# shellcheck source=scripts/device_steps.sh
. "$(dirname "$0")/device_steps.sh"
# an array, not a function: `timeout` runs programs, and a shell function is not one
py=(python3 -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning -rfE --tb=short)
san=(compute-sanitizer --error-exitcode 9 --tool)
graph_k="graph_replay or stream_capture or graph_mode or back_to_back or disagreement"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/misc.log"
step "${T_ONESIDED:-120}" "$out/onesided.log" "${py[@]}" --timeout 45 tests/test_onesided_gpu.py -k "not ($graph_k)"
step "${T_GRAPH:-70}" "$out/graph.log" "${py[@]}" --timeout 30 tests/test_onesided_gpu.py -k "$graph_k"
IPC_DPSAMPLE_GRAPH_SWAP=copy step "${T_GRAPHCOPY:-70}" "$out/graph.log" "${py[@]}" --timeout 30 tests/test_onesided_gpu.py -k "$graph_k"
step "${T_BSARGMAX:-200}" "$out/bsargmax.log" "${py[@]}" --timeout 150 tests/test_onesided_bs_argmax_gpu.py
IPC_DPSAMPLE_GRAPH_SWAP=copy step "${T_BSARGMAX_COPY:-60}" "$out/bsargmax.log" "${py[@]}" --timeout 60 tests/test_onesided_bs_argmax_gpu.py -k "graph or tokenspeed"
# issue 13 (real rows) and 14 (argmax) tables: tp=8 gated, one GPU
bench=(python3 -X faulthandler -m ipc_dpsample bench --gated --tp 8 --num-tokens 4 --vocab 152064 --backends onesided --baselines copy --iters "${BENCH_ITERS:-15}")
STEP_SIGNAL=ABRT step "${T_I13:-${T_BSBENCH:-120}}" "$out/bench.log" "${bench[@]}" --pad-bs 256 --bs 256,192,130,64,8 --dtype fp32 --ops swap_batch_vocab --mode eager,graph --out /tmp/i13-fp32
STEP_SIGNAL=ABRT step "${T_I13B:-${T_BSBENCH:-120}}" "$out/bench.log" "${bench[@]}" --pad-bs 64 --bs 64,48,33,16,2 --dtype bf16 --ops swap_batch_vocab --mode eager,graph --out /tmp/i13-bf16
STEP_SIGNAL=ABRT step "${T_I14:-${T_BSBENCH:-120}}" "$out/bench.log" "${bench[@]}" --pad-bs 256 --dtype fp32 --ops argmax_batch_vocab --out /tmp/i14-fp32
STEP_SIGNAL=ABRT step "${T_I14B:-${T_BSBENCH:-120}}" "$out/bench.log" "${bench[@]}" --pad-bs 64 --dtype bf16 --ops argmax_batch_vocab --out /tmp/i14-bf16
step "${T_SETUP:-60}" "$out/misc.log" python3 scripts/profile_setup.py --tp 8 --reps 5
step "${T_HANG:-0}" "$out/bench.log" python3 scripts/bench_onesided.py --big-only --reps 3 --dump-after 30 --out /tmp/hang
# swap knobs, big swap only: KNOBS="ctas_per_sm:unroll:fit:streaming:chunk:block ..." (each run its own
# process); with KNOBS_PICK=1 the best (tp=8 gated ratio) is exported for the steps after
for k in ${KNOBS:-}; do
  IFS=: read -r c u f st ch bl <<< "$k"
  IPC_DPSAMPLE_SWAP_CTAS_PER_SM=$c IPC_DPSAMPLE_SWAP_UNROLL=$u IPC_DPSAMPLE_SWAP_FIT=$f IPC_DPSAMPLE_SWAP_STREAMING=${st:-0} IPC_DPSAMPLE_SWAP_CHUNK=${ch:-32768} IPC_DPSAMPLE_SWAP_BLOCK=${bl:-512} step "${T_KNOB:-40}" "$out/knobs.log" python3 scripts/bench_onesided.py --big-only --reps 10 --out "/tmp/knobs/$c-$u-$f-${st:-0}-${ch:-32768}-${bl:-512}"
done
if [ "${KNOBS_PICK:-0}" = 1 ] && [ -d /tmp/knobs ]; then
  best=$(python3 - <<'PY'
import json, pathlib
best = None
for p in pathlib.Path("/tmp/knobs").glob("*/bench_onesided.json"):
    rows = json.loads(p.read_text())["rows"]
    r = [x["ratio_to_copy"] for x in rows if x["tp"] > 1 and x["mode"] == "eager gated"]
    if r and (best is None or r[0] > best[0]):
        best = (r[0], p.parent.name)
print(best[1] if best else "")
PY
)
  if [ -n "$best" ]; then
    IFS=- read -r c u f st ch bl <<< "$best"
    export IPC_DPSAMPLE_SWAP_CTAS_PER_SM=$c IPC_DPSAMPLE_SWAP_UNROLL=$u IPC_DPSAMPLE_SWAP_FIT=$f IPC_DPSAMPLE_SWAP_STREAMING=$st IPC_DPSAMPLE_SWAP_CHUNK=$ch IPC_DPSAMPLE_SWAP_BLOCK=$bl
    echo "[knobs] best ctas_per_sm=$c unroll=$u fit=$f streaming=$st chunk=$ch block=$bl, used from here on" | tee -a "$out/knobs.log"
  fi
fi
step "${T_BENCH:-100}" "$out/bench.log" python3 scripts/bench_onesided.py --out "$out" ${BENCH_ARGS:-}
step "${T_PROFILE:-0}" "$out/bench.log" python3 scripts/profile_host.py
# the thread method: a test stuck inside NCCL (C code) still gets its stacks dumped
step "${T_NCCL:-90}" "$out/nccl.log" "${py[@]}" --timeout 40 --timeout-method=thread tests/test_nccl_gpu.py
step "${T_RELIABILITY:-90}" "$out/reliability.log" "${py[@]}" -s --timeout 180 --basetemp=/tmp/rel tests/test_reliability_gpu.py -k "not dead_peer"
IPC_DPSAMPLE_RELIABILITY_OUT=$out/kill IPC_DPSAMPLE_KILL_TRIALS=${KILL_TRIALS:-20} step "${T_KILL:-0}" "$out/reliability.log" "${py[@]}" -s --timeout 900 --basetemp=/tmp/rel tests/test_reliability_gpu.py -k dead_peer
for f in $(find /tmp/rel -name "*.startup-error" 2>/dev/null | head -1) $(find /tmp/rel -name "pair*.log" 2>/dev/null | head -1); do
  echo "== $f" >> "$out/reliability.log"; tail -25 "$f" >> "$out/reliability.log"
done
step "${T_MEMCHECK:-0}" "$out/misc.log" "${san[@]}" memcheck python3 scripts/sanitize_smoke.py 2
for tool in synccheck racecheck; do
  for tp in ${SAN_TPS:-1}; do
    step "${T_SYNCCHECK:-0}" "$out/misc.log" "${san[@]}" $tool python3 scripts/sanitize_smoke.py "$tp"
  done
done
step "${T_DOCTOR:-0}" "$out/misc.log" python3 -m ipc_dpsample doctor
step "${T_DEMO:-0}" "$out/misc.log" python3 -m ipc_dpsample demo
step "${T_SWEEP:-0}" "$out/misc.log" python3 -m ipc_dpsample bench --tp 8 --pad-bs 8,64,256 --dtype bf16 --mode eager,graph --iters 20 --warmup 5 --timeout 55 --out /tmp/sweep
cp /tmp/sweep/bench.csv /tmp/sweep/bench.png "$out/" 2>/dev/null
ls -d /tmp/i1[34]* >/dev/null 2>&1 && tar czf "$out/bench_i13_i14.tgz" -C /tmp $(cd /tmp && ls -d i1[34]*)
for f in onesided graph bsargmax nccl reliability; do
  [ -f "$out/$f.log" ] && grep -E '^[0-9]+ (passed|failed)|^=* ?[0-9]+ (passed|failed)|[0-9]+ (passed|failed).* in ' "$out/$f.log" | sed "s/^/$f: /"
done
grep -hE "^(FAILED|ERROR)" "$out"/*.log | cut -c1-300 | head -20
grep -hE "^(# |what|swap|host|gather)" "$out/knobs.log" 2>/dev/null | grep -vE "^# gated" | head -40
grep -hE "^(# NVIDIA|what|swap|host|gather)|FAILED" "$out/bench.log" | cut -c1-400 | head -30
grep -E "ERROR SUMMARY|sanitize_smoke|^### |construction tp" "$out/misc.log" | tail -24

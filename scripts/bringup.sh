#!/usr/bin/env bash
# Bring-up of a GPU (NVLink) box for ipc_dpsample: one timestamped report folder
# holding the doctor's report, the test suite under plain pytest, torchrun and
# mpirun, the demo and a benchmark sweep on all GPUs, plus summary.txt.
#
# Usage: scripts/bringup.sh [REPORT_DIR]
#   REPORT_DIR    default: $OUT/bringup-<UTC timestamp> when OUT is set, else
#                 bringup-reports/bringup-<UTC timestamp> in the repository
# Environment:
#   PYTHON        interpreter (default python3)
#   NGPU          GPUs to use (default: what torch sees; 0 runs the CPU path)
#   STEP_TIMEOUT  seconds per step before it is killed (default 3600)
#   BENCH_ARGS    arguments for `ipc-dpsample bench` instead of the default sweep
#   SKIP          step names to skip, space-separated (e.g. "mpirun bench")
#
# Every step runs even when an earlier one failed; its exit status, duration and
# log are recorded in steps.tsv and summary.txt. The script exits 1 when any step
# failed, 0 otherwise.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
STAMP="$(date -u +%Y%m%dT%H%M%SZ)"
REPORT="${1:-${OUT:-$ROOT/bringup-reports}/bringup-$STAMP}"
STEP_TIMEOUT="${STEP_TIMEOUT:-3600}"
SKIP="${SKIP:-}"
mkdir -p "$REPORT"
REPORT="$(cd "$REPORT" && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
IPC=("$PY" -m ipc_dpsample)
STEPS="$REPORT/steps.tsv"
FAILED=0

if [[ -z "${NGPU:-}" ]]; then
  NGPU="$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)"
fi
# Ranks for the launcher runs of the test suite: one per GPU, 2 CPU ranks without GPUs.
NPROC=$((NGPU > 0 ? NGPU : 2))

printf 'step\tstatus\trc\tseconds\tlog\n' >"$STEPS"
: >"$REPORT/commands.txt"

is_skipped() {
  local name=$1 s
  for s in $SKIP; do
    if [[ "$s" == "$name" ]]; then
      return 0
    fi
  done
  return 1
}

# run_step NAME [--stdout FILE] COMMAND...: run COMMAND with a time limit, stdout
# and stderr to NAME.log (stdout to FILE when given), and record the outcome.
run_step() {
  local name=$1
  shift
  local out="$REPORT/$name.log" log="$REPORT/$name.log"
  if [[ "${1:-}" == "--stdout" ]]; then
    out=$2
    shift 2
  fi
  if is_skipped "$name"; then
    printf '%s\tskipped\t-\t0\t-\n' "$name" >>"$STEPS"
    echo "== $name: skipped (SKIP)"
    return 0
  fi
  local limit=()
  if command -v timeout >/dev/null 2>&1; then
    limit=(timeout --kill-after=60 "$STEP_TIMEOUT")
  fi
  printf '%s: %s\n' "$name" "$*" >>"$REPORT/commands.txt"
  echo "== $name: $*"
  local start rc=0
  start=$(date +%s)
  if [[ "$out" == "$log" ]]; then
    "${limit[@]}" "$@" >"$log" 2>&1 || rc=$?
  else
    "${limit[@]}" "$@" >"$out" 2>"$log" || rc=$?
  fi
  local secs=$(($(date +%s) - start)) status=passed
  if ((rc != 0)); then
    status=failed
    FAILED=1
    if ((rc == 124 || rc == 137)); then
      status=timeout
    fi
  fi
  printf '%s\t%s\t%d\t%d\t%s\n' "$name" "$status" "$rc" "$secs" "$(basename "$log")" >>"$STEPS"
  echo "   $status (rc=$rc, ${secs}s) -> $log"
}

collect_system_info() {
  local f="$REPORT/system.txt"
  {
    echo "# date: $(date -u)"
    echo "# host: $(hostname)"
    echo "# repository: $ROOT @ $(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo '?')"
    git -C "$ROOT" status --short 2>/dev/null | sed 's/^/#   /' || true
    echo "# NGPU=$NGPU NPROC=$NPROC PYTHON=$PY"
    echo
    echo "## nvidia-smi"
    nvidia-smi 2>&1 || echo "(nvidia-smi unavailable)"
    echo
    echo "## nvidia-smi topo -m"
    nvidia-smi topo -m 2>&1 || echo "(unavailable)"
    echo
    echo "## nvidia-smi nvlink --status"
    nvidia-smi nvlink --status 2>&1 || echo "(unavailable)"
    echo
    echo "## environment (CUDA/NCCL/torch/IPC_DPSAMPLE)"
    env | grep -E '^(CUDA|NCCL|TORCH|PYTORCH|IPC_DPSAMPLE|OMP|LD_LIBRARY_PATH)' | sort || true
    echo
    echo "## python packages"
    "$PY" -m pip list 2>/dev/null | grep -i -E 'torch|cupy|nccl|numpy|numba|mpi4py|pytest|nvidia' || true
    echo
    echo "## /dev/shm"
    df -h /dev/shm 2>&1 || true
  } >"$f" 2>&1
}

default_bench_args() {
  if ((NGPU == 0)); then
    echo "--cpu --tp 2 --pad-bs 8,64 --iters 20 --warmup 5"
    return
  fi
  local tps=() t
  if ((NGPU == 1)); then
    tps=(2 4 8) # in-process ranks on the one GPU (one-sided backend)
  else
    for t in 2 4 8 16; do
      if ((t <= NGPU)); then
        tps+=("$t")
      fi
    done
    [[ " ${tps[*]} " == *" $NGPU "* ]] || tps+=("$NGPU")
  fi
  local IFS=,
  echo "--tp ${tps[*]}"
}

echo "ipc_dpsample bring-up: report in $REPORT (NGPU=$NGPU)"
collect_system_info

run_step doctor-json --stdout "$REPORT/doctor.json" "${IPC[@]}" doctor --json
run_step doctor --stdout "$REPORT/doctor.txt" "${IPC[@]}" doctor
run_step pytest "$PY" -m pytest tests -q -rfEs -p no:cacheprovider \
  --junitxml="$REPORT/pytest.xml"
if "$PY" -c 'import torch.distributed.run' >/dev/null 2>&1; then
  run_step torchrun "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
    -m pytest tests -q -rfEs -p no:cacheprovider
else
  printf 'torchrun\tskipped\t-\t0\t-\n' >>"$STEPS"
fi
if command -v mpirun >/dev/null 2>&1; then
  MPI_FLAGS=()
  if mpirun --version 2>&1 | grep -q "Open MPI"; then
    MPI_FLAGS=(--oversubscribe)
    if ((EUID == 0)); then
      MPI_FLAGS+=(--allow-run-as-root)
    fi
  fi
  run_step mpirun mpirun "${MPI_FLAGS[@]}" -np "$NPROC" "$PY" -m pytest tests -q -rfEs \
    -p no:cacheprovider
else
  printf 'mpirun\tskipped\t-\t0\t(mpirun not found)\n' >>"$STEPS"
fi
run_step demo "${IPC[@]}" demo
read -r -a BENCH <<<"${BENCH_ARGS:-$(default_bench_args)}"
run_step bench "${IPC[@]}" bench "${BENCH[@]}" --out "$REPORT/bench"

# -- summary -------------------------------------------------------------------------
{
  echo "ipc_dpsample bring-up report"
  echo "  folder:     $REPORT"
  echo "  finished:   $(date -u)"
  echo "  host:       $(hostname), NGPU=$NGPU"
  echo "  repository: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')"
  echo
  echo "doctor verdict:"
  "$PY" - "$REPORT/doctor.json" <<'EOF' 2>&1 || echo "  (doctor.json unreadable)"
import json, sys
r = json.load(open(sys.argv[1]))
print("  " + r["verdict"]["text"])
sel = r["selection"]
print(f"  auto -> {sel['backend']}: {sel['reason']}")
for h in r["hazards"]:
    print(f"  [{h['severity']}] {h['message']}")
for t in r["selftests"]:
    print(f"  self-test {t['name']}: {t['status']}")
EOF
  echo
  echo "steps:"
  column -t -s $'\t' "$STEPS" 2>/dev/null | sed 's/^/  /' || sed 's/^/  /' "$STEPS"
  echo
  echo "test results:"
  for name in pytest torchrun mpirun; do
    if [[ -f "$REPORT/$name.log" ]]; then
      # totals and crashes first, then the failing tests; "2x" = seen on 2 ranks
      {
        grep -E '^=* ?[0-9]+ (passed|failed|skipped|errors?)|Fatal Python error|exitcode +:' \
          "$REPORT/$name.log" | sort | uniq -c
        grep -E '^(FAILED|ERROR) ' "$REPORT/$name.log" | sort | uniq -c | head -20
      } | sed -E "s/^ *([0-9]+) /  $name: \1x /" || true
    fi
  done
  echo
  echo "demo:"
  if [[ -f "$REPORT/demo.log" ]]; then
    tail -12 "$REPORT/demo.log" | sed 's/^/  /'
  fi
  echo
  echo "bench: $REPORT/bench/{bench.csv,bench.json,bench.png}"
  if [[ -f "$REPORT/bench/bench.json" ]]; then
    "$PY" - "$REPORT/bench/bench.json" <<'EOF' 2>&1 || true
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
ok = [r for r in rows if r["status"] == "ok"]
print(f"  {len(ok)} points measured, {sum(r['status'] == 'failed' for r in rows)} failed, "
      f"{sum(r['verified'] is False for r in rows)} wrong results")
best = {}
for r in ok:
    if r["kind"] == "backend" and r["op"] == "swap_batch_vocab" and r["mode"] == "eager":
        key = (r["tp"], r["dtype"], r["pad_bs"])
        if key not in best or r["median_us"] < best[key]["median_us"]:
            best[key] = r
for (tp, dtype, pad_bs), r in sorted(best.items()):
    ratios = ", ".join(f"{k[3:]} {r[k]:.2f}x" for k in ("vs_copy", "vs_nccl_cupy", "vs_torch_dist")
                       if r.get(k) is not None)
    print(f"  swap tp={tp} {dtype} pad_bs={pad_bs}: {r['impl']} {r['median_us']:.1f} us "
          f"({r['algbw_gbps']:.1f} GB/s; {ratios})")
EOF
  fi
  echo
  if ((FAILED)); then echo "RESULT: FAILED (see steps above)"; else echo "RESULT: all steps passed"; fi
} >"$REPORT/summary.txt" 2>&1

cat "$REPORT/summary.txt"
exit "$FAILED"

# Sourced by scripts/device_run.sh and scripts/device_verify.sh: the environment of a
# device session ($out, PYTHONPATH, GIT_COMMIT) and `step`, which runs one command
# under its own time limit, appends its output to a log and keeps going past failures.
out=${OUT:-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD CUDA_DEVICE_MAX_CONNECTIONS=32
# a tree exported without .git (git archive HEAD) carries its commit in COMMIT
export GIT_COMMIT=${GIT_COMMIT:-$(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)}
step() {  # step SECONDS LOGFILE COMMAND...
  local t=$1 log=$2; shift 2
  [ "$t" -gt 0 ] || { echo "[skipped] $*"; return 0; }
  local t0=$SECONDS
  echo "### $* (limit ${t}s)" >> "$log"
  # STEP_SIGNAL=ABRT with python3 -X faulthandler: a stalled step dumps every thread
  timeout -s "${STEP_SIGNAL:-TERM}" -k 10 "$t" "$@" >> "$log" 2>&1
  local rc=$?
  echo "### rc=$rc after $((SECONDS - t0))s" >> "$log"
  echo "[rc=$rc at ${SECONDS}s] $*"
  tail -n 3 "$log"
}
# step_in TREE SECONDS LOGFILE COMMAND...: `step` run inside another exported tree (an A/B
# of several commits in one device call: each `git archive` export carried as its own
# folder, its commit in COMMIT), that tree's PYTHONPATH and GIT_COMMIT; the log stays
# under this session's $out, and "LOGFILE TREE time" goes to $out/misc.log
step_in() {
  local tree=$1 t=$2 log=$3 here=$out; shift 3
  case "$here" in /*) ;; *) here=$PWD/$here ;; esac
  ( cd "$tree" && unset GIT_COMMIT && OUT=$here . scripts/device_steps.sh >/dev/null &&
    step "$t" "$here/$log" "$@" )
  echo "$log $tree $(date -u +%T)" >> "$here/misc.log"
}

# -- A/B calls of verify_batch_vocab (BENCHMARKS.md's sections) ------------------------
# ab_misc TREE...: the call's misc.log header: the date, the GPU, each exported tree's
# commit (step_in then appends "LOGFILE TREE time" a step)
ab_misc() {
  { date -u; nvidia-smi -L
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    for d in "$@"; do echo "$d $(cat "${d%%:*}/COMMIT")"; done; } > "$out/misc.log" 2>&1
}
# A tree SPEC is an exported tree, optionally with environment knobs for its steps:
# DIR or DIR:VAR=VALUE[,VAR=VALUE...] (e.g. .devtree_a:IPC_DPSAMPLE_VERIFY_CTAS_PER_SM=4).
# spec_name SPEC: a log-file name for it, of letters, digits, '.', '_' and '-' only
# (.devtree_a:IPC_DPSAMPLE_X=1,IPC_DPSAMPLE_Y=2 -> a_X-1_Y-2)
spec_name() {
  local dir=${1%%:*} knobs=""
  [ "$dir" != "$1" ] && knobs=_$(printf %s "${1#*:}" | sed 's/IPC_DPSAMPLE_//g; s/=/-/g; s/,/_/g')
  printf '%s%s' "$(basename "$dir" | sed 's/^\.devtree_//')" "$knobs" | tr -c 'A-Za-z0-9._-' _
}
# spec_in SPEC SECONDS LOGFILE COMMAND...: step_in the SPEC's tree with its knobs exported,
# after a "== SPEC" line in LOGFILE (which spec a shared bench log's run is)
spec_in() {
  local spec=$1 here=$out; shift
  case "$here" in /*) ;; *) here=$PWD/$here ;; esac
  echo "== $spec" >> "$here/$2"
  (
    if [ "${spec%%:*}" != "$spec" ]; then
      IFS=, read -ra kv <<< "${spec#*:}"
      for a in "${kv[@]}"; do export "${a?}"; done
    fi
    step_in "${spec%%:*}" "$@"
  )
}
# the gated benches: B8 (pad_bs=8, graph-replayed, against argmax_batch_vocab) and B256
# (pad_bs=256, eager, fp32 and bf16, against read_once), as arrays: "${B8[@]}" --verify-mix MIX
VERIFY_COMMON=(--gated --tp 8 --num-tokens 4 --vocab 152064 --backends onesided --iters 10
  --warmup 3 --ops verify_batch_vocab)
B8=("${VERIFY_COMMON[@]}" --pad-bs 8 --mode graph --dtype fp32 --verify-baselines
  argmax_batch_vocab)
B256=("${VERIFY_COMMON[@]}" --pad-bs 256 --mode eager --dtype fp32,bf16 --verify-baselines
  read_once)
# the GPU tests' pytest command (each test file or -k selection after it)
GPU_PYTEST=(python3 -X faulthandler -m pytest -q -p no:cacheprovider -rfE --tb=short)
# ab_summary: the lines a call's closing note quotes (bench tables, bit-for-bit checks,
# pytest summaries), from every log under $out
ab_summary() {
  cat "$out/misc.log"
  grep -H "dp_verify_combine, the whole\|dp_verify_records, one\|checked bit\|WRONG\|Error" \
    "$out"/bvk-*.log 2>/dev/null | sed "s|^$out/||" | cut -c1-180
  for l in "$out"/bench-b*.log; do
    [ -e "$l" ] || continue
    echo "== $l"
    grep -h "^== \|^# ipc-dpsample bench\|^onesided  \(float32\|bfloat16\)\|no point failed\|FAIL\|Error" \
      "$l" | cut -c1-170
  done
  grep -H "passed\|failed\|error" "$out"/tests-*.log 2>/dev/null | sed "s|^$out/||"
}

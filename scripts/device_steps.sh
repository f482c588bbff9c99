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

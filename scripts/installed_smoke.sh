#!/usr/bin/env bash
# First contact, as a user has it: install the package from a built wheel into an
# empty folder (never the source tree) and run the demo, the doctor and a short bench
# from outside the tree. Usage: scripts/installed_smoke.sh WHEEL [LOG]
# On the GPU machine (no registry there) the wheel is built here and carried:
#   pip wheel --no-deps --no-build-isolation -w .whl .   (then name .whl in carry)
set -u
wheel=$(readlink -f "$1")
log=$(readlink -f "${2:-installed-smoke.log}")
site=$(mktemp -d /tmp/ipc-dpsample-site.XXXXXX)
work=$(mktemp -d /tmp/ipc-dpsample-user.XXXXXX)
: > "$log"
run() {  # run SECONDS COMMAND...: logged, time-limited, keeps going past failures
  local t=$1; shift
  echo "### $* (limit ${t}s)" >> "$log"
  (cd "$work" && timeout -k 10 "$t" "$@") >> "$log" 2>&1
  local rc=$?
  echo "### rc=$rc" >> "$log"
  echo "[rc=$rc] $*"
}
python3 -m pip install -q --no-deps --no-index --target "$site" "$wheel" >> "$log" 2>&1 || { echo "install failed"; cat "$log"; exit 1; }
export PYTHONPATH=$site PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
unset IPC_DPSAMPLE_BACKEND
run 60 python3 -c "import ipc_dpsample, ipc_dpsample.backends.onesided, ipc_dpsample.backends.nccl, ipc_dpsample.backends.torch; print(ipc_dpsample.__version__, ipc_dpsample.__file__)"
run 180 python3 -m ipc_dpsample demo
run 120 python3 -m ipc_dpsample doctor
run 240 python3 -m ipc_dpsample bench --iters 10
grep -n "ipc_dpsample/__init__.py\|^OK\|FAILED\|MISSED\|Error" "$log" | head -40

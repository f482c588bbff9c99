#!/usr/bin/env bash
# Run the GPU test files one pytest process per group, so a crash in one group
# cannot hide the others' results; logs go to ${OUT:-out}/.
set -u
out=${OUT:-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
# in-process ranks spin in kernels on one GPU: give every stream its own hardware queue
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-32}
status=0
for spec in "$@"; do
  name=$(echo "$spec" | tr -c 'A-Za-z0-9_' '_' | cut -c1-60)
  timeout 560 python3 -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning \
    --timeout 400 -rfE $spec > "$out/$name.log" 2>&1
  rc=$?
  [ $rc -ne 0 ] && status=1
  echo "== $spec (rc=$rc): $(grep -E '(passed|failed|error)' "$out/$name.log" | tail -1)"
  grep -E '^(FAILED|ERROR)|rank [0-9]+: \(|Fatal Python' "$out/$name.log" | cut -c1-600 | head -12
done
exit $status

#!/usr/bin/env bash
# session 19 call 2 (what device time allowed): the GPU tests of the default build (69e2b05,
# IPC_DPSAMPLE_VERIFY_TEMP_ONEPASS=1) that run float32 temperature rows of batches without
# top-k rows: the rank-thread matrix, the real vocabulary, 50 graph replays, and the NCCL
# backend's record kernels; each command within its own time limit ($LIM1, $LIM2 seconds)
cd "$(dirname "$0")/.devtree_q" || exit 2
date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
cat COMMIT
P=(python3 -X faulthandler -m pytest -q -p no:cacheprovider -rfE --tb=short)
PYTHONPATH=$PWD timeout "${LIM1:-120}" "${P[@]}" tests/test_verify_onesided_gpu.py \
  -k "rank_threads or real_vocabulary or graph_replayed" 2>&1 | tail -25; echo "rc=${PIPESTATUS[0]} at $SECONDS s"
PYTHONPATH=$PWD timeout "${LIM2:-45}" "${P[@]}" tests/test_nccl_verify_gpu.py 2>&1 | tail -8; echo "rc=${PIPESTATUS[0]} at $SECONDS s"
date -u

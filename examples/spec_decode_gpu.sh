#!/usr/bin/env bash
# spec_decode.py on one GPU (issue 25). Correctness first, then the benchmark rows:
#
#   * greedy: every route at tp = 1, 2, 4, 8 (rank threads sharing the GPU, device bs)
#     gives the tokens of plain decoding (--check compares, and the run fails on a
#     difference); the same with --cuda-graph, with bfloat16 logits, and with rank
#     processes (CUDA IPC) instead of threads;
#   * sampled: swap at tp = 1 and 8, eager and graphed, against plain sampled decoding;
#     with the package's reference sampler at tp=4; fused (when the package has
#     verify_batch_vocab) greedy and sampled against plain decoding with that sampler;
#   * benchmark: tp=8 ranks sharing the GPU, 64 requests, 64 new tokens, 3 runs each
#     (run 1 includes warm-up), swap and argmax, greedy and sampled, eager and graphed.
#
# Usage: examples/spec_decode_gpu.sh [LOG_DIR [check|bench|all]]
#   (defaults: spec_decode_gpu_logs, all). Every run's output is kept in
#   LOG_DIR/<name>.log and summary.txt holds one line per run. A failing run does not
#   stop the others; the script exits non-zero at the end, naming them. RUN_TIMEOUT
#   (seconds, default 400) bounds each run.
set -uo pipefail
cd "$(dirname "$0")/.."
logs=${1:-spec_decode_gpu_logs}
phase=${2:-all}
failed=()
mkdir -p "$logs"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} CUDA_DEVICE_MAX_CONNECTIONS=32
py=${PYTHON:-python3}
small="--device cuda --requests 16 --max-new-tokens 32 --seed 3"
big="--device cuda --requests 64 --max-new-tokens 64 --seed 3 --repeat 3"
sampled="--temperature 0.8 --top-k 50 --top-p 0.9"
: >"$logs/runs.txt"

run() {
    local name=$1
    shift
    echo "=== $name: python examples/spec_decode.py $*"
    # shellcheck disable=SC2086  # RUN_ENV: optional VAR=value words for this run
    if env ${RUN_ENV:-} timeout "${RUN_TIMEOUT:-400}" "$py" examples/spec_decode.py "$@" 2>&1 |
        tee "$logs/$name.log"; then
        echo "$name" >>"$logs/runs.txt"
    else
        failed+=("$name")
    fi
}

"$py" -c 'import torch, cupy; print("torch", torch.__version__, torch.cuda.get_device_name(0), "cupy", cupy.__version__)'
git log -1 --format='commit %h %cd' 2>/dev/null || true

if [ "$phase" != bench ]; then
run ref $small --no-spec
for tp in 1 2 4 8; do
    for route in swap argmax; do
        run "greedy-$route-tp$tp" $small --tp "$tp" --verify "$route" --device-bs --check
    done
done
run graph-swap-tp8 $small --tp 8 --verify swap --cuda-graph --check
run graph-argmax-tp8 $small --tp 8 --verify argmax --cuda-graph --check
run bf16-argmax-tp4 $small --tp 4 --verify argmax --logits-dtype bfloat16 --check
run procs-swap-tp2 $small --tp 2 --verify swap --launch processes --check
run sampled-swap-tp1 $small --tp 1 --verify swap $sampled --check
run sampled-swap-tp8 $small --tp 8 --verify swap $sampled --check
run sampled-graph-tp8 $small --tp 8 --verify swap $sampled --cuda-graph --check
# the package's reference sampler (host NumPy; a small vocabulary keeps it quick)
pkg="--sampler package --vocab-size 4200 --vocab-limit 4000"
run sampled-pkg-swap-tp4 $small --tp 4 --verify swap $sampled $pkg --check
if "$py" -c 'import sys; from ipc_dpsample import DpSamplingComm as C; sys.exit(not hasattr(C, "verify_batch_vocab"))'; then
    # fused on the default backend (onesided: its kernels) with rank threads; set
    # FUSED_ENV=IPC_DPSAMPLE_BACKEND=torch FUSED_LAUNCH="--launch processes" for the
    # torch backend's host algorithm
    fenv=${FUSED_ENV-}
    flaunch=${FUSED_LAUNCH-}
    for tp in 2 8; do
        RUN_ENV=$fenv run "greedy-fused-tp$tp" $small --tp "$tp" --verify fused $flaunch \
            --device-bs --check
        RUN_ENV=$fenv run "sampled-fused-tp$tp" $small --tp "$tp" --verify fused $flaunch \
            $sampled $pkg --check
    done
    run graph-fused-tp8 $small --tp 8 --verify fused --cuda-graph --check  # onesided
fi
fi

if [ "$phase" != check ]; then

run bench-nospec-tp1 $big --no-spec
for route in swap argmax; do
    run "bench-$route-tp8" $big --tp 8 --verify "$route"
    run "bench-$route-tp8-graph" $big --tp 8 --verify "$route" --cuda-graph
done
run bench-swap-tp8-sampled $big --tp 8 --verify swap $sampled
run bench-swap-tp8-sampled-graph $big --tp 8 --verify swap $sampled --cuda-graph
if "$py" -c 'import sys; from ipc_dpsample import DpSamplingComm as C; sys.exit(not hasattr(C, "verify_batch_vocab"))'; then
    fenv=${FUSED_ENV-IPC_DPSAMPLE_BACKEND=torch}
    flaunch=${FUSED_LAUNCH---launch processes}
    RUN_ENV=$fenv run bench-fused-tp8 $big --tp 8 --verify fused $flaunch
    RUN_ENV=$fenv run bench-fused-tp8-sampled $big --tp 8 --verify fused $flaunch $sampled
    run bench-fused-tp8-graph $big --tp 8 --verify fused --cuda-graph  # onesided
fi
fi
echo "=== summary (ms per step of the last run; share: verify comm + math over the step)"
"$py" - "$logs" <<'PY' | tee "$logs/summary.txt"
import json, pathlib, sys
logs = pathlib.Path(sys.argv[1])
for name in (logs / "runs.txt").read_text().split():
    d = json.loads((logs / f"{name}.log").read_text().strip().splitlines()[-1])
    t, acc = d["timing_ms_per_step"], d["accept_rate"]
    print(
        f"{name:<30} tp={d['tp']} {d['mode']:<7} {d['backend']:<8} graph={int(d['cuda_graph'])} "
        f"tok/s={d['tokens_per_s']:>9.1f} accept={'-' if acc is None else f'{acc:.3f}'} "
        f"steps={d['steps']:>3} fwd={t['forward']:.2f} comm={t['verify_comm']:.2f} "
        f"verify={t['verify_math']:.2f} rest={t['rest']:.2f} share={d['verify_share']:.3f}"
    )
PY
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]} (see $logs/<name>.log)" >&2
    exit 1
fi

"""Known hazards and the backend ``auto`` would choose, judged from the facts the
doctor collected (pure functions: :func:`find_hazards`, :func:`selection_facts`,
:func:`collect_selection`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["SHM_MIN_BYTES", "collect_selection", "find_hazards", "selection_facts"]

#: /dev/shm smaller than this is Docker's default-sized one, not the host's.
SHM_MIN_BYTES = 1 << 30


# -- hazards ------------------------------------------------------------------------
def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() not in ("", "0", "false", "no", "off")


def find_hazards(
    *,
    env: Mapping[str, str],
    shm: int | None,
    gpus: Mapping[str, Any],
    p2p: Mapping[str, Any],
    backends: Mapping[str, Mapping[str, Any]],
) -> list[dict[str, str]]:
    """Known hazards, from the environment and the facts collected (pure).

    Severities: ``error`` breaks the fast path on a GPU machine (the verdict
    fails), ``warning`` degrades it or breaks neighbours, ``info`` is context.
    """
    out: list[dict[str, str]] = []

    def add(id_: str, severity: str, message: str, fix: str) -> None:
        out.append({"id": id_, "severity": severity, "message": message, "fix": fix})

    n_gpus = max(int(gpus["torch_count"]), int(gpus["cupy_count"]))
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        conf = env.get(var, "").replace(" ", "").lower()
        if "expandable_segments:true" in conf:
            add(
                "expandable-segments",
                "warning",
                f"{var} enables expandable_segments: such torch allocations cannot be "
                "exported through CUDA IPC (ipc_dpsample's own cudaMalloc arena is "
                "unaffected; torch symmetric memory and IPC-based all-reduce are not)",
                f"unset {var} or set expandable_segments:False",
            )
    if _truthy(env.get("NCCL_P2P_DISABLE")):
        add(
            "nccl-p2p-disable",
            "warning",
            f"NCCL_P2P_DISABLE={env.get('NCCL_P2P_DISABLE')}: auto will not use the one-sided "
            "backend and NCCL avoids NVLink peer-to-peer",
            "unset NCCL_P2P_DISABLE unless peer-to-peer is broken on purpose",
        )
    if shm is None:
        add(
            "no-dev-shm",
            "warning",
            "/dev/shm is missing: NCCL's shared-memory transport and torch multiprocessing fail",
            "mount a tmpfs at /dev/shm (docker: --ipc=host or --shm-size=16g)",
        )
    elif shm < SHM_MIN_BYTES:
        add(
            "small-dev-shm",
            "warning",
            f"/dev/shm is only {shm / 2**20:.0f} MiB (a container's private IPC namespace with "
            "the default size): NCCL's shared-memory transport can fail",
            "run the container with --ipc=host (or --shm-size=16g)",
        )
    if int(gpus["torch_count"]) > 0 and int(gpus["cupy_count"]) == 0:
        add(
            "cupy-no-gpu",
            "error",
            f"torch sees {gpus['torch_count']} GPU(s) but CuPy cannot drive them "
            f"({gpus.get('error') or 'no detail'}): the one-sided and NCCL backends cannot run",
            "install the CuPy wheel matching the driver's CUDA (cupy-cuda12x or cupy-cuda13x)",
        )
    elif int(gpus["cupy_count"]) > 0 and int(gpus["torch_count"]) == 0:
        add(
            "torch-no-cuda",
            "warning",
            f"CuPy sees {gpus['cupy_count']} GPU(s) but torch has no CUDA (a CPU build?)",
            "install a CUDA build of torch",
        )
    elif int(gpus["torch_count"]) != int(gpus["cupy_count"]):
        add(
            "gpu-count-mismatch",
            "warning",
            f"torch sees {gpus['torch_count']} GPUs, CuPy {gpus['cupy_count']}",
            "check CUDA_VISIBLE_DEVICES and that both use the same driver",
        )
    for pair in p2p.get("pairs", []):
        if pair["verified"]:
            continue
        a, b = pair["a"], pair["b"]
        expected = a == b or pair["driver"] is not False
        add(
            f"ipc-failed-{a}-{b}",
            "error" if expected else "warning",
            f"CUDA IPC write/read-back between processes on GPU {a} and GPU {b} failed: "
            f"{pair['detail']}"
            + ("" if expected else " (the driver reports no peer access for this pair)"),
            "run containers with --ipc=host --pid=host (or share the IPC namespace), make "
            "every process see the same GPUs, check nvidia-smi topo -m and the driver log",
        )
    if n_gpus > 0:
        for name, what in (("onesided", "the one-sided backend"), ("nccl", "the NCCL backend")):
            info = backends.get(name, {})
            if not info.get("importable", False):
                add(
                    f"{name}-unavailable",
                    "warning",
                    f"{what} is unavailable here: {info.get('error') or 'unknown reason'}",
                    "install the missing dependency (cupy-cuda12x/13x, nvidia-nccl-cu12/13)",
                )
    if env.get("IPC_DPSAMPLE_BACKEND"):
        add(
            "backend-override",
            "info",
            f"IPC_DPSAMPLE_BACKEND={env['IPC_DPSAMPLE_BACKEND']} overrides every "
            "communicator's backend argument",
            "unset it to let auto choose",
        )
    if env.get("CUDA_VISIBLE_DEVICES") is not None:
        add(
            "cuda-visible-devices",
            "info",
            f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}: only these GPUs are checked",
            "unset it to check every GPU",
        )
    return out


# -- selection ----------------------------------------------------------------------
def selection_facts(report: Mapping[str, Any], env: Mapping[str, str]) -> tuple[Any, str]:
    """The :class:`~ipc_dpsample.select.Facts` of a group made of every local GPU
    (or one CPU rank), from the collected report; and a note on the request."""
    from ...config import BACKENDS
    from ...select import Facts

    note = ""
    requested = (env.get("IPC_DPSAMPLE_BACKEND") or "auto").strip().lower()
    if requested not in BACKENDS:
        note = f"IPC_DPSAMPLE_BACKEND={requested!r} is invalid (expected one of {BACKENDS})"
        requested = "auto"
    gpus = report["gpus"]
    n = int(gpus["torch_count"]) or int(gpus["cupy_count"])
    p2p = report["p2p"]
    off_diag = [
        (a, b, ok)
        for a, row in enumerate(p2p["driver"])
        for b, ok in enumerate(row)
        if a != b and ok is not None
    ]
    bad = [(a, b) for a, b, ok in off_diag if not ok]
    pairs = p2p["pairs"]
    failed = [p for p in pairs if not p["verified"]]
    facts = Facts(
        requested=requested,  # type: ignore[arg-type]
        device_kind="cuda" if n > 0 else "cpu",
        tp_size=max(1, n),
        cupy_gpu=int(gpus["cupy_count"]) > 0,
        nccl_available=report["versions"]["nccl_cupy"] is not None,
        p2p_ok=(not bad) if off_diag or n == 1 else None,
        p2p_detail=f"GPU {bad[0][0]} -> GPU {bad[0][1]}" if bad else "",
        nccl_p2p_disable=_truthy(env.get("NCCL_P2P_DISABLE")),
        has_torch_group=True,
        ipc_verified=(not failed) if pairs else None,
        ipc_detail=failed[0]["detail"] if failed else "",
    )
    return facts, note


def collect_selection(report: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """What ``backend="auto"`` (or ``IPC_DPSAMPLE_BACKEND``) would choose, and why."""
    from ...errors import BackendUnavailableError
    from ...select import select_backend

    facts, note = selection_facts(report, env)
    try:
        backend, reason = select_backend(facts)
    except BackendUnavailableError as exc:
        backend, reason = None, str(exc)
    if backend in ("onesided", "nccl") and not report["backends"][backend]["importable"]:
        extra = (
            f"but ipc_dpsample.backends.{backend} does not import "
            f"({report['backends'][backend]['error']})"
        )
        note = f"{note}; {extra}" if note else extra
    return {
        "requested": facts.requested,
        "backend": backend,
        "reason": reason,
        "note": note,
        "facts": dataclasses.asdict(facts),
    }

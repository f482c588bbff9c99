"""``ipc-dpsample doctor``: is this machine ready, and which backend would run?

The report (``--json`` prints it; :data:`SCHEMA` describes it) holds, in order:

``verdict``
    ``ok``, ``level`` (``healthy``, ``healthy-cpu`` or ``unhealthy``) and one line of
    text; computed by the pure function :func:`verdict` (rules in its docstring).
``host``, ``versions``
    Python, torch, CuPy, NCCL (CuPy's and torch's), driver, CUDA runtime.
``gpus``
    The CUDA devices with UUIDs, as torch and CuPy see them.
``p2p``
    Peer access as the driver reports it (``cudaDeviceCanAccessPeer``) and as
    verified for real: for every GPU pair ``(a, b)``, ``a <= b``, two spawned
    processes each ``cudaMalloc`` a buffer, export it with ``cudaIpcGetMemHandle``,
    open the peer's with ``cudaIpcOpenMemHandle``, write a random pattern into it
    (half with a kernel's stores, half with ``cudaMemcpy``) and read their own
    buffer back. ``a == b`` checks two processes sharing one GPU.
``topology``
    NVLink state per GPU and per pair from NVML (``pynvml``) when it loads, and the
    ``nvidia-smi topo -m`` matrix when ``nvidia-smi`` exists.
``hazards``
    Settings and environments known to break or slow the library (severity
    ``error``, ``warning`` or ``info``).
``backends``, ``selection``
    Which optional backends import, and the backend ``auto`` would choose for a
    group of all local GPUs (:func:`ipc_dpsample.select.select_backend` on facts
    gathered here) with its reason.
``selftests``
    A short bit-exact run of every backend that can run here (the demo's rank
    body on tiny shapes), ``verify_batch_vocab`` included; a backend without that
    op passes with the detail "verify_batch_vocab not available on <backend> in this
    version".

Exit code 0 when the verdict is ok, 1 otherwise.

The work is split by concern: :mod:`.collect` gathers facts and runs the
self-tests, :mod:`.p2p` checks peer-to-peer access and CUDA IPC, :mod:`.hazards`
judges the facts (hazards, backend selection), :mod:`.report` holds the schema,
the verdict and the text form.
"""

from __future__ import annotations

import argparse
import json
import sys

from .collect import (
    collect,
    collect_gpus,
    collect_host,
    collect_topology,
    collect_versions,
    nccl_version_string,
    plan_selftests,
    run_selftest,
)
from .hazards import collect_selection, find_hazards, selection_facts
from .p2p import collect_p2p, driver_p2p_matrix, verify_ipc_pairs
from .report import (
    SCHEMA,
    SCHEMA_VERSION,
    TOOL,
    VERSION_KEYS,
    format_human,
    level,
    validate,
    verdict,
)

#: ``ipc-dpsample doctor --help``: plain text (argparse prints it as is).
DESCRIPTION = """\
Check this machine for ipc_dpsample: versions, GPUs, peer-to-peer access and
CUDA IPC between every pair of GPUs (verified with real writes), the NVLink
topology and known hazards. Say which backend "auto" would choose and why, and
run a short bit-exact self-test of every backend that can run here. With
--json the report is printed as JSON (its schema is doctor.SCHEMA).

Exit status: 0 when the verdict is healthy, 1 otherwise, 2 on a usage error."""

__all__ = [
    "DESCRIPTION",
    "SCHEMA",
    "SCHEMA_VERSION",
    "TOOL",
    "VERSION_KEYS",
    "add_arguments",
    "collect",
    "collect_gpus",
    "collect_host",
    "collect_p2p",
    "collect_selection",
    "collect_topology",
    "collect_versions",
    "driver_p2p_matrix",
    "find_hazards",
    "format_human",
    "level",
    "nccl_version_string",
    "plan_selftests",
    "run",
    "run_selftest",
    "selection_facts",
    "validate",
    "verdict",
    "verify_ipc_pairs",
]


# -- command line -------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``ipc-dpsample doctor``."""
    p.add_argument(
        "--json",
        action="store_true",
        help=f"print the report as JSON (schema_version {SCHEMA_VERSION}, see doctor.SCHEMA)",
    )


def run(ns: argparse.Namespace) -> int:
    """Run ``ipc-dpsample doctor``; 0 when healthy, 1 otherwise."""

    def progress(step: str) -> None:
        if not ns.json and sys.stderr.isatty():
            print(f"  checking {step}...", file=sys.stderr)

    report = collect(progress=progress)
    if ns.json:
        print(json.dumps(report, indent=2, sort_keys=False))
    else:
        print(format_human(report))
    return 0 if report["verdict"]["ok"] else 1

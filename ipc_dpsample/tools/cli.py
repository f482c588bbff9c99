"""The ``ipc-dpsample`` command line (also ``python -m ipc_dpsample``).

Subcommands
-----------
``demo``
    Run the three collectives, ``argmax_batch_vocab`` and ``verify_batch_vocab`` on
    this machine (once with a real batch ``bs < pad_bs``), verify them against the
    NumPy reference and print a short table (:mod:`ipc_dpsample.demo`).
``doctor``
    Check versions, GPUs, peer-to-peer access, CUDA IPC, the NVLink topology and
    known hazards; say which backend ``auto`` would choose; self-test every backend
    that can run. ``--json`` gives the machine-readable report
    (:mod:`ipc_dpsample.doctor`).
``bench``
    Sweep shapes, dtypes, ranks, backends and eager/graph modes against NCCL,
    torch.distributed and the copy limit; write CSV, JSON and a PNG plot
    (:mod:`ipc_dpsample.bench`).

Every subcommand starts its own ranks, so run it as a plain process, not under
``torchrun`` or ``mpirun``. Exit codes: 0 success, 1 a check failed, 2 usage error.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

from .. import __version__
from ..launch import LAUNCHER_VARS

__all__ = ["build_parser", "launcher_variables", "main"]

#: Variables a launcher sets per rank (one list, in :mod:`ipc_dpsample.launch`).
_LAUNCHER_VARS = LAUNCHER_VARS
#: torchrun's agent variables: with ``TORCHELASTIC_USE_AGENT_STORE=True`` inherited,
#: the ranks this tool spawns would wait for a store that nobody serves.
_LAUNCHER_PREFIXES = ("TORCHELASTIC_",)


def launcher_variables(env: Mapping[str, str]) -> list[str]:
    """Names in ``env`` that a launcher (torchrun, mpirun, srun) set per rank."""
    return [k for k in env if k in _LAUNCHER_VARS or k.startswith(_LAUNCHER_PREFIXES)]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``ipc-dpsample`` (each subcommand sets ``func``)."""
    from . import bench, demo, doctor

    parser = argparse.ArgumentParser(
        prog="ipc-dpsample",
        description="Batch-DP speculative-verify communication: demo, doctor, bench.",
    )
    parser.add_argument("--version", action="version", version=f"ipc-dpsample {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{demo,doctor,bench}")
    sub.required = True
    for name, module, text in (
        ("demo", demo, "run and verify the five ops on this machine"),
        ("doctor", doctor, "check this machine and say which backend would run"),
        ("bench", bench, "benchmark backends against NCCL, torch and the copy limit"),
    ):
        # DESCRIPTION: plain sentences, wrapped by hand (the docstrings are reST)
        p = sub.add_parser(
            name,
            help=text,
            description=module.DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    return parser


def _detach_from_launcher() -> str | None:
    """Make sure this process is not one rank of a launched world.

    Returns an error message when it is (``torchrun``/``mpirun`` with several
    ranks); a launcher world of one is forgotten, so spawned ranks start clean.
    """
    from ..launch import launched_world

    world = launched_world()
    if world is None or os.environ.get("IPC_DPSAMPLE_SPAWNED") == "1":
        return None
    if world[1] > 1:
        return (
            f"ipc-dpsample runs as one process and starts its own ranks, but it was "
            f"launched as rank {world[0]} of {world[1]} (torchrun/mpirun/srun); "
            "run it directly: python -m ipc_dpsample ..."
        )
    for name in launcher_variables(os.environ):
        del os.environ[name]
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ipc-dpsample``; returns the exit code."""
    parser = build_parser()
    ns = parser.parse_args(None if argv is None else list(argv))
    problem = _detach_from_launcher()
    if problem is not None:
        print(f"ipc-dpsample: {problem}", file=sys.stderr)
        return 2
    try:
        return int(ns.func(ns))
    except KeyboardInterrupt:
        print("ipc-dpsample: interrupted", file=sys.stderr)
        return 130

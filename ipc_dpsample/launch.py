"""Initialise torch.distributed from whatever launched this process.

Works the same under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...),
``mpirun``/``mpiexec`` (Open MPI ``OMPI_COMM_WORLD_*``, MPICH/Hydra ``PMI_*``,
PMIx ``PMIX_RANK``; mpi4py, when present, agrees on a free port) and plain
``python`` (a world of one).
"""

from __future__ import annotations

import datetime
import os
import socket

__all__ = ["LAUNCHER_VARS", "free_port", "init_distributed", "launched_world"]

_RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")
_SIZE_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")
_LOCAL_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")
#: Every variable a launcher (torchrun, mpirun, srun) sets per rank: the ones read
#: above plus torchrun's group/role bookkeeping.
LAUNCHER_VARS = (
    *_RANK_VARS,
    *_SIZE_VARS,
    *_LOCAL_VARS,
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
)


def _first(names: tuple[str, ...]) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return None


def launched_world() -> tuple[int, int, int] | None:
    """``(rank, world_size, local_rank)`` when a launcher started this process with
    more than one rank, else None."""
    rank, size = _first(_RANK_VARS), _first(_SIZE_VARS)
    if rank is None or size is None or size < 1:
        return None
    local = _first(_LOCAL_VARS)
    return rank, size, rank if local is None else local


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _mpi_port(rank: int) -> str | None:
    try:
        from mpi4py import MPI
    except Exception:
        return None
    port = free_port() if rank == 0 else None
    return str(MPI.COMM_WORLD.bcast(port, root=0))


def init_distributed(
    backend: str | None = None, *, timeout_s: float = 300.0, device_id: int | None = None
) -> tuple[int, int]:
    """Initialise the default torch.distributed group if nobody has yet.

    Parameters
    ----------
    backend : str or None
        ``"gloo"``, ``"nccl"`` or ``"cpu:gloo,cuda:nccl"``; None picks gloo on a
        CPU-only machine and ``cpu:gloo,cuda:nccl`` where CUDA works.
    timeout_s : float
        The process group's timeout: a collective waiting on a dead peer fails
        after this long instead of hanging.
    device_id : int or None
        Ignored except to select the CUDA device (``LOCAL_RANK`` by default).

    Returns
    -------
    (rank, world_size)
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    world = launched_world()
    rank, size, local = world if world is not None else (0, 1, 0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        port = _mpi_port(rank) if world is not None and size > 1 else None
        os.environ["MASTER_PORT"] = port or (str(free_port()) if size == 1 else "29511")
    cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    if cuda:
        dev = device_id if device_id is not None else local % torch.cuda.device_count()
        torch.cuda.set_device(dev)
    dist.init_process_group(
        backend=backend,
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return rank, size

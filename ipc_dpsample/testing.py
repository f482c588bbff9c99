"""Multi-rank test harness, usable from pytest, torchrun and mpirun alike.

:func:`run_ranks` runs ``body(rank, world_size, group, *args)`` on ``world_size``
ranks:

* launched by ``torchrun``/``mpirun`` (``RANK``/``WORLD_SIZE`` or MPI variables
  set): this process is one rank of an already-launched world; ranks
  ``>= world_size`` sit the test out and the others use the subgroup
  ``tuple(range(world_size))``. A world smaller than needed skips the test
  (under pytest) with a reason that names both sizes.
* otherwise: spawns ``world_size`` fresh processes (``spawn`` start method), each
  initialising torch.distributed over gloo; a failing rank's traceback is raised
  in the parent, and ranks still running after ``timeout_s`` are killed.

:func:`run_threads` runs the ranks as threads of this process with a
:class:`~ipc_dpsample.group.ThreadGroup` (several ranks on one GPU).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from .group import ThreadGroup
from .launch import free_port, init_distributed, launched_world

__all__ = ["RankFailure", "run_ranks", "run_threads"]


class RankFailure(AssertionError):
    """One or more ranks failed; the message holds their tracebacks."""


def _child(
    rank: int,
    world_size: int,
    port: int,
    body: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
    queue: Any,
) -> None:
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        IPC_DPSAMPLE_SPAWNED="1",
    )
    try:
        import torch.distributed as dist

        init_distributed(env.get("IPC_DPSAMPLE_TEST_PG_BACKEND") or None, timeout_s=120)
        try:
            result = body(rank, world_size, None, *args)
        finally:
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        queue.put((rank, True, result))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(
    world_size: int,
    body: Callable[..., Any],
    *args: Any,
    timeout_s: float = 240.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``body(rank, world_size, group, *args)`` on ``world_size`` ranks.

    ``body`` must be importable (a module-level function) for ``spawn``. Returns
    the per-rank results (spawned mode) or ``[result_of_this_rank]`` (launched
    mode; ``[]`` on ranks that sat out).

    Raises
    ------
    RankFailure
        Any rank raised or did not finish within ``timeout_s``.
    """
    launched = launched_world()
    if launched is not None and os.environ.get("IPC_DPSAMPLE_SPAWNED") != "1":
        return _run_launched(world_size, body, args)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(r, world_size, port, body, args, dict(env or {}), queue),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) + len(failures) < world_size:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            rank, ok, payload = queue.get(timeout=min(left, 1.0))
        except Exception:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            for r in dead:
                if r not in results and r not in failures:
                    failures[r] = f"rank {r} exited with code {procs[r].exitcode} and no report"
            continue
        (results if ok else failures)[rank] = payload
    missing = [r for r in range(world_size) if r not in results and r not in failures]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=10)
    if failures or missing:
        parts = [f"--- rank {r} failed ---\n{tb}" for r, tb in sorted(failures.items())]
        if missing:
            parts.append(
                f"--- ranks {missing} did not finish within {timeout_s:.0f} s (killed) ---"
            )
        raise RankFailure("\n".join(parts))
    return [results[r] for r in range(world_size)]


def _run_launched(world_size: int, body: Callable[..., Any], args: tuple[Any, ...]) -> list[Any]:
    import torch.distributed as dist

    init_distributed()
    world = dist.get_world_size()
    if world < world_size:
        import pytest

        pytest.skip(f"launched with {world} ranks, this test needs {world_size}")
    rank = dist.get_rank()
    group = tuple(range(world_size))
    result: list[Any] = []
    error: BaseException | None = None
    if rank < world_size:
        try:
            result = [body(rank, world_size, group if world_size < world else None, *args)]
        except BaseException as exc:
            error = exc
    # keep the launched world in lock-step between tests; a bounded wait
    from .group import TorchStoreGroup

    TorchStoreGroup(None).barrier(timeout_s=300, what=f"end of {body.__name__}")
    if error is not None:
        raise error
    return result


def run_threads(
    world_size: int, body: Callable[..., Any], *args: Any, timeout_s: float = 240.0
) -> list[Any]:
    """Run ``body(rank, world_size, group, *args)`` on ``world_size`` threads of this
    process sharing a :class:`ThreadGroup`; re-raise the first failure with every
    failing rank's traceback. A rank whose body raises leaves the group
    (:meth:`ThreadGroup.abort`): peers waiting for it in a collective raise at once.

    Rules for bodies that drive one GPU from several rank threads:

    * one stream per rank (``torch.cuda.set_stream(torch.cuda.Stream())``); two
      ranks on one stream would serialise and wait for each other, so the one-sided
      backend refuses it;
    * ``CUDA_DEVICE_MAX_CONNECTIONS`` of at least the number of ranks (set to 32
      here when CUDA is not initialised yet), so every stream has its own hardware
      queue;
    * every rank issues an op before any rank blocks on the host for its
      completion: put ``group.barrier(...)`` between issuing ops and
      ``synchronize()``/``.item()``/``torch.equal``. Without it we saw, on an H200
      with 2 to 8 rank threads, a rank's kernel wait out the whole timeout for a
      peer whose host thread had not issued the same op yet;
    * no GPU allocation, memset or same-device copy while a peer's op may be in
      flight: prepare inputs, synchronise, barrier, then issue. CUDA's implicit
      synchronisation rules order work issued after such a call behind work
      already running in other streams, so a late rank's kernel could not start
      while its peers' kernels wait for it (our reading of the stalls above and
      of a bench run that stalled while one rank allocated its inputs).
    """
    # Several spinning kernels on one GPU need their own hardware queues: with the
    # default 8 connections two ranks' streams can share one and deadlock until the
    # timeout. Effective only before CUDA initialises in this process.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    groups = ThreadGroup.create(world_size)
    results: list[Any] = [None] * world_size
    failures: dict[int, str] = {}

    def target(r: int) -> None:
        try:
            results[r] = body(r, world_size, groups[r], *args)
        except BaseException as exc:
            failures[r] = traceback.format_exc()
            # peers waiting in a collective for this rank raise now, not at their timeout
            groups[r].abort(f"{type(exc).__name__}: {str(exc)[:200]}")

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    if failures or hung:
        parts = [f"--- rank {r} failed ---\n{tb}" for r, tb in sorted(failures.items())]
        if hung:
            parts.append(f"--- ranks {hung} still running after {timeout_s:.0f} s ---")
        raise RankFailure("\n".join(parts))
    return results

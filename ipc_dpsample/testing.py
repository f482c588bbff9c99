"""Multi-rank test harness, usable from pytest, torchrun and mpirun alike.

:func:`run_ranks` runs ``body(rank, world_size, group, *args)`` on ``world_size``
ranks:

* launched by ``torchrun``/``mpirun`` (``RANK``/``WORLD_SIZE`` or MPI variables
  set): this process is one rank of an already-launched world; ranks
  ``>= world_size`` sit the test out and the others use the subgroup
  ``tuple(range(world_size))``. A world smaller than needed skips the test
  (under pytest) with a reason that names both sizes.
* otherwise: spawns ``world_size`` fresh processes (``spawn`` start method), each
  initialising torch.distributed over gloo; ranks still running after ``timeout_s``
  are killed. When any rank fails, :class:`RankFailure` reports every rank's
  outcome in rank order (its result, its traceback, its exit code or signal, or
  that it was killed), and keeps them in :attr:`RankFailure.outcomes`.

:func:`run_threads` runs the ranks as threads of this process with a
:class:`~ipc_dpsample.group.ThreadGroup` (several ranks on one GPU).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import queue as queue_module
import signal
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, Literal

from .group import ThreadGroup
from .launch import free_port, init_distributed, launched_world

__all__ = ["RankFailure", "RankOutcome", "run_ranks", "run_threads"]

#: After a rank process is seen dead, how long its report may still take to arrive.
_REPORT_GRACE_S = 0.5
#: Characters of a returned value's ``repr`` shown in a :class:`RankFailure` message.
_RESULT_REPR = 200


@dataclasses.dataclass(frozen=True)
class RankOutcome:
    """How one rank of :func:`run_ranks` / :func:`run_threads` ended.

    Attributes
    ----------
    rank : int
    kind : ``"returned"``, ``"raised"``, ``"exited"`` or ``"timeout"``
        Returned a value; raised (``traceback`` holds it); its process ended without
        a report (``exitcode``: the exit code, or ``-signal`` when a signal killed
        it); still running after the timeout (a process is then killed; a thread
        cannot be).
    result : object
        What the body returned (``kind == "returned"``), else None.
    traceback : str or None
        The formatted traceback (``kind == "raised"``).
    exitcode : int or None
        The process's exit code (``kind == "exited"``; negative: a signal).
    hung : str or None
        What happened to a rank that did not finish (``kind == "timeout"``), e.g.
        ``"did not finish within 8 s (killed)"``.
    """

    rank: int
    kind: Literal["returned", "raised", "exited", "timeout"]
    result: Any = None
    traceback: str | None = None
    exitcode: int | None = None
    hung: str | None = None

    @property
    def ok(self) -> bool:
        return self.kind == "returned"

    def describe(self) -> str:
        """One line: ``returned [1, 2]``, ``raised ValueError: ...``, ``exited with
        code 3 and no report``, ``was killed by SIGKILL (9) and left no report``..."""
        if self.kind == "returned":
            text = " ".join(repr(self.result).split())
            if len(text) > _RESULT_REPR:
                text = text[:_RESULT_REPR] + "..."
            return f"returned {text}"
        if self.kind == "raised":
            lines = [ln.strip() for ln in (self.traceback or "").splitlines() if ln.strip()]
            return f"raised {lines[-1] if lines else '(no traceback)'}"
        if self.kind == "exited":
            code = self.exitcode if self.exitcode is not None else 0
            if code < 0:
                try:
                    name = signal.Signals(-code).name
                except ValueError:
                    name = "an unknown signal"
                return f"was killed by {name} ({-code}) and left no report"
            return f"exited with code {code} and no report"
        return self.hung or "did not finish"


class RankFailure(AssertionError):
    """One or more ranks failed.

    The message starts with the failing ranks, then one line per rank in rank order
    (what it returned, raised, or how its process ended), then the failing ranks'
    tracebacks (``--- rank r failed ---`` blocks) and, last, the ranks that did not
    finish (``--- ranks [...] did not finish within ... ---``).

    Attributes
    ----------
    outcomes : list of RankOutcome
        Every rank's outcome, in rank order (empty when raised without them).
    """

    def __init__(self, message: str, outcomes: Sequence[RankOutcome] = ()):
        super().__init__(message)
        self.outcomes: list[RankOutcome] = list(outcomes)

    @property
    def results(self) -> dict[int, Any]:
        """``{rank: returned value}`` of the ranks that returned."""
        return {o.rank: o.result for o in self.outcomes if o.ok}

    @property
    def failed_ranks(self) -> list[int]:
        return [o.rank for o in self.outcomes if not o.ok]

    @classmethod
    def from_outcomes(cls, outcomes: Sequence[RankOutcome]) -> RankFailure:
        """The failure that reports ``outcomes`` (one per rank, in rank order)."""
        failed = [o for o in outcomes if not o.ok]
        lines = [f"ranks {[o.rank for o in failed]} of {len(outcomes)} failed"]
        for o in outcomes:
            lines.append(f"  rank {o.rank}: {'' if o.ok else 'FAILED: '}{o.describe()}")
        for o in failed:
            if o.kind == "raised":
                lines.append(f"--- rank {o.rank} failed ---\n{(o.traceback or '').rstrip()}")
            elif o.kind == "exited":
                lines.append(f"--- rank {o.rank} failed ---\nrank {o.rank} {o.describe()}")
        hung = [o for o in failed if o.kind == "timeout"]
        if hung:
            lines.append(f"--- ranks {[o.rank for o in hung]} {hung[0].describe()} ---")
        return cls("\n".join(lines), outcomes)


def _child(
    rank: int,
    world_size: int,
    port: int,
    body: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
    queue: Any,
) -> None:
    # torchrun's agent variables belong to the parent's launcher, not to this spawned
    # world: with TORCHELASTIC_USE_AGENT_STORE=True inherited, init_process_group
    # waits for an agent store that nobody serves here
    for name in [k for k in os.environ if k.startswith("TORCHELASTIC_")]:
        del os.environ[name]
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
        # every rank has its group before any body runs: rank 0's process serves the
        # store, and a body that ends its process (a harness test's victim) must not take
        # the store away from a peer still connecting (seen in CI under load: the peer
        # raised "Connection reset by peer" in gloo's connectFullMesh)
        dist.barrier()
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
        Any rank raised, ended without a report (``os._exit``, a crash, a signal)
        or did not finish within ``timeout_s``; its message and
        :attr:`~RankFailure.outcomes` hold every rank's outcome, the surviving
        ranks' results included.
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
    outcomes: dict[int, RankOutcome] = {}
    dead_since: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(outcomes) < world_size:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            rank, ok, payload = queue.get(timeout=min(left, 0.2))
        except queue_module.Empty:
            # a process that ended without a report (os._exit, a crash, a signal):
            # once its report had time to arrive, its exit code is its outcome
            now = time.monotonic()
            for r, p in enumerate(procs):
                if r not in outcomes and p.exitcode is not None:
                    if now - dead_since.setdefault(r, now) >= _REPORT_GRACE_S:
                        outcomes[r] = RankOutcome(r, "exited", exitcode=p.exitcode)
            continue
        if ok:
            outcomes[rank] = RankOutcome(rank, "returned", result=payload)
        else:
            outcomes[rank] = RankOutcome(rank, "raised", traceback=payload)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=10)
    every = [
        outcomes.get(r)
        or RankOutcome(r, "timeout", hung=f"did not finish within {timeout_s:.0f} s (killed)")
        for r in range(world_size)
    ]
    if not all(o.ok for o in every):
        raise RankFailure.from_outcomes(every)
    return [o.result for o in every]


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
    hung = {r for r, t in enumerate(threads) if t.is_alive()}
    if failures or hung:
        # a hung thread cannot be killed: its outcome says it is still running
        raise RankFailure.from_outcomes(
            [
                RankOutcome(r, "timeout", hung=f"still running after {timeout_s:.0f} s")
                if r in hung
                else RankOutcome(r, "raised", traceback=failures[r])
                if r in failures
                else RankOutcome(r, "returned", result=results[r])
                for r in range(world_size)
            ]
        )
    return results

"""One spawned world per world size for all the rank bodies of a test module.

Each spawned rank imports torch (about 2 s of a CI core) and joins gloo before its body
runs, so a test module whose tests each spawned their own ranks paid that start once per
test. :class:`SharedWorlds` runs every body of one world size on one
:func:`~ipc_dpsample.testing.run_ranks` world instead, one body after another, as the
launched ranks under ``torchrun`` / ``mpirun`` run a test file's bodies anyway; each
test then asserts on its own body's per-rank results.

* A body that raises fails only its own test, with every failing rank's traceback; the
  world goes on with the next body once every rank has ended this one (a barrier on a
  fresh host group: a failed body may have left its own group's steps uneven).
* A world that fails as a whole (a rank that dies or hangs, or ranks that stay out of
  step after a failure) fails every test of that world size with the same
  :class:`~ipc_dpsample.testing.RankFailure`; under a launcher with fewer ranks than
  the world needs, every such test skips.
* The world runs once, when the first test of its size asks for it, with every body of
  that size (also when ``-k`` selected only some of those tests).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from ipc_dpsample.testing import run_ranks

#: (name, body, args): ``body(rank, world_size, group, *args)`` as for ``run_ranks``.
Call = tuple[str, Callable[..., Any], tuple[Any, ...]]

#: The wait of the barrier between two bodies: long enough for a peer that is still
#: waiting out a communicator's timeout (30 s by default) after a body failed elsewhere.
BARRIER_S = 120.0


def run_bodies(
    rank: int, world: int, group: Any, calls: Sequence[Call]
) -> dict[str, tuple[bool, Any]]:
    """Rank body: each of ``calls`` in turn. Returns ``{name: (True, result)}`` or
    ``{name: (False, traceback)}`` per body."""
    from ipc_dpsample.group import resolve_group

    out: dict[str, tuple[bool, Any]] = {}
    for name, body, args in calls:
        try:
            out[name] = (True, body(rank, world, group, *args))
        except Exception:
            out[name] = (False, traceback.format_exc())
        resolve_group(group).barrier(timeout_s=BARRIER_S, what=f"end of {name}")
    return out


class SharedWorlds:
    """The bodies of a test module by world size, each size's world run at most once."""

    def __init__(self, plan: dict[int, list[Call]], *, timeout_s: float = 240.0) -> None:
        for calls in plan.values():
            names = [name for name, _, _ in calls]
            assert len(set(names)) == len(names), f"body names repeat: {names}"
        self.plan = plan
        self.timeout_s = timeout_s
        self._ran: dict[int, list[dict[str, tuple[bool, Any]]] | BaseException] = {}

    def results(self, world: int, name: str) -> list[Any]:
        """Body ``name``'s results on the ``world``-rank world: every rank's when
        spawned; this rank's own (or none, if it sat out) under a launcher."""
        assert any(n == name for n, _, _ in self.plan[world]), (world, name)
        if world not in self._ran:
            try:
                self._ran[world] = run_ranks(
                    world, run_bodies, self.plan[world], timeout_s=self.timeout_s
                )
            except (Exception, pytest.skip.Exception) as exc:
                self._ran[world] = exc
        ran = self._ran[world]
        if isinstance(ran, BaseException):
            raise ran
        assert len(ran) in (0, 1, world), ran
        failed = [
            f"--- {f'rank {r}' if len(ran) == world else 'this rank'} ---\n{out}"
            for r, (ok, out) in enumerate(per[name] for per in ran)
            if not ok
        ]
        if failed:
            pytest.fail(
                f"{name} raised on {len(failed)} of the {len(ran)} ranks seen here "
                f"(a world of {world}):\n" + "\n".join(failed),
                pytrace=False,
            )
        return [per[name][1] for per in ran]

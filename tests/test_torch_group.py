"""Host groups pair their collectives by ``(sequence number, what)`` (issue 12): ranks
whose set-up sequences diverged raise, naming both steps, instead of reading each
other's records. ThreadGroup with threads, TorchStoreGroup with spawned ranks (or
the launched ones under torchrun/mpirun)."""

from __future__ import annotations

import _bodies
import pytest

from ipc_dpsample.group import ThreadGroup
from ipc_dpsample.testing import run_ranks, run_threads


@pytest.mark.parametrize("world", [2, 3])
def test_thread_group_names_both_steps(world: int) -> None:
    results = run_threads(world, _bodies.group_steps_diverge, timeout_s=60)
    assert len(results) == world
    for (message,) in results:
        assert "thread group" in message, message


def test_thread_group_same_steps_exchange_records() -> None:
    groups = ThreadGroup.create(1)
    assert groups[0].all_gather_bytes(b"abc", timeout_s=1, what="x") == [b"abc"]


@pytest.mark.multirank
def test_torch_store_group_names_both_steps() -> None:
    results = run_ranks(2, _bodies.group_steps_diverge, timeout_s=60)
    for (message,) in results:
        assert "group (0, 1)" in message, message

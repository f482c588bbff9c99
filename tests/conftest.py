"""Shared fixtures.

* ``tests/`` goes on ``sys.path`` so that the rank bodies in ``_bodies.py`` import by
  name, here and in ``spawn`` children (they inherit ``sys.path``).
* ``world1`` initialises torch.distributed as a world of one (gloo) in this process,
  for the in-process tests of tp=1 communicators.
* ``IPC_DPSAMPLE_BACKEND`` from the caller's environment is cleared for every test
  (tests that need it set it themselves).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

TESTS_DIR = str(Path(__file__).resolve().parent)
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)


@pytest.fixture(autouse=True)
def _no_backend_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IPC_DPSAMPLE_BACKEND", raising=False)


def _launched() -> bool:
    from ipc_dpsample.launch import launched_world

    world = launched_world()
    return world is not None and world[1] > 1


@pytest.fixture(scope="session")
def world1() -> None:
    """torch.distributed initialised in this process as a world of one (gloo)."""
    if _launched():
        pytest.skip("in-process tests run under plain pytest, not under torchrun/mpirun")
    import torch.distributed as dist

    from ipc_dpsample.launch import init_distributed

    if dist.is_initialized():
        assert dist.get_world_size() == 1, "the test process is already in a larger world"
        return
    init_distributed("gloo")


@pytest.fixture
def make_comm(world1: None) -> Iterator[Callable[..., Any]]:
    """Factory of tp=1 CPU communicators, closed at the end of the test."""
    from ipc_dpsample import DpSamplingComm

    made: list[Any] = []

    def make(**kw: Any) -> Any:
        args: dict[str, Any] = {
            "tp_size": 1,
            "rank": 0,
            "max_pad_bs": 6,
            "num_tokens_per_req": 2,
            "vocab_size": 5,
            "logits_dtype": "float32",
            "device": "cpu",
        }
        args.update(kw)
        comm = DpSamplingComm(**args)
        made.append(comm)
        return comm

    yield make
    for comm in made:
        comm.close()

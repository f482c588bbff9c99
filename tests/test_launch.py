"""Launcher detection (torchrun, Open MPI, MPICH/Hydra, PMIx, Slurm) and the multi-rank
harness itself: results in rank order. A failing rank's traceback in the parent and a
hung rank killed within the timeout are ``tests/test_run_ranks.py``'s (with every other
outcome of a spawned rank)."""

from __future__ import annotations

import socket
import time

import _bodies
import pytest

from ipc_dpsample.launch import free_port, launched_world
from ipc_dpsample.testing import RankFailure, run_ranks, run_threads

_ALL_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "PMI_RANK",
    "PMI_SIZE",
    "MPI_LOCALRANKID",
    "PMIX_RANK",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in _ALL_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, None),
        ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}, (3, 4, 1)),
        ({"RANK": "2", "WORLD_SIZE": "4"}, (2, 4, 2)),  # no local rank: the rank
        ({"RANK": "0", "WORLD_SIZE": "1"}, (0, 1, 0)),
        ({"RANK": "0"}, None),  # no size: not launched
        ({"WORLD_SIZE": "2"}, None),
        ({"RANK": "", "WORLD_SIZE": ""}, None),
        (
            {
                "OMPI_COMM_WORLD_RANK": "5",
                "OMPI_COMM_WORLD_SIZE": "8",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            },
            (5, 8, 1),
        ),
        ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}, (1, 2, 1)),
        ({"PMI_RANK": "1", "PMI_SIZE": "2"}, (1, 2, 1)),
        ({"SLURM_PROCID": "6", "SLURM_NTASKS": "16", "SLURM_LOCALID": "2"}, (6, 16, 2)),
        ({"PMIX_RANK": "1"}, None),
        ({"RANK": "1", "WORLD_SIZE": "2", "PMI_RANK": "0", "PMI_SIZE": "2"}, (1, 2, 1)),
        ({"RANK": "0", "WORLD_SIZE": "0"}, None),
    ],
)
def test_launched_world(clean_env: pytest.MonkeyPatch, env: dict, want: tuple | None) -> None:
    for k, v in env.items():
        clean_env.setenv(k, v)
    assert launched_world() == want


def test_free_port_is_bindable() -> None:
    port = free_port()
    assert 1024 <= port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def _not_launched() -> None:
    world = launched_world()
    if world is not None and world[1] > 1:
        pytest.skip("harness self-tests spawn their own ranks; run them under plain pytest")


def test_run_ranks_returns_results_in_rank_order() -> None:
    _not_launched()
    assert run_ranks(3, _bodies.harness_ok, "tok") == [(0, 3, "tok"), (1, 3, "tok"), (2, 3, "tok")]


def test_run_threads() -> None:
    def body(rank: int, world: int, group: object) -> int:
        data = group.all_gather_bytes(bytes([rank]), timeout_s=10, what="test")  # type: ignore[attr-defined]
        assert data == [bytes([r]) for r in range(world)]
        if rank == 2:
            raise KeyError("thread rank 2")
        return rank

    with pytest.raises(RankFailure, match=r"(?s)rank 2 failed.*KeyError: 'thread rank 2'"):
        run_threads(3, body)
    assert run_threads(2, lambda r, w, g: r * 10) == [0, 10]


def test_run_threads_a_failing_rank_releases_peers_waiting_for_it() -> None:
    """Rank 1 raises before a barrier with a 60 s timeout: the others raise at once,
    naming rank 1 and its error, and the whole run ends in well under the timeout."""

    def body(rank: int, world: int, group: object) -> None:
        group.barrier(timeout_s=10, what="start")  # type: ignore[attr-defined]
        if rank == 1:
            raise RuntimeError("rank 1 broke")
        group.barrier(timeout_s=60, what="after the work")  # type: ignore[attr-defined]

    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_threads(3, body, timeout_s=120)
    assert time.monotonic() - t0 < 10
    text = str(info.value)
    assert "RuntimeError: rank 1 broke" in text
    for r in (0, 2):
        assert f"--- rank {r} failed ---" in text
    assert (
        "rank 1 of the thread group failed (RuntimeError: rank 1 broke); 'after the work' "
        "abandoned" in text
    )


def test_thread_group_abort_is_seen_by_later_collectives() -> None:
    from ipc_dpsample import DpSampleError, ThreadGroup

    g = ThreadGroup.create(2)
    g[1].abort("gone")
    with pytest.raises(DpSampleError, match=r"rank 0: rank 1 of the thread group failed \(gone\)"):
        g[0].barrier(timeout_s=30, what="x")

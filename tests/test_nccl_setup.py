"""NCCL backend construction: every failure path of the collective set-up, with
ranks as threads and the GPU-facing steps replaced (every rank must raise the same
error, none may hang)."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import pytest
from fakes.nccl import UID, FakeNccl, LoggingComm

from ipc_dpsample import BackendUnavailableError, DpSampleError, ThreadGroup
from ipc_dpsample.backends.nccl import NcclBackend
from ipc_dpsample.backends.nccl import setup as nccl_setup
from ipc_dpsample.config import CommConfig
from ipc_dpsample.testing import RankFailure, run_threads


def _cfg(tp: int, rank: int) -> CommConfig:
    return CommConfig(
        tp_size=tp,
        rank=rank,
        max_pad_bs=4 * tp,
        num_tokens_per_req=2,
        vocab_size=8 * tp,
        logits_dtype="float16",
        backend="nccl",
    )


def test_cpu_device_is_refused() -> None:
    with pytest.raises(BackendUnavailableError, match=r"needs a CUDA device .* backend='torch'"):
        NcclBackend(_cfg(1, 0), ThreadGroup.create(1)[0], -1)


def _expect_all_ranks_raise(world: int, pattern: str) -> None:
    def body(rank: int, world: int, group: Any) -> str:
        with pytest.raises(BackendUnavailableError) as info:
            NcclBackend(_cfg(world, rank), group, 0)
        assert re.search(pattern, str(info.value)), str(info.value)
        return str(info.value)

    msgs = run_threads(world, body, timeout_s=60)
    for rank, msg in enumerate(msgs):
        assert msg.startswith(f"rank {rank}: ")


def test_missing_nccl_fails_every_rank_together() -> None:
    """On this machine: whichever step fails first (no libnccl, no GPU), every rank
    raises naming every failing rank; on a GPU machine NCCL refuses two ranks on
    one GPU the same way."""
    _expect_all_ranks_raise(2, r"rank 0: .*rank 1: |Duplicate GPU detected")


def test_one_rank_failing_to_prepare_fails_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    def prepare(self: NcclBackend) -> None:
        if self.rank == 1:
            raise RuntimeError("injected failure on rank 1")
        self._nccl = FakeNccl()

    monkeypatch.setattr(NcclBackend, "_prepare_local", prepare)
    monkeypatch.setattr(nccl_setup, "gpu_uuid", lambda device: "")
    _expect_all_ranks_raise(
        3, r"the NCCL backend could not start \(rank 1: RuntimeError: injected failure on rank 1\)"
    )


def test_two_ranks_on_one_gpu_fail_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        NcclBackend, "_prepare_local", lambda self: setattr(self, "_nccl", FakeNccl())
    )
    monkeypatch.setattr(nccl_setup, "gpu_uuid", lambda device: "GPU-same")
    _expect_all_ranks_raise(2, r"ranks \[0, 1\] all use GPU-same .*Duplicate GPU detected")


def test_one_rank_failing_init_aborts_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []

    def create(self: NcclBackend, raw_uid: bytes) -> LoggingComm:
        assert raw_uid == UID
        if self.rank == 1:
            raise RuntimeError("NcclError: injected")
        return LoggingComm(log, self.rank)

    monkeypatch.setattr(
        NcclBackend, "_prepare_local", lambda self: setattr(self, "_nccl", FakeNccl())
    )
    monkeypatch.setattr(NcclBackend, "_create_communicator", create)
    monkeypatch.setattr(nccl_setup, "gpu_uuid", lambda device: "")
    _expect_all_ranks_raise(
        2, r"creating the NCCL communicator failed \(rank 1: RuntimeError: NcclError: injected\)"
    )
    assert log == ["abort 0"]


def test_a_missing_rank_times_out_instead_of_hanging(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        NcclBackend, "_prepare_local", lambda self: setattr(self, "_nccl", FakeNccl())
    )
    monkeypatch.setattr(nccl_setup, "gpu_uuid", lambda device: "")
    monkeypatch.setattr(nccl_setup, "_SETUP_TIMEOUT_S", 0.2)
    groups = ThreadGroup.create(2)
    cfg = CommConfig(
        tp_size=2, rank=0, max_pad_bs=2, num_tokens_per_req=1, vocab_size=2, timeout_s=0.2
    )
    with pytest.raises(
        DpSampleError, match=r"ranks \[1\] of the thread group did not join 'NCCL set-up'"
    ):
        NcclBackend(cfg, groups[0], 0)


def test_run_threads_reports_failures() -> None:
    """Sanity check of the harness the tests above rely on."""

    def body(rank: int, world: int, group: Any) -> None:
        raise ValueError(f"boom {rank}")

    with pytest.raises(RankFailure, match=r"boom 1"):
        run_threads(2, body, timeout_s=30)


class _BlockingComm:
    """A communicator whose destroy blocks until ``released`` is set, as NCCL's does
    while a CUDA graph that captured its ops is alive."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.calls: list[str] = []

    def destroy(self) -> None:
        self.calls.append("destroy")
        self.released.wait(30)

    def abort(self) -> None:
        self.calls.append("abort")
        self.released.wait(30)


@pytest.mark.parametrize("abort", [False, True])
def test_close_after_capture_does_not_wait_for_live_graphs(
    monkeypatch: pytest.MonkeyPatch, abort: bool
) -> None:
    """NCCL's destroy (and abort) wait for every CUDA graph that captured an op of the
    communicator; seen hanging close() on the H200. After a capture close() waits a
    bounded time, warns, and the destroy completes once the graphs are gone."""
    monkeypatch.setattr(nccl_setup, "CAPTURED_DESTROY_WAIT_S", 0.2)
    setup = nccl_setup.NcclSetup()
    setup.rank, setup.device, setup._captured = 0, 0, True
    comm = _BlockingComm()
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match="still held by CUDA graphs"):
        setup._end_communicator(comm, abort, None)
    assert time.monotonic() - t0 < 5
    worker = setup.pending_destroy
    assert worker is not None and worker.is_alive()
    assert comm.calls == ["abort" if abort else "destroy"]
    comm.released.set()  # the graphs are destroyed
    worker.join(5)
    assert not worker.is_alive()


def test_close_without_capture_destroys_in_the_calling_thread() -> None:
    setup = nccl_setup.NcclSetup()
    setup.rank, setup.device = 0, 0
    comm = _BlockingComm()
    comm.released.set()
    main = threading.current_thread()
    seen: list[threading.Thread] = []
    comm.destroy = lambda: seen.append(threading.current_thread())  # type: ignore[method-assign]
    setup._end_communicator(comm, False, None)
    assert seen == [main] and setup.pending_destroy is None

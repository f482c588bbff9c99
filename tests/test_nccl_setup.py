"""NCCL backend construction: every failure path of the collective set-up, with
ranks as threads and the GPU-facing steps replaced (every rank must raise the same
error, none may hang)."""

from __future__ import annotations

import re
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

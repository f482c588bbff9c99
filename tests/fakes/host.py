"""``NcclBackend`` with only its device-facing leaves replaced, for ranks that are
threads: buffers are host arrays, kernels run in the emulator through the real
``PreparedLaunch`` argument blocks, and "NCCL" is :class:`fakes.nccl.Fabric`.
Everything else is the production code: set-up records, plans, kernel arguments,
pointer offsets, the NCCL call sequence, headers, the error block, the in-flight
guard, the view cache and ``close()``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from fakes.cuda import FakeDriver, FakeRuntime, host_buffer, install, use_runtime
from fakes.emulator import Emulator
from fakes.nccl import UID, Fabric, FabricComm, FakeNccl
from ipc_dpsample.backends.common import InFlightGuard
from ipc_dpsample.backends.nccl import NcclBackend
from ipc_dpsample.backends.nccl import setup as nccl_setup
from ipc_dpsample.backends.nccl.geometry import (
    ARGMAX_KERNEL_NAMES,
    KERNEL_NAMES,
    VERIFY_KERNEL_NAMES,
)
from ipc_dpsample.backends.nccl.launcher import Launcher
from ipc_dpsample.backends.nccl.records import ERROR_WORDS
from ipc_dpsample.config import CommConfig
from ipc_dpsample.testing import run_threads

Body = Callable[[int, NcclBackend, list[tuple[str, int, int]]], Any]


def host_backends(
    monkeypatch: pytest.MonkeyPatch, emulator: Emulator
) -> tuple[Callable[..., list[Any]], FakeDriver]:
    """``(make, driver)``: ``make(world, body, *, route_self=False, **cfg)`` runs
    ``body(rank, backend, comm_log)`` on ``world`` thread ranks, each with a
    NcclBackend over the stand-ins, closes the backends and returns the bodies'
    results; ``driver.launches()`` lists the calling rank's kernel launches."""
    driver = install(monkeypatch, emulator)
    names = (*KERNEL_NAMES, *ARGMAX_KERNEL_NAMES, *VERIFY_KERNEL_NAMES)
    kernels = {name: driver.kernel(name) for name in names}

    def prepare_local(self: NcclBackend) -> None:
        self._runtime = FakeRuntime(self.device)
        use_runtime(self._runtime)
        self._cupy = sys.modules["cupy"]
        self._nccl = FakeNccl()
        self.launcher = Launcher(kernels, self.device)
        self._host_error_block = np.zeros(ERROR_WORDS, dtype=np.int32)
        self._allocate()
        self._guard = InFlightGuard(self.device, self.rank)

    def alloc(self: NcclBackend, name: str, nbytes: int) -> None:
        self._bufs[name] = host_buffer(nbytes)

    def alloc_error_block(self: NcclBackend) -> tuple[int, int]:
        ptr = int(self._host_error_block.ctypes.data)
        return ptr, ptr

    monkeypatch.setattr(NcclBackend, "_prepare_local", prepare_local)
    monkeypatch.setattr(NcclBackend, "_alloc", alloc)
    monkeypatch.setattr(NcclBackend, "_alloc_error_block", alloc_error_block)
    monkeypatch.setattr(nccl_setup, "gpu_uuid", lambda device: "")

    def make(world: int, body: Body, *, route_self: bool = False, **cfg_kw: Any) -> list[Any]:
        fabric = Fabric(world)

        def create(self: NcclBackend, raw_uid: bytes) -> FabricComm:
            assert raw_uid == UID
            comm = FabricComm(fabric, self.rank)
            self._nccl.comm = comm
            return comm

        monkeypatch.setattr(NcclBackend, "_create_communicator", create)

        def rank_body(rank: int, world: int, group: Any) -> Any:
            kw = {"max_pad_bs": 4 * world, "num_tokens_per_req": 3, "backend": "nccl"}
            kw.update(cfg_kw)
            cfg = CommConfig(tp_size=world, rank=rank, **kw)
            backend = NcclBackend(cfg, group, 0, route_self_through_nccl=route_self)
            try:
                return body(rank, backend, backend._comm.log)
            finally:
                backend.close()

        return run_threads(world, rank_body, timeout_s=120)

    return make, driver


def event_of(backend: NcclBackend) -> Any:
    """The in-flight guard's (fake) event of ``backend``."""
    assert backend._guard is not None
    return backend._guard._event

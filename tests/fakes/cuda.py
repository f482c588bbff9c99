"""The CuPy/CUDA surface the GPU backends touch, on the host: buffers are host
arrays, events and capture status are test-controlled, ``cuLaunchKernel`` runs the
emulated kernel (:mod:`fakes.emulator`).

:func:`install` puts a fake ``cupy`` module in ``sys.modules`` (what
``PreparedLaunch`` and ``InFlightGuard`` import) and patches
``ipc_dpsample.backends.common`` (its bound launcher and ``make_view``); everything is
undone by the test's ``monkeypatch``.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import types
from typing import Any

import numpy as np
import pytest

from fakes.emulator import ARITY, Emulator

#: numpy dtypes the host views use: 16-bit floats as uint16 bit patterns,
#: float32 as uint32 bit patterns (compared bit-exactly), int32 as int32.
VIEW_DTYPES = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.uint32}


class HostBuf(np.ndarray):
    """A host array with the CuPy members the backend uses (``data.ptr``, get/set)."""

    @property
    def data(self) -> Any:  # type: ignore[override]
        return types.SimpleNamespace(ptr=int(self.ctypes.data))

    def get(self) -> np.ndarray:
        return np.array(self)

    def set(self, value: np.ndarray) -> None:
        self[...] = value


def host_buffer(nbytes: int) -> HostBuf:
    """``nbytes`` of poison (0xA5), as a freshly allocated device buffer might hold."""
    return np.full(max(1, nbytes), 0xA5, dtype=np.uint8).view(HostBuf)


def host_view(
    kind: Any, ptr: int, shape: tuple[int, ...], dtype: str, device: int, owner: Any = None
) -> np.ndarray:
    """``arrays.make_view`` for host memory: a numpy view (see :data:`VIEW_DTYPES`)."""
    np_dtype = np.dtype(VIEW_DTYPES.get(dtype, np.int32))
    count = int(np.prod(shape))
    raw = (ctypes.c_uint8 * (count * np_dtype.itemsize)).from_address(ptr)
    return np.frombuffer(raw, dtype=np_dtype).reshape(shape)


class FakeEvent:
    """A CuPy event: ``done`` is what the test sets; queries and records are counted."""

    _registry: dict[int, FakeEvent] = {}  # noqa: RUF012 - ptr -> event, for eventRecord

    def __init__(self, **kw: Any) -> None:
        self.finished = True
        self.queries = 0
        self.records: list[int] = []  # stream handles
        self.ptr = id(self)
        FakeEvent._registry[self.ptr] = self

    @property
    def done(self) -> bool:
        self.queries += 1
        return self.finished


class FakeRuntime:
    """One rank's CUDA runtime: capture status per stream handle, event records."""

    def __init__(self, device: int):
        self.device = device
        self.capturing: set[int] = set()  # stream handles under capture
        self.capture_queries: list[int] = []
        self.copies: list[tuple[int, int, int]] = []  # (nbytes, kind, stream handle)

    def getDevice(self) -> int:
        return self.device

    def streamIsCapturing(self, handle: int) -> int:
        self.capture_queries.append(handle)
        return 1 if handle in self.capturing else 0  # cudaStreamCaptureStatusActive

    def eventRecord(self, event_ptr: int, handle: int) -> None:
        FakeEvent._registry[event_ptr].records.append(handle)

    def setDevice(self, device: int) -> None:
        raise AssertionError("the stand-in runtime has one device")

    def deviceSynchronize(self) -> None:
        pass

    def memcpyAsync(self, dst: int, src: int, nbytes: int, kind: int, handle: int) -> None:
        """Done at once: every emulated kernel also runs when it is launched, so this is
        stream order. Logged in :attr:`copies`."""
        self.copies.append((nbytes, kind, handle))
        ctypes.memmove(dst, src, nbytes)

    def freeHost(self, ptr: int) -> None:
        pass


_local = threading.local()


class ThreadRuntime:
    """``cupy.cuda.runtime`` of the fake module: forwards to the calling thread's
    :class:`FakeRuntime` (ranks are threads, each with its own runtime)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_local.runtime, name)


def use_runtime(runtime: FakeRuntime) -> None:
    """Make ``runtime`` the calling thread's (rank's) runtime."""
    _local.runtime = runtime


class FakeKernel:
    """A loaded kernel as ``PreparedLaunch`` reads it: ``kernel.kernel.ptr``."""

    def __init__(self, ptr: int):
        self.kernel = types.SimpleNamespace(ptr=ptr)


class FakeDriver:
    """``cuLaunchKernel`` into the emulator; every launch logged per thread as
    ``(kernel name, stream handle)``."""

    class CUDADriverError(RuntimeError):
        pass

    def __init__(self, emulator: Emulator):
        self.emulator = emulator
        self.names: list[str] = []  # CUfunction value - 1 -> kernel name

    def kernel(self, name: str) -> FakeKernel:
        self.names.append(name)
        return FakeKernel(len(self.names))

    @staticmethod
    def launches() -> list[tuple[str, int]]:
        """The calling thread's launches."""
        if not hasattr(_local, "launches"):
            _local.launches = []
        return _local.launches

    def launchKernel(
        self, f: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shmem: int,
        stream: int, params: int, extra: int,
    ) -> None:  # fmt: skip
        assert (gy, gz, by, bz, shmem, extra) == (1, 1, 1, 1, 0, 0)
        name = self.names[f - 1]
        self.launches().append((name, stream))
        self.emulator.launch_params(name, gx, bx, params, ARITY[name])


def install(monkeypatch: pytest.MonkeyPatch, emulator: Emulator) -> FakeDriver:
    """Fake ``cupy`` (``cuda.Device``, ``cuda.Event``, ``cuda.runtime``,
    ``cuda.driver``) in ``sys.modules`` and host views in ``backends.common``."""
    from ipc_dpsample.backends import common

    driver = FakeDriver(emulator)
    cuda = types.ModuleType("cupy.cuda")
    cuda.Device = lambda device=None: contextlib.nullcontext()  # type: ignore[attr-defined]
    cuda.Event = FakeEvent  # type: ignore[attr-defined]
    cuda.runtime = ThreadRuntime()  # type: ignore[attr-defined]
    cuda.driver = driver  # type: ignore[attr-defined]
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda  # type: ignore[attr-defined]
    cupy.__version__ = "14.0.0-fake"  # type: ignore[attr-defined]
    monkeypatch.setitem(__import__("sys").modules, "cupy", cupy)
    monkeypatch.setitem(__import__("sys").modules, "cupy.cuda", cuda)
    monkeypatch.setitem(__import__("sys").modules, "cupy.cuda.driver", driver)
    monkeypatch.setattr(common, "_launch_kernel", driver.launchKernel)
    monkeypatch.setattr(common, "make_view", host_view)
    return driver

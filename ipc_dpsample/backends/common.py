"""Per-call machinery the GPU backends share: a kernel launch prepared once, the
one-op-in-flight guard, the cache of output views, and raw pointers of arrays.

Nothing here allocates or synchronises on the per-call path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Hashable
from typing import Any

from ..arrays import ArrayKind, make_view
from ..errors import DpSampleError

__all__ = ["InFlightGuard", "PreparedLaunch", "ViewCache", "array_ptr"]

_U64 = 0xFFFF_FFFF_FFFF_FFFF


def _launch_kernel(*args: int) -> None:
    """``cuLaunchKernel`` (CuPy's binding), bound on first use."""
    global _launch_kernel
    from cupy.cuda import driver

    _launch_kernel = driver.launchKernel
    driver.launchKernel(*args)


class PreparedLaunch:
    """One kernel launch with its argument block packed once.

    Every kernel argument is 64 bits wide (pointers and ``long long`` scalars). The
    values live in a ctypes array and the ``void**`` parameter block points into it,
    so a call rewrites the first ``n_var`` values (the caller's input pointers) and
    makes one ``cuLaunchKernel`` call: no per-argument conversion, 1 CUDA call.

    Parameters
    ----------
    kernel : cupy.RawKernel
        Loaded on ``device`` (its ``kernel.ptr`` is the ``CUfunction``).
    device : int
    grid, block : int
        One-dimensional launch geometry; ``grid`` is the default (a call may pass
        another when the kernel takes any grid, e.g. one sized to the real rows).
    args : tuple of int or bytes
        Every argument; the first ``n_var`` are placeholders set per call. A
        ``bytes`` argument is a struct passed by value (its bytes as the kernel's
        parameter layout expects them, e.g. ``bytes(ctypes_structure)``).
    n_var : int
    """

    __slots__ = (
        "_block",
        "_device",
        "_func",
        "_grid",
        "_params",
        "_ptrs",
        "_structs",
        "_vals",
        "n_var",
    )

    def __init__(
        self,
        kernel: Any,
        device: int,
        grid: int,
        block: int,
        args: tuple[int | bytes, ...],
        n_var: int,
    ):
        import cupy

        with cupy.cuda.Device(device):
            self._func = int(kernel.kernel.ptr)  # the CUfunction loaded on `device`
        n = len(args)
        if any(isinstance(a, bytes) for a in args[:n_var]):
            raise ValueError("per-call arguments must be integers")
        self._vals = (ctypes.c_uint64 * n)(
            *[0 if isinstance(a, bytes) else int(a) & _U64 for a in args]
        )
        base = ctypes.addressof(self._vals)
        # struct arguments live in their own 8-byte aligned buffers
        self._structs = {
            i: (ctypes.c_uint64 * -(-len(a) // 8)).from_buffer_copy(a.ljust(-(-len(a) // 8) * 8))
            for i, a in enumerate(args)
            if isinstance(a, bytes)
        }
        addrs = [
            ctypes.addressof(self._structs[i]) if i in self._structs else base + 8 * i
            for i in range(n)
        ]
        self._ptrs = (ctypes.c_void_p * n)(*addrs)
        self._params = ctypes.addressof(self._ptrs)
        self._grid, self._block, self.n_var, self._device = grid, block, n_var, device

    @property
    def grid(self) -> int:
        return self._grid

    @property
    def block(self) -> int:
        return self._block

    def __call__(self, stream: int, *var: int, grid: int = 0) -> None:
        vals = self._vals
        for i, v in enumerate(var):
            vals[i] = v & _U64
        grid = grid or self._grid
        try:
            _launch_kernel(self._func, grid, 1, 1, self._block, 1, 1, 0, stream, self._params, 0)
        except Exception as exc:
            import cupy
            from cupy.cuda import driver

            if not isinstance(exc, driver.CUDADriverError):
                raise
            # the calling thread's current context is another device's (or none):
            # make this device's primary context current and try once more
            with cupy.cuda.Device(self._device):
                driver.launchKernel(
                    self._func, grid, 1, 1, self._block, 1, 1, 0, stream, self._params, 0
                )


class InFlightGuard:
    """One op at a time per communicator (DESIGN.md point 9).

    After every op that runs now (not captured into a CUDA graph) an event is
    recorded on its stream. An op on another stream is refused while that event
    has not completed; an op on the same stream costs one event record and no
    query. A captured op runs later, at replay, so it neither queries nor records.

    Parameters
    ----------
    device : int
    rank : int
        Named in the error message.
    on_new_stream : callable or None
        Called with the stream handle whenever an op uses a stream other than the
        previous op's (e.g. :meth:`ThreadGroup.claim_stream`).
    """

    __slots__ = ("_event", "_event_ptr", "_last", "_on_new_stream", "_rank", "_recorded", "_rt")

    def __init__(self, device: int, rank: int, on_new_stream: Callable[[int], None] | None = None):
        import cupy

        with cupy.cuda.Device(device):
            self._event = cupy.cuda.Event(block=False, disable_timing=True)
        self._event_ptr = int(self._event.ptr)
        self._rt = cupy.cuda.runtime
        self._last: int | None = None
        self._recorded = False
        self._rank = rank
        self._on_new_stream = on_new_stream

    def begin(self, handle: int) -> bool:
        """Check ``handle`` before an op; return True when it is being captured.

        Raises
        ------
        DpSampleError
            The previous op ran on another stream and is still in flight.
        """
        capturing = self._rt.streamIsCapturing(handle) != 0
        last = self._last
        if last != handle:
            if self._on_new_stream is not None:
                self._on_new_stream(handle)
            if last is not None and self._recorded and not capturing and not self._event.done:
                raise DpSampleError(
                    f"rank {self._rank}: op issued on stream {handle:#x} while this "
                    f"communicator's previous op on stream {last:#x} is still in flight: one op "
                    "at a time per communicator (synchronise the streams, or use one "
                    "communicator per stream)"
                )
        return capturing

    def end(self, handle: int, capturing: bool) -> None:
        """Record the op's completion event (not under capture)."""
        if not capturing:
            self._last = handle
            self._rt.eventRecord(self._event_ptr, handle)
            self._recorded = True


class ViewCache:
    """Zero-copy output views of persistent device buffers, built once per
    ``(key, array kind)`` and handed out on every later call.

    Parameters
    ----------
    device : int
    owner : object
        Kept alive by every view (the memory's owner).
    """

    __slots__ = ("_device", "_owner", "_views")

    def __init__(self, device: int, owner: Any):
        self._device = device
        self._owner = owner
        self._views: dict[tuple[Hashable, ArrayKind], Any] = {}

    def get(
        self,
        kind: ArrayKind,
        key: Hashable,
        ptr: int,
        shape: tuple[int, ...],
        dtype: str,
    ) -> Any:
        """The view of ``shape``/``dtype`` at ``ptr`` in framework ``kind``."""
        k = (key, kind)
        v = self._views.get(k)
        if v is None:
            v = make_view(kind, ptr, shape, dtype, self._device, owner=self._owner)
            self._views[k] = v
        return v

    def get_many(
        self,
        kind: ArrayKind,
        key: Hashable,
        specs: tuple[tuple[int, tuple[int, ...], str], ...],
    ) -> tuple[Any, ...]:
        """Several views cached as one entry: ``specs`` is ``((ptr, shape, dtype), ...)``."""
        k = (key, kind)
        v = self._views.get(k)
        if v is None:
            v = tuple(
                make_view(kind, p, s, d, self._device, owner=self._owner) for p, s, d in specs
            )
            self._views[k] = v
        return v

    def drop(self, predicate: Callable[[Hashable], bool]) -> None:
        """Forget the views whose key satisfies ``predicate``."""
        self._views = {k: v for k, v in self._views.items() if not predicate(k[0])}

    def clear(self) -> None:
        self._views.clear()


def array_ptr(x: Any, kind: ArrayKind) -> int:
    """Device (or host) address of element 0 of an array of framework ``kind``."""
    if kind is ArrayKind.TORCH:
        return int(x.data_ptr())
    if kind is ArrayKind.CUPY:
        return int(x.data.ptr)
    if kind is ArrayKind.NUMPY:
        return int(x.ctypes.data)
    return int(x.__cuda_array_interface__["data"][0])

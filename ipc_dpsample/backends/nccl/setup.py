"""Set-up and teardown of :class:`~.backend.NcclBackend`: local preparation
(NCCL import, kernels, buffers), the two collective record rounds, the
communicator, and releasing it all.

Every rank reaches both record rounds, success or not, so a failure anywhere makes
every rank raise :class:`~ipc_dpsample.errors.BackendUnavailableError` before anyone
blocks in ``ncclCommInitRank``.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import warnings
from typing import Any

from ...config import CommConfig
from ...errors import BackendUnavailableError
from ...group import HostGroup
from ...identity import gpu_uuid
from ...layout import TOP_K_MAX
from ..common import InFlightGuard, ViewCache
from ..verify_plan import param_bytes, record_words
from .geometry import (
    ARGMAX_KERNEL_NAMES,
    ARGMAX_SOURCE,
    KERNEL_NAMES,
    NAME_EXPRESSIONS,
    PARTIAL_BYTES,
    SOURCE,
    VERIFY_KERNEL_NAMES,
    VERIFY_SOURCE,
    argmax_buffer_bytes,
)
from .launcher import Launcher
from .records import (
    ERROR_BYTES,
    HDR_BYTES,
    installed_unique_id_form,
    normalize_unique_id,
    pack_init_record,
    pack_setup_record,
    parse_init_records,
    parse_setup_records,
    unique_id_for_cupy,
)

__all__ = ["NcclSetup"]

_SETUP_TIMEOUT_S = 60.0


#: How long ``close()`` waits for the destroy of a communicator whose ops were
#: captured into CUDA graphs (NCCL holds it until those graphs are destroyed).
CAPTURED_DESTROY_WAIT_S = 2.0


class NcclSetup:
    """The resource half of :class:`~.backend.NcclBackend` (a mixin: the attributes
    below are set by its constructor before :meth:`_set_up` runs)."""

    #: set once an op ran inside a CUDA stream capture
    _captured: bool = False
    #: the thread still destroying the communicator after close() returned, if any
    pending_destroy: threading.Thread | None = None

    cfg: CommConfig
    group: HostGroup
    device: int
    rank: int
    tp: int
    route_self: bool
    rmax: int
    width: int
    ptr: dict[str, int]
    err_dev: int
    launcher: Launcher
    logits_dtype: str | None
    _bufs: dict[str, Any]
    _closed: bool
    _comm: Any
    _err_host: int
    _max_itemsize: int
    _guard: InFlightGuard | None
    _views: ViewCache
    _plans: list[dict[Any, Any]]

    def _set_up(self) -> None:
        """Both record rounds and the communicator; releases everything and re-raises
        on failure."""
        cfg, group, device = self.cfg, self.group, self.device
        timeout = max(_SETUP_TIMEOUT_S, cfg.timeout_s)

        uid: bytes | None = None
        error = ""
        try:
            self._prepare_local()
            if self.rank == 0:
                uid = normalize_unique_id(self._nccl.get_unique_id())
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        try:
            records = group.all_gather_bytes(
                pack_setup_record(ok=not error, uid=uid, uuid=gpu_uuid(device), error=error),
                timeout_s=timeout,
                what="NCCL set-up",
            )
            raw_uid = parse_setup_records(records, self.rank)
        except BaseException:
            self._release()
            raise

        error = ""
        try:
            self._comm = self._create_communicator(raw_uid)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        try:
            records = group.all_gather_bytes(
                pack_init_record(ok=not error, error=error),
                timeout_s=timeout,
                what="NCCL communicator init",
            )
            parse_init_records(records, self.rank)
            self._runtime.deviceSynchronize()
        except BaseException:
            self._release(abort=True)
            raise

    def _prepare_local(self) -> None:
        """Import NCCL, compile the kernels, allocate every persistent buffer."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # CuPy warns when libnccl is missing; we raise
            import cupy
            from cupy.cuda import nccl
        if not getattr(nccl, "available", False) or not hasattr(nccl, "NcclCommunicator"):
            raise BackendUnavailableError(
                "cupy.cuda.nccl could not load libnccl (install NCCL, e.g. "
                "pip install nvidia-nccl-cu12 or nvidia-nccl-cu13)"
            )
        count = cupy.cuda.runtime.getDeviceCount()
        if self.device >= count:
            raise BackendUnavailableError(
                f"device cuda:{self.device} does not exist ({count} GPUs)"
            )
        self._cupy = cupy
        self._nccl = nccl
        self._runtime = cupy.cuda.runtime
        from ...kernel_cache import get_module

        with cupy.cuda.Device(self.device):
            mod = get_module(SOURCE, self.device, name_expressions=NAME_EXPRESSIONS)
            kernels = {k: mod.get_function(k) for k in KERNEL_NAMES}
            argmax = get_module(ARGMAX_SOURCE, self.device)
            kernels.update((k, argmax.get_function(k)) for k in ARGMAX_KERNEL_NAMES)
            verify = get_module(VERIFY_SOURCE, self.device)
            kernels.update((k, verify.get_function(k)) for k in VERIFY_KERNEL_NAMES)
            self.launcher = Launcher(kernels, self.device)
            self._allocate()
            self._guard = InFlightGuard(self.device, self.rank)

    def _allocate(self) -> None:
        """Every persistent buffer (zeroed) and the host-mapped error block."""
        cfg, tp, n, rmax = self.cfg, self.tp, self.cfg.num_tokens_per_req, self.rmax
        swap_bytes = rmax * n * cfg.vocab_size * self._max_itemsize
        if tp > 1 or self.route_self:
            self._alloc("staging", swap_bytes)  # [tp, R*N, V/tp] bytes
        self._alloc("out_swap", swap_bytes)  # [R*N, V]
        self._alloc("hdr_recv", tp * HDR_BYTES)  # [tp, 4] int32 headers received
        self._alloc("my_hdr", HDR_BYTES)  # this rank's swap/argmax header
        self._alloc("counter", HDR_BYTES)  # int32 op counter (seq), padded
        self._alloc("grecv", tp * self.width * 4)  # [tp, W] int32
        self._alloc("predict", cfg.max_pad_bs * n * 4)
        self._alloc("accept_index", cfg.max_pad_bs * n * 4)
        self._alloc("accept_length", cfg.max_pad_bs * 4)
        self._alloc("logprobs", cfg.max_pad_bs * n * 4)
        # argmax partials, laid out by geometry.argmax_slots; outputs [R*N]
        self._alloc("abuf", argmax_buffer_bytes(tp, rmax * n * PARTIAL_BYTES))
        self._alloc("token_ids", rmax * n * 4)  # int32
        self._alloc("alogprobs", rmax * n * 4)  # float32
        # verify: records [pad_bs*N][rw] u32 (block o = the rows of rank o's requests)
        # and received [tp][R*N][rw], sized for the largest record (tp = 1 without
        # route_self combines straight from the send buffer: its slot 0 is block 0);
        # the six parameter arrays [max_pad_bs] (verify_plan.pack_params); this rank's
        # results, which the gathers read; the kernels' error words (u32: the combine's
        # argument check, the records' refused value; padded)
        rec_bytes = record_words(TOP_K_MAX) * 4
        self._alloc("vsend", cfg.max_pad_bs * n * rec_bytes)
        if tp > 1 or self.route_self:
            self._alloc("vrecv", tp * rmax * n * rec_bytes)
        self._alloc(
            "vparams",
            param_bytes(cfg.max_pad_bs),
        )
        self._alloc("vpredict", rmax * n * 4)  # int32 [R, N]
        self._alloc("vaccept_index", rmax * n * 4)  # int32 [R, N]
        self._alloc("vaccept_length", rmax * 4)  # int32 [R]
        self._alloc("vlogprobs", rmax * n * 4)  # float32 [R, N]
        self._alloc("verr", 16)
        for buf in self._bufs.values():
            buf.fill(0)
        self._err_host, self.err_dev = self._alloc_error_block()
        ctypes.memset(self._err_host, 0, ERROR_BYTES)
        self._err_code = ctypes.c_int32.from_address(self._err_host)
        self._runtime.deviceSynchronize()
        self.ptr = {name: int(buf.data.ptr) for name, buf in self._bufs.items()}
        self.ptr.setdefault("staging", 0)
        self.ptr.setdefault("vrecv", self.ptr["vsend"])

    def _alloc_error_block(self) -> tuple[int, int]:
        """Mapped pinned host memory for the error block: (host address, device address)."""
        rt = self._runtime
        host = int(rt.hostAlloc(ERROR_BYTES, rt.hostAllocMapped | rt.hostAllocPortable))
        # under UVA (every 64-bit platform CUDA supports) the two addresses are equal
        attrs = rt.pointerGetAttributes(host)
        return host, int(getattr(attrs, "devicePointer", 0) or host)

    def _alloc(self, name: str, nbytes: int) -> None:
        """A dedicated ``cudaMalloc`` (not pooled), freed when the last view drops it."""
        cupy = self._cupy
        mem = cupy.cuda.Memory(max(1, nbytes))
        self._bufs[name] = cupy.ndarray(
            (nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0)
        )

    def _create_communicator(self, raw_uid: bytes) -> Any:
        nccl = self._nccl
        preferred = installed_unique_id_form()
        other = "tuple" if preferred == "bytes" else "bytes"
        with self._cupy.cuda.Device(self.device):
            try:
                return nccl.NcclCommunicator(
                    self.tp, unique_id_for_cupy(raw_uid, preferred), self.rank
                )
            except TypeError as first:
                # the argument conversion failed before ncclCommInitRank ran: retry
                try:
                    return nccl.NcclCommunicator(
                        self.tp, unique_id_for_cupy(raw_uid, other), self.rank
                    )
                except TypeError:
                    raise first from None

    def _end_communicator(self, comm: Any, abort: bool, cupy: Any) -> None:
        """``ncclCommDestroy`` (or abort). NCCL makes it wait until every CUDA graph
        that captured an op of this communicator is destroyed, so once ops were
        captured it runs on a daemon thread (CuPy releases the GIL in it) and
        close() waits at most :data:`CAPTURED_DESTROY_WAIT_S`; past that it warns and
        the destroy completes when the last such graph goes."""

        def end() -> None:
            ctx = cupy.cuda.Device(self.device) if cupy is not None else contextlib.nullcontext()
            with ctx:
                if abort:
                    comm.abort()
                else:
                    comm.destroy()

        if not self._captured:
            end()
            return
        worker = threading.Thread(
            target=end, name=f"ipc_dpsample-nccl-destroy-rank{self.rank}", daemon=True
        )
        worker.start()
        worker.join(CAPTURED_DESTROY_WAIT_S)
        if worker.is_alive():
            self.pending_destroy = worker
            warnings.warn(
                f"ipc_dpsample: rank {self.rank}: the NCCL communicator is still held by "
                "CUDA graphs that captured its ops (NCCL destroys it only after they are "
                "destroyed); close() returns now and the destroy finishes in the background "
                "once those graphs are gone. Drop the graphs before close() to free it at once.",
                RuntimeWarning,
                stacklevel=4,
            )

    def _release(self, abort: bool = False) -> None:
        """Destroy (or abort) the communicator and free every buffer; idempotent."""
        self._closed = True
        comm, self._comm = self._comm, None
        cupy = getattr(self, "_cupy", None)
        if comm is not None:
            self._end_communicator(comm, abort, cupy)
        self._views.clear()
        for plans in self._plans:
            plans.clear()
        # a new dict, not clear(): every output view holds the old one (its owner), so
        # outputs handed out stay valid after close; the memory goes with the last view
        self._bufs = {}
        if self._err_host and cupy is not None:
            self._err_code = ctypes.c_int32(0)  # never read freed host memory
            cupy.cuda.runtime.freeHost(self._err_host)
            self._err_host = 0

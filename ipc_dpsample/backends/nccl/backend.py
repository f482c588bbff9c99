""":class:`NcclBackend`: the per-call paths, ``check`` and ``close`` (set-up lives
in :mod:`.setup`; the protocol, CUDA-graph behaviour and limits in the package
docstring)."""

from __future__ import annotations

import ctypes
import struct
import warnings
from typing import Any

from ...arrays import ITEMSIZE, ArrayInfo, ArrayKind, resolve_stream
from ...config import CommConfig
from ...errors import BackendUnavailableError, DpSampleError
from ...group import HostGroup
from ...protocol import Dtype, Op
from ..base import Backend, RealRows, verify_unavailable
from ..common import InFlightGuard, ViewCache, array_ptr
from .geometry import packed_width
from .plan import ArgmaxPlan, GatherPlan, SwapPlan
from .records import (
    ERROR_BYTES,
    ERROR_WORDS,
    HDR_BYTES,
    format_error_block,
)
from .setup import NcclSetup

__all__ = ["NcclBackend"]


class NcclBackend(NcclSetup, Backend):
    """NCCL backend through ``cupy.cuda.nccl`` (see :mod:`ipc_dpsample.backends.nccl`).

    Parameters
    ----------
    cfg : CommConfig
    group : HostGroup
        Carries the set-up records (unique id, GPU UUIDs, errors) and the close barrier.
    device : int
        CUDA ordinal; one GPU per rank (NCCL refuses two ranks on one GPU).
    route_self_through_nccl : bool
        Send this rank's own block to itself through NCCL instead of reading it from
        the input in the permute kernel. Slower; exists so that a single GPU (tp=1)
        exercises the whole send/recv + staging path in tests.

    Raises
    ------
    BackendUnavailableError
        On every rank, when any rank cannot load NCCL, compile the kernels, allocate
        the buffers or create the communicator, or when two ranks share a GPU.
    """

    name = "nccl"

    def __init__(
        self,
        cfg: CommConfig,
        group: HostGroup,
        device: int,
        *,
        route_self_through_nccl: bool = False,
    ) -> None:
        if device < 0:
            raise BackendUnavailableError(
                "the NCCL backend needs a CUDA device but this communicator is on the CPU; "
                "use backend='torch' (or 'auto')"
            )
        self.cfg = cfg
        self.group = group
        self.device = device
        self.rank = cfg.rank
        self.tp = cfg.tp_size
        self.route_self = route_self_through_nccl
        self._closed = False
        self._comm: Any = None
        self._err_host = 0
        self._bufs: dict[str, Any] = {}
        self._views = ViewCache(device, self._bufs)
        self._swap_plans: dict[int, SwapPlan] = {}
        self._gather_plans: dict[tuple[Op, int], GatherPlan] = {}
        self.logits_dtype = None
        self._guard: InFlightGuard | None = None
        self.rmax = cfg.max_pad_bs // self.tp
        self.width = packed_width(cfg.max_pad_bs, self.tp, cfg.num_tokens_per_req)
        self._max_itemsize = ITEMSIZE[cfg.logits_dtype] if cfg.logits_dtype is not None else 4
        self._argmax_plans: dict[tuple[int, int], ArgmaxPlan] = {}
        self._plans: list[dict[Any, Any]] = [
            self._swap_plans,
            self._gather_plans,
            self._argmax_plans,
        ]
        self._set_up()
        if cfg.logits_dtype is not None:
            self.prepare(cfg.logits_dtype)

    def prepare(self, logits_dtype: str) -> None:
        """Make the swap and argmax ready for ``logits_dtype`` (host only: no device
        work, so it may be called between graph captures).

        Raises
        ------
        ValueError
            ``logits_dtype`` is not bfloat16/float16/float32, or needs larger elements
            than the buffers were sized for.
        """
        if logits_dtype == self.logits_dtype:
            return
        Dtype.of(logits_dtype)
        if ITEMSIZE[logits_dtype] > self._max_itemsize:
            raise ValueError(
                f"logits_dtype={logits_dtype} needs {ITEMSIZE[logits_dtype]}-byte elements; the "
                f"NCCL buffers were sized for {self._max_itemsize}"
            )
        self.logits_dtype = logits_dtype
        self._swap_plans.clear()
        self._argmax_plans.clear()
        self._views.drop(lambda key: key[0] == "swap")

    # -- per-call plumbing --------------------------------------------------------------
    def _raise_if_error(self) -> None:
        if self._err_code.value:
            words = struct.unpack(f"<{ERROR_WORDS}i", ctypes.string_at(self._err_host, ERROR_BYTES))
            raise DpSampleError(format_error_block(words, self.cfg.num_tokens_per_req))

    def _begin(self, kind: ArrayKind, stream: Any) -> tuple[int, bool, int]:
        """Raise a reported error, resolve the stream, apply the one-op-in-flight
        check and make this device current: ``(handle, capturing, previous device)``."""
        self._raise_if_error()
        handle = resolve_stream(kind, stream, self.device)
        assert self._guard is not None
        capturing = self._guard.begin(handle)
        if capturing:
            self._captured = True  # close() must not wait on NCCL for live graphs
        prev = self._runtime.getDevice()
        if prev != self.device:
            self._runtime.setDevice(self.device)
        return handle, capturing, prev

    def _end(self, handle: int, capturing: bool) -> None:
        assert self._guard is not None
        self._guard.end(handle, capturing)

    def _restore(self, prev: int) -> None:
        if prev != self.device:
            self._runtime.setDevice(prev)

    def _exchange(
        self, what: str, moves: Any, send_base: int, recv_base: int, stride: int, handle: int
    ) -> None:
        """One NCCL group: per peer step ``(dst, send_offset, nbytes, src, rbytes)`` of
        ``moves`` (:func:`~.geometry.swap_moves`) this rank's 16-byte header, then the
        data (uint8) from ``send_base + send_offset``, received at ``recv_base + src *
        stride``; zero-byte data steps are left out on both sides."""
        nccl, comm = self._nccl, self._comm
        u8 = nccl.NCCL_UINT8
        hdr, hdr_recv = self.ptr["my_hdr"], self.ptr["hdr_recv"]
        try:
            nccl.groupStart()
            try:
                for dst, off, nbytes, src, rbytes in moves:
                    comm.send(hdr, HDR_BYTES, u8, dst, handle)
                    comm.recv(hdr_recv + src * HDR_BYTES, HDR_BYTES, u8, src, handle)
                    if nbytes:
                        comm.send(send_base + off, nbytes, u8, dst, handle)
                    if rbytes:
                        comm.recv(recv_base + src * stride, rbytes, u8, src, handle)
            finally:
                nccl.groupEnd()
        except nccl.NcclError as exc:
            raise DpSampleError(
                f"rank {self.rank}: NCCL grouped send/recv of {what} failed: {exc}"
            ) from exc

    def _swap_plan(self, pad_bs: int) -> SwapPlan:
        plan = self._swap_plans.get(pad_bs)
        if plan is None:
            plan = SwapPlan(self, pad_bs)
            self._swap_plans[pad_bs] = plan
        return plan

    # -- collectives -----------------------------------------------------------------------
    def swap_batch_vocab(
        self, x: Any, info: ArrayInfo, *, pad_bs: int, bs: RealRows | None = None, stream: Any
    ) -> Any:
        """``x[pad_bs*N, V/tp]`` -> view ``[pad_bs/tp*N, V]`` of the persistent output.

        With a host ``bs`` only the rows of real requests travel (to peer ``p``,
        ``real_reqs(R, bs, p) * N`` rows) and only this rank's real rows are written.
        With a device ``bs`` (``bs.ptr``) every row travels (fixed byte counts, so
        the call is CUDA-graph capturable and replays read the scalar's new value)
        and the permute writes the real rows the scalar names at run time. Rows of
        phantom requests are undefined.
        """
        bs = RealRows.every(pad_bs) if bs is None else bs
        handle, capturing, prev = self._begin(info.kind, stream)
        try:
            plan = self._swap_plan(pad_bs)
            x_ptr = info.ptr
            plan.header(handle, bs.bs, bs.ptr)
            moves = plan.moves_for(bs)
            if moves:
                self._exchange(
                    "swap_batch_vocab", moves, x_ptr, self.ptr["staging"], plan.chunk, handle
                )
            self_src = 0 if self.route_self else x_ptr + self.rank * plan.chunk
            plan.permute_for(self_src)(handle, self_src)
            self._end(handle, capturing)
        finally:
            self._restore(prev)
        dtype = self.logits_dtype
        assert dtype is not None
        shape = (plan.rows, self.cfg.vocab_size)
        return self._views.get(info.kind, ("swap", pad_bs), self.ptr["out_swap"], shape, dtype)

    def _gather(
        self,
        op: Op,
        kind: ArrayKind,
        srcs: tuple[int, int, int],
        pad_bs: int,
        bs: RealRows,
        stream: Any,
    ) -> None:
        handle, capturing, prev = self._begin(kind, stream)
        try:
            key = (op, pad_bs)
            plan = self._gather_plans.get(key)
            if plan is None:
                plan = self._gather_plans[key] = GatherPlan(self, op, pad_bs)
            plan.pack(handle, *srcs, bs.bs, bs.ptr)
            nccl = self._nccl
            try:
                self._comm.allGather(
                    plan.slot, self.ptr["grecv"], self.width, nccl.NCCL_INT32, handle
                )
            except nccl.NcclError as exc:
                raise DpSampleError(
                    f"rank {self.rank}: NCCL allGather of {op.api_name} failed: {exc}"
                ) from exc
            plan.unpack(handle)
            self._end(handle, capturing)
        finally:
            self._restore(prev)

    def gather_verify_outputs(
        self,
        predict: Any,
        accept_index: Any,
        accept_length: Any,
        info: ArrayInfo,
        *,
        pad_bs: int,
        bs: RealRows | None = None,
        stream: Any,
    ) -> tuple[Any, Any, Any]:
        """int32 ``[R, N]``, ``[R, N]``, ``[R]`` -> views ``[pad_bs, N]``, ``[pad_bs, N]``,
        ``[pad_bs]``. Every row travels (fixed byte counts); ``bs`` travels in the
        header, read from the device scalar when the pack kernel runs."""
        kind = info.kind
        bs = RealRows.every(pad_bs) if bs is None else bs
        srcs = (info.ptr, array_ptr(accept_index, kind), array_ptr(accept_length, kind))
        self._gather(Op.GATHER_OUTPUTS, kind, srcs, pad_bs, bs, stream)
        shape = (pad_bs, self.cfg.num_tokens_per_req)
        p = self.ptr
        specs = (
            (p["predict"], shape, "int32"),
            (p["accept_index"], shape, "int32"),
            (p["accept_length"], (pad_bs,), "int32"),
        )
        return self._views.get_many(kind, ("outputs", pad_bs), specs)  # type: ignore[return-value]

    def gather_verify_logprobs(
        self,
        logprobs: Any,
        info: ArrayInfo,
        *,
        pad_bs: int,
        bs: RealRows | None = None,
        stream: Any,
    ) -> Any:
        """float32 ``[R, N]`` -> view ``[pad_bs, N]`` (every row travels, as the
        other gather)."""
        bs = RealRows.every(pad_bs) if bs is None else bs
        self._gather(Op.GATHER_LOGPROBS, info.kind, (info.ptr, 0, 0), pad_bs, bs, stream)
        shape = (pad_bs, self.cfg.num_tokens_per_req)
        return self._views.get(
            info.kind, ("logprobs", pad_bs), self.ptr["logprobs"], shape, "float32"
        )

    def argmax_batch_vocab(
        self,
        x: Any,
        info: ArrayInfo,
        *,
        pad_bs: int,
        vocab_limit: int,
        bs: RealRows | None = None,
        stream: Any,
    ) -> tuple[Any, Any]:
        """``x[pad_bs*N, V/tp]`` -> views (token_ids int32 ``[R*N]``, logprobs float32
        ``[R*N]``) of this rank's requests (see
        :func:`ipc_dpsample.layout.reference_argmax_batch_vocab`).

        ``nccl_header``; local partials ``[tp, R*N, 3]`` u32 of the real rows of the
        whole input (phantom rows skipped); one NCCL group moving ``R*N*12`` bytes
        (plus the 16-byte header) per peer pair; ``dp_argmax_combine`` into the
        persistent outputs; ``nccl_finish`` (header check, seq): 4 launches. The byte
        counts never depend on ``bs`` (host or device), so the call is CUDA-graph
        capturable (a replay reads a device ``bs`` anew) and a ``bs`` or
        ``vocab_limit``-independent mismatch of dtype/pad_bs/bs reaches the header
        check. Rows of phantom requests are undefined.

        Raises
        ------
        ValueError
            ``vocab_limit`` outside ``1..V`` (first call of a shape).
        """
        bs = RealRows.every(pad_bs) if bs is None else bs
        handle, capturing, prev = self._begin(info.kind, stream)
        try:
            key = (pad_bs, vocab_limit)
            plan = self._argmax_plans.get(key)
            if plan is None:
                plan = self._argmax_plans[key] = ArgmaxPlan(self, pad_bs, vocab_limit)
            plan.header(handle, bs.bs, bs.ptr)
            plan.partials(handle, info.ptr)
            if plan.moves:
                self._exchange(
                    "argmax_batch_vocab",
                    plan.moves,
                    plan.send_base,
                    plan.recv_base,
                    plan.recv_stride,
                    handle,
                )
            plan.combine(handle)
            plan.finish(handle)
            self._end(handle, capturing)
        finally:
            self._restore(prev)
        rn = pad_bs // self.tp * self.cfg.num_tokens_per_req
        p = self.ptr
        specs = ((p["token_ids"], (rn,), "int32"), (p["alogprobs"], (rn,), "float32"))
        return self._views.get_many(info.kind, ("argmax", pad_bs), specs)  # type: ignore[return-value]

    # -- verify -------------------------------------------------------------------
    def verify_batch_vocab(
        self,
        x: Any,
        info: ArrayInfo,
        candidates: Any,
        candidates_info: ArrayInfo,
        *,
        pad_bs: int,
        params: Any,
        return_logprobs: bool,
        bs: RealRows,
        stream: Any,
    ) -> tuple[Any, ...]:
        """Not in this version: raises :class:`~ipc_dpsample.errors.BackendUnavailableError`
        (the NCCL kernels of this op are not written yet)."""
        raise verify_unavailable("the NCCL kernels of this op are not written yet")

    def check(self) -> None:
        """Raise the first header mismatch any kernel reported, then any asynchronous
        NCCL error (``ncclCommGetAsyncError``), as :class:`DpSampleError`.

        Synchronise the ops' stream first to see the latest op's result."""
        if self._closed:
            raise DpSampleError("this NCCL backend is closed")
        self._raise_if_error()
        try:
            self._comm.check_async_error()
        except Exception as exc:
            raise DpSampleError(
                f"rank {self.rank}: NCCL reported an asynchronous error: {exc}; this "
                "communicator must be closed"
            ) from exc

    # -- teardown ---------------------------------------------------------------------------
    def close(self) -> None:
        """Host barrier (bounded by ``timeout_s``), then destroy the NCCL communicator;
        abort it instead, with a ``RuntimeWarning``, if a peer does not arrive."""
        if self._closed:
            return
        self._closed = True
        abort = False
        try:
            self.group.barrier(timeout_s=self.cfg.timeout_s, what="NCCL backend close")
        except DpSampleError as exc:
            abort = True
            warnings.warn(
                f"ipc_dpsample: aborting the NCCL communicator instead of destroying it: {exc}",
                RuntimeWarning,
                stacklevel=2,
            )
        self._release(abort=abort)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"NcclBackend(rank={self.rank}/{self.tp}, device=cuda:{self.device}, "
            f"dtype={self.logits_dtype}, {state})"
        )

""":class:`NcclBackend`: the per-call paths, ``check`` and ``close`` (set-up lives
in :mod:`.setup`; the protocol, CUDA-graph behaviour and limits in the package
docstring)."""

from __future__ import annotations

import ctypes
import struct
import warnings
from typing import Any

import numpy as np

from ...arrays import ITEMSIZE, ArrayInfo, ArrayKind, resolve_stream
from ...config import CommConfig
from ...errors import BackendUnavailableError, DpSampleError
from ...group import HostGroup
from ...layout import VerifyParams, real_reqs
from ...protocol import Dtype, Op
from ..base import Backend, RealRows
from ..common import InFlightGuard, ViewCache, array_ptr
from ..verify_plan import call_digest, kernel_path_refusal, list_cap, pack_params
from ..verify_swap import verify_by_swap
from .geometry import packed_width
from .plan import ArgmaxPlan, GatherPlan, SwapPlan, VerifyPlan
from .records import (
    ERROR_BYTES,
    ERROR_WORDS,
    HDR_BYTES,
    format_error_block,
)
from .setup import NcclSetup

__all__ = ["NcclBackend"]

#: ``cudaMemcpyKind`` values (``cupy.cuda.runtime.memcpyHostToDevice`` / ``...DeviceToDevice``).
_H2D, _D2D = 1, 3
#: Most CTAs of a grid-stride launch over rows.
_MAX_GRID = 65535


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
        self._verify_plans: dict[tuple[int, int], VerifyPlan] = {}
        #: "kernels" or "swap: <why>": how the last verify_batch_vocab ran (tests, bench)
        self.last_verify_path = ""
        self._plans: list[dict[Any, Any]] = [
            self._swap_plans,
            self._gather_plans,
            self._argmax_plans,
            self._verify_plans,
        ]
        self._set_up()
        if cfg.logits_dtype is not None:
            self.prepare(cfg.logits_dtype)

    def prepare(self, logits_dtype: str) -> None:
        """Make the swap, argmax and verify ready for ``logits_dtype`` (host only: no device
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
        self._verify_plans.clear()
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
            self._gather_on(op, srcs, pad_bs, bs, handle)
            self._end(handle, capturing)
        finally:
            self._restore(prev)

    def _gather_on(
        self, op: Op, srcs: tuple[int, int, int], pad_bs: int, bs: RealRows, handle: int
    ) -> None:
        """Pack, ``allGather``, unpack of one gather on ``handle`` (inside an op's
        :meth:`_begin` / :meth:`_end`)."""
        key = (op, pad_bs)
        plan = self._gather_plans.get(key)
        if plan is None:
            plan = self._gather_plans[key] = GatherPlan(self, op, pad_bs)
        plan.pack(handle, *srcs, bs.bs, bs.ptr)
        nccl = self._nccl
        try:
            self._comm.allGather(plan.slot, self.ptr["grecv"], self.width, nccl.NCCL_INT32, handle)
        except nccl.NcclError as exc:
            raise DpSampleError(
                f"rank {self.rank}: NCCL allGather of {op.api_name} failed: {exc}"
            ) from exc
        plan.unpack(handle)

    def _output_views(self, kind: ArrayKind, pad_bs: int) -> tuple[Any, Any, Any]:
        """Views ``[pad_bs, N]``, ``[pad_bs, N]``, ``[pad_bs]`` int32 of the gathered
        verify outputs."""
        shape = (pad_bs, self.cfg.num_tokens_per_req)
        p = self.ptr
        specs = (
            (p["predict"], shape, "int32"),
            (p["accept_index"], shape, "int32"),
            (p["accept_length"], (pad_bs,), "int32"),
        )
        return self._views.get_many(kind, ("outputs", pad_bs), specs)  # type: ignore[return-value]

    def _logprobs_view(self, kind: ArrayKind, pad_bs: int) -> Any:
        """View ``[pad_bs, N]`` float32 of the gathered logprobs."""
        shape = (pad_bs, self.cfg.num_tokens_per_req)
        return self._views.get(kind, ("logprobs", pad_bs), self.ptr["logprobs"], shape, "float32")

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
        return self._output_views(kind, pad_bs)

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
        return self._logprobs_view(info.kind, pad_bs)

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
    def _verify_plan(self, pad_bs: int, vocab_limit: int) -> VerifyPlan:
        key = (pad_bs, vocab_limit)
        plan = self._verify_plans.get(key)
        if plan is None:
            plan = self._verify_plans[key] = VerifyPlan(self, pad_bs, vocab_limit)
        return plan

    def verify_batch_vocab(
        self,
        x: Any,
        info: ArrayInfo,
        candidates: Any,
        candidates_info: ArrayInfo,
        *,
        pad_bs: int,
        params: VerifyParams,
        return_logprobs: bool,
        bs: RealRows,
        stream: Any,
    ) -> tuple[Any, ...]:
        """``x[pad_bs*N, V/tp]`` and int32 ``candidates[pad_bs, N]`` -> views (predict
        int32 ``[pad_bs, N]``, accept_index int32 ``[pad_bs, N]``, accept_length int32
        ``[pad_bs]``, and with ``return_logprobs`` logprobs float32 ``[pad_bs, N]``) of
        the gathered outputs (:func:`ipc_dpsample.layout.reference_verify_batch_vocab`).

        Kernel path (kernels/verify.cu), on the caller's stream: the normalised host
        parameters (six ``[pad_bs]`` arrays) copied to the device; ``nccl_header``;
        ``dp_verify_records`` reduces every real row of the whole input to one record
        (``record_words(cap)`` u32, ``cap`` the call's largest top-k); one NCCL group
        moves ``R*N*record_words(cap)*4`` bytes plus the 16-byte header per peer pair
        (fixed for every ``bs``); this rank's own block is copied into its receive
        slot; ``dp_verify_combine`` writes this rank's ``R`` requests' results;
        ``nccl_verify_finish`` (headers, the combine's argument check, seq); then the
        ``gather_verify_outputs`` (and ``gather_verify_logprobs``) collectives of those
        results, all inside this one op. A batch the kernels cannot decide (a real
        request with top-p or min-p but no top-k) takes
        :func:`~ipc_dpsample.backends.verify_swap.verify_by_swap` instead (swap, the
        package's sampler, gathers). ``last_verify_path`` says which ran.

        Ranks whose per-request parameters, candidates, ``vocab_limit`` or
        ``return_logprobs`` differ: every rank that took part raises
        :class:`DpSampleError` at its next call or :meth:`check` (the combine compares
        a digest of the call and of the row's request parameters, and the candidate, in
        every record; the rank that saw the difference marks the headers of the same
        call's gathers). The parameters are host arrays here (the communicator reads
        device arrays on the host for this backend). Ranks whose largest
        top-k differs move different byte counts: NCCL's limit (see the package
        docstring).

        Raises
        ------
        DpSampleError
            The stream is being captured into a CUDA graph (not capturable in this
            version: the parameters are read on the host per call); an earlier op's
            reported error; a failed NCCL call.
        """
        handle = resolve_stream(info.kind, stream, self.device)
        if self._runtime.streamIsCapturing(handle) != 0:
            raise DpSampleError(
                "verify_batch_vocab cannot be captured in a CUDA graph in this version: "
                "it reads the per-request parameters on the host when it is called; "
                "call it outside the capture"
            )
        refusal = kernel_path_refusal(params, self.tp)
        if refusal is not None:
            self.last_verify_path = f"swap: {refusal}"
            return verify_by_swap(
                self, x, info, candidates, candidates_info, pad_bs=pad_bs, params=params,
                return_logprobs=return_logprobs, bs=bs, stream=stream, tp=self.tp,
                rank=self.rank, device=self.device,
            )  # fmt: skip
        packed = np.ascontiguousarray(pack_params(params))
        cap = list_cap(params)
        n, p = self.cfg.num_tokens_per_req, self.ptr
        digest = call_digest(params.vocab_limit, cap, return_logprobs, n)
        handle, capturing, prev = self._begin(info.kind, stream)
        try:
            plan = self._verify_plan(pad_bs, params.vocab_limit)
            moves, chunk = plan.moves_for(cap)
            # pageable source: the call returns once the bytes are staged, in stream order
            self._runtime.memcpyAsync(p["vparams"], packed.ctypes.data, packed.nbytes, _H2D, handle)
            plan.header(handle, bs.bs, bs.ptr)
            values = (info.ptr, candidates_info.ptr, *plan.param_ptrs, cap)
            values += (int(return_logprobs), digest, bs.ptr, bs.bs)
            real = plan.reqs if bs.on_device else real_reqs(plan.reqs, bs.bs, self.rank)
            rows = pad_bs * n if bs.on_device else bs.bs * n
            records = plan.records if cap else plan.records_nolist
            records(handle, *values, grid=max(1, min(_MAX_GRID, rows)))
            send, recv = plan.send_base, plan.recv_base
            if moves:
                self._exchange("verify_batch_vocab", moves, send, recv, chunk, handle)
            if recv != send and not self.route_self:
                own = self.rank * chunk
                self._runtime.memcpyAsync(recv + own, send + own, chunk, _D2D, handle)
            plan.combine(handle, *values[1:], grid=max(1, min(_MAX_GRID, real)))
            plan.finish(handle)
            results = (p["vpredict"], p["vaccept_index"], p["vaccept_length"])
            self._gather_on(Op.GATHER_OUTPUTS, results, pad_bs, bs, handle)
            if return_logprobs:
                self._gather_on(Op.GATHER_LOGPROBS, (p["vlogprobs"], 0, 0), pad_bs, bs, handle)
            self._end(handle, capturing)
        finally:
            self._restore(prev)
        self.last_verify_path = "kernels"
        outs = self._output_views(info.kind, pad_bs)
        if not return_logprobs:
            return outs
        return (*outs, self._logprobs_view(info.kind, pad_bs))

    # -- tests --------------------------------------------------------------------
    def poison_for_testing(self, byte: int = 0xFF) -> None:
        """Fill the verify buffers (records, parameters, this rank's results) and the
        gathered outputs with ``byte`` (tests call this between ops, after a group
        barrier, to prove which output elements are written). Synchronous."""
        for name in (
            "vsend", "vrecv", "vparams", "vpredict", "vaccept_index", "vaccept_length",
            "vlogprobs", "predict", "accept_index", "accept_length", "logprobs",
        ):  # fmt: skip
            buf = self._bufs.get(name)
            if buf is not None:
                buf.fill(byte)
        self._runtime.deviceSynchronize()

    def check(self) -> None:
        """Raise the first error any kernel reported (a header mismatch, or
        ``verify_batch_vocab`` arguments that differ between ranks), then any
        asynchronous NCCL error (``ncclCommGetAsyncError``), as :class:`DpSampleError`.

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

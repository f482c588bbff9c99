"""The portable backend: torch.distributed collectives on a process group of its own.

CPU tensors (and NumPy arrays) travel over gloo, CUDA tensors over NCCL. Every op
is one ``alltoall_base`` on a members-only process group this communicator builds
on the c10d store with the communicator's ``timeout_s`` (``verify_batch_vocab``: one,
plus a probe round and a full-row round only for rows its records leave open, see
:mod:`.verify`); logits travel as raw bytes, so every dtype moves bit-exactly.

Wire format
-----------
To every peer a rank sends one block: a 16-byte header (:meth:`Call.header
<ipc_dpsample.protocol.Call.header>`: op/dtype, ``pad_bs``, ``bs``, sequence
number), then the payload, padded to 16 bytes. A rank never sends to itself: its
own rows are copied locally. Every receive slot has the size ``M`` of the largest
block any op can send (``max_pad_bs``-sized), while a sender sends only what the
call needs (``pad_bs``/``bs``-sized): gloo accepts a shorter message into a larger
slot, never a longer one (it aborts the process). So ranks that diverged (another
op, ``pad_bs``, ``bs`` or dtype, a skipped op) still complete the collective, every
rank compares every peer's header with its own *before* it unpacks anything, and
every rank raises :func:`~ipc_dpsample.protocol.divergence_message` in the same
call. NCCL needs equal sizes on both sides, so on CUDA every block travels at its
full size ``M`` (this backend is the fallback there; the nccl and onesided
backends are the fast ones). ``M`` also holds ``verify_batch_vocab``'s largest round
(every row's 1312-byte record, or ``max_pad_bs / tp * N`` full rows of the fallback
round), so a rank in that op and a rank in any other still complete the collective.

Bounded waits
-------------
The gloo group's timeout is ``timeout_s``: a collective waiting for a stalled peer
fails after it, one whose peer exited fails at once (connection reset). On CUDA the
host polls the work until ``timeout_s``. On any failure the rank aborts its group
(peers blocked in it fail at once), posts its header to the c10d store and waits
up to :data:`REPORT_WAIT_S` for every peer's, then raises

* the divergence error when a peer's header differs from its own;
* :class:`~ipc_dpsample.errors.PeerTimeoutError` naming the first peer whose
  record never came (it stalled or exited before the op);
* a :class:`~ipc_dpsample.errors.DpSampleError` saying that the peers gave up on
  this rank, when a peer's verdict names it (it arrived late);
* :class:`~ipc_dpsample.errors.PeerTimeoutError` naming the store's host (global
  rank 0) when the c10d store itself is unreachable;
* otherwise a :class:`~ipc_dpsample.errors.DpSampleError` with the c10d error
  chained.

So a rank raises within ``timeout_s + REPORT_WAIT_S`` (+ a few store round trips)
of entering the op. After any of these errors the communicator is poisoned: every
later call (and :meth:`TorchBackend.check`) raises the same error again.

Host copies
-----------
On CPU the swap's per-call copies (pack, own rows, unpack) are NumPy copies of
the same memory, on the calling thread, so its cost does not depend on torch's
thread count (see :meth:`TorchBackend.swap_batch_vocab`); the own rows are copied
while the collective is in flight.

Real rows (``bs``)
------------------
A host ``bs`` moves only real rows: to peer ``p`` the rows of its
``real_reqs(R, bs, p)`` requests, and the gathers send each rank's real rows only.
A device scalar ``bs`` (CUDA) is not read: every row moves (fixed counts, as
``bs=None``); the header then carries ``bs=-1``. The backend does not support
CUDA-graph capture (its header check reads the host); capturing raises.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ...arrays import ArrayInfo, ArrayKind, as_torch, check_host_stream, torch_view
from ...config import CommConfig
from ...errors import DpSampleError
from ...group import TorchStoreGroup
from ...layout import VerifyParams
from ...protocol import Call, Dtype, Op, divergence_message
from ..base import Backend, RealRows
from .argmax import PARTIAL_WORDS, combine_partials, local_partials
from .failure import REPORT_WAIT_S, diagnose_failure
from .plans import _HDR, _HDR_WORDS, TorchPlans, _Plan, _round16
from .verify import MAX_RECORD_BYTES, VHDR_BYTES, ParamsDiverged, VerifyRounds, run_verify

__all__ = ["REPORT_WAIT_S", "TorchBackend", "host_numpy"]

_TORCH_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
_PLAN_CACHE_LIMIT = 4096


class TorchBackend(TorchPlans, Backend):
    """torch.distributed backend.

    Parameters
    ----------
    cfg : CommConfig
    group : TorchStoreGroup
        Its store carries the dedicated process group and the failure records.
    device : torch.device
        ``cpu`` or ``cuda:k``; every persistent buffer lives there.
    shared_gpu : bool
        Some ranks share a GPU (NCCL refuses that): CUDA tensors travel over gloo.
    """

    name = "torch"

    def __init__(
        self,
        cfg: CommConfig,
        group: TorchStoreGroup,
        device: torch.device,
        shared_gpu: bool = False,
    ):
        self.cfg = cfg
        self.group = group
        self.device = device
        self._rank, self._tp = group.rank, cfg.tp_size
        self._n = cfg.num_tokens_per_req
        self._vs = cfg.vocab_size // cfg.tp_size
        self._rmax = cfg.max_pad_bs // cfg.tp_size
        self._cpu = device.type == "cpu"
        self._failure: DpSampleError | None = None
        self._seq = 0
        self._pg: Any = None
        self._key = ""
        # NCCL refuses two ranks on one GPU: such ranks' CUDA tensors go over gloo
        self.transport = "gloo" if device.type == "cpu" or shared_gpu else "nccl"
        if self._tp > 1:
            self._pg, self._key = group.dedicated_process_group(
                device.type, cfg.timeout_s, self.transport
            )
        kw: dict[str, Any] = {"device": device}
        n, rmax, peers = self._n, self._rmax, max(self._tp - 1, 1)
        itemsize = _TORCH_DTYPES[cfg.logits_dtype or "float32"].itemsize
        # M: the largest block any op sends to one peer
        self._block = _round16(
            _HDR
            + max(
                rmax * n * self._vs * itemsize,  # swap
                rmax * (2 * n + 1) * 4,  # gather_verify_outputs
                rmax * n * PARTIAL_WORDS * 4,  # argmax partials
                # verify: every real row's record (round 1), rmax*N full rows (round 3)
                VHDR_BYTES + cfg.max_pad_bs * n * MAX_RECORD_BYTES,
                VHDR_BYTES + rmax * n * self._vs * itemsize,
            )
        )
        self._send = torch.empty(peers * self._block, dtype=torch.uint8, **kw)
        self._recv = torch.empty(peers * self._block, dtype=torch.uint8, **kw)
        self._recv_splits = [0 if p == self._rank else self._block for p in range(self._tp)]
        self._recv2d = self._recv.view(peers, self._block)
        self._recv_hdr = np.arange(peers)[:, None] * (self._block // 4) + np.arange(_HDR_WORDS)
        self._hdr = np.zeros(_HDR_WORDS, dtype=np.int32)  # this call's header
        if self._cpu:
            self._send_w: Any = self._send.numpy().view(np.int32)
            self._recv_w: Any = self._recv.numpy().view(np.int32)
        else:
            self._send_w = self._send.view(torch.int32)
            self._recv_w = self._recv.view(torch.int32)
            self._hdr_host = torch.zeros(_HDR_WORDS, dtype=torch.int32).pin_memory()
            self._hdr_dev = torch.zeros(_HDR_WORDS, dtype=torch.int32, **kw)
            self._recv_hdr_dev = torch.from_numpy(self._recv_hdr).to(device)
        self.out_predict = torch.empty(cfg.max_pad_bs, n, dtype=torch.int32, **kw)
        self.out_accept_index = torch.empty(cfg.max_pad_bs, n, dtype=torch.int32, **kw)
        self.out_accept_length = torch.empty(cfg.max_pad_bs, dtype=torch.int32, **kw)
        self.out_logprobs = torch.empty(cfg.max_pad_bs, n, dtype=torch.float32, **kw)
        self.out_token_ids = torch.empty(rmax * n, dtype=torch.int32, **kw)
        self.out_argmax_logprobs = torch.empty(rmax * n, dtype=torch.float32, **kw)
        self.out_verify_predict = torch.empty(cfg.max_pad_bs, n, dtype=torch.int32, **kw)
        self.out_verify_accept_index = torch.empty(cfg.max_pad_bs, n, dtype=torch.int32, **kw)
        self.out_verify_accept_length = torch.empty(cfg.max_pad_bs, dtype=torch.int32, **kw)
        self.out_verify_logprobs = torch.empty(cfg.max_pad_bs, n, dtype=torch.float32, **kw)
        #: Real rows decided by each round of the last verify_batch_vocab (diagnostics).
        self.last_verify_rounds: VerifyRounds | None = None
        self._partials = torch.empty(cfg.max_pad_bs * n, PARTIAL_WORDS, dtype=torch.int32, **kw)
        self._combine = torch.empty(self._tp, rmax * n, PARTIAL_WORDS, dtype=torch.int32, **kw)
        self.out_swap: torch.Tensor | None = None
        self._logits_dtype: str | None = None
        self._plans: dict[tuple[int, int, int], _Plan] = {}
        self._views: dict[Any, Any] = {}
        if cfg.logits_dtype is not None:
            self.prepare(cfg.logits_dtype)

    # -- set-up --------------------------------------------------------------------
    def prepare(self, logits_dtype: str) -> None:
        """Allocate the swap output for ``logits_dtype`` (canonical name)."""
        if self._logits_dtype == logits_dtype:
            return
        self.out_swap = torch.empty(
            self._rmax * self._n,
            self.cfg.vocab_size,
            dtype=_TORCH_DTYPES[logits_dtype],
            device=self.device,
        )
        self._logits_dtype = logits_dtype
        self._plans.clear()
        self._views.clear()

    # -- helpers -------------------------------------------------------------------
    def _as_torch(self, x: Any, info: ArrayInfo) -> torch.Tensor:
        return as_torch(x, info.kind, self.device)

    def _out(self, kind: ArrayKind, key: str, pad_bs: int, t: torch.Tensor) -> Any:
        k = (kind, key, pad_bs)
        v = self._views.get(k)
        if v is None:
            v = self._views[k] = torch_view(kind, t)
        return v

    def _stream_ctx(self, stream: Any) -> Any:
        if self._cpu:
            check_host_stream(stream)  # TypeError unless None
            return _nullctx
        if torch.cuda.is_current_stream_capturing():
            raise DpSampleError(
                "the torch backend cannot run inside CUDA-graph capture (its header check "
                "reads the host); capture with the nccl or onesided backend"
            )
        if stream is None:
            return _nullctx
        if isinstance(stream, torch.cuda.Stream):
            return torch.cuda.stream(stream)
        from ...arrays import resolve_stream

        handle = resolve_stream(ArrayKind.TORCH, stream, self.device.index)
        return torch.cuda.stream(torch.cuda.ExternalStream(handle, device=self.device))

    def _begin(self, op: Op, dtype: Dtype, pad_bs: int, bs: RealRows | None) -> tuple[Call, int]:
        """This call's :class:`Call` (header written to ``self._hdr``) and the number
        of real requests it moves."""
        if self._failure is not None:
            raise self._failure
        host_bs = bs is not None and bs.given and not bs.on_device
        hdr_bs = bs.bs if host_bs else -1  # type: ignore[union-attr]
        call = Call(int(op), int(dtype), pad_bs, self._n, hdr_bs, self._seq)
        self._seq += 1
        self._hdr[:] = call.header()
        return call, (hdr_bs if host_bs else pad_bs)

    def _plan(self, key: tuple[int, int, int], build: Callable[[], _Plan]) -> _Plan:
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= _PLAN_CACHE_LIMIT:
                self._plans.clear()
            plan = self._plans[key] = build()
        return plan

    def _exchange(self, call: Call, plan: _Plan, during: Callable[[], Any] | None = None) -> None:
        """Send the plan's blocks (headers written here), wait (bounded), and raise on
        every rank if any peer's header differs from this rank's. ``during`` (local
        work that touches neither the send nor the receive buffer) runs while the
        collective is in flight."""
        if self._tp == 1:
            if during is not None:
                during()
            return
        if self._cpu:
            self._send_w[plan.send_hdr] = self._hdr
        else:
            self._hdr_host.numpy()[:] = self._hdr
            self._hdr_dev.copy_(self._hdr_host, non_blocking=True)
            self._send_w[plan.send_hdr] = self._hdr_dev
        try:
            work = self._pg.alltoall_base(
                self._recv, plan.send, self._recv_splits, plan.send_splits
            )
            if during is not None:
                during()
            self._wait(work)
        except Exception as exc:
            raise self._fail(call, exc) from exc
        if self._cpu:
            same = bool((self._recv_w[self._recv_hdr] == self._hdr).all())
        else:
            got = self._recv_w[self._recv_hdr_dev]
            same = bool((got == self._hdr_dev).all().item())
        if not same:
            self._diverged(call)

    def _wait(self, work: Any) -> None:
        if self._cpu:
            work.wait()  # gloo fails the work itself after timeout_s
            return
        deadline = time.monotonic() + self.cfg.timeout_s
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the collective did not finish within {self.cfg.timeout_s} s")
            time.sleep(50e-6)
        work.wait()

    def _diverged(self, call: Call) -> None:
        rows = self._recv_w[self._recv_hdr]
        if not self._cpu:
            rows = rows.cpu().numpy()
        peers = [p for p in range(self._tp) if p != self._rank]
        for j, peer in enumerate(peers):
            theirs = Call.from_header(rows[j].tolist(), self._n)
            if tuple(rows[j]) != tuple(self._hdr):
                self._failure = DpSampleError(
                    divergence_message(self._rank, peer, call, theirs, "torch")
                )
                raise self._failure

    def _fail(self, call: Call, exc: BaseException) -> DpSampleError:
        """Turn a failed collective into the error every rank can explain (see the
        module docstring); poison the communicator with it."""
        self._failure = diagnose_failure(
            call, exc, self._pg, self.group, self._key, self._n, self.cfg.timeout_s
        )
        return self._failure

    # -- collectives ---------------------------------------------------------------
    def swap_batch_vocab(
        self,
        x: Any,
        info: ArrayInfo,
        *,
        pad_bs: int,
        bs: RealRows | None = None,
        stream: Any = None,
    ) -> Any:
        """``x[pad_bs*N, V/tp]`` -> ``[pad_bs/tp*N, V]``, same dtype; rows of
        requests ``>= bs`` are undefined (see the module docstring for ``bs``)."""
        assert self.out_swap is not None and self._logits_dtype is not None
        dtype = Dtype.of(self._logits_dtype)
        t = self._as_torch(x, info)
        with self._stream_ctx(stream):
            call, real = self._begin(Op.SWAP, dtype, pad_bs, bs)
            plan = self._plan((Op.SWAP, pad_bs, real), lambda: self._swap_plan(pad_bs, real))
            if self._cpu:
                # On the host the copies are NumPy copies (memmove) of the same memory,
                # never torch copies: a torch copy of more than 32 K elements fans out to
                # the intra-op (OpenMP) pool, and with ranks x threads > cores (two ranks
                # and torch's default threads on two cores) waking that pool after a
                # blocking collective cost milliseconds per copy, 10x the copy itself
                # (bench_torch_cpu.py). NumPy copies run on the calling thread (GIL
                # released), so the swap costs the same whatever torch's thread count.
                src = (t.detach() if t.requires_grad else t).view(torch.uint8).numpy()
                src = src.reshape(-1)
                copy = np.copyto
            else:
                src, copy = t.view(-1).view(torch.uint8), torch.Tensor.copy_
            for dst, lo, hi in plan.pack:
                copy(dst, src[lo:hi])
            own_out, lo, hi = plan.extra
            # this rank's own rows are copied while the peers' travel (as gloo's own
            # all_to_all_single copies the self block in its worker thread)
            self._exchange(call, plan, lambda: copy(own_out, src[lo:hi].reshape(own_out.shape)))
            for dst, got in plan.unpack:
                copy(dst, got)
        return self._out(info.kind, "swap", pad_bs, self.out_swap[: pad_bs // self._tp * self._n])

    def gather_verify_outputs(
        self,
        predict: Any,
        accept_index: Any,
        accept_length: Any,
        info: ArrayInfo,
        *,
        pad_bs: int,
        bs: RealRows | None = None,
        stream: Any = None,
    ) -> tuple[Any, Any, Any]:
        """int32 ``[R, N]``, ``[R, N]``, ``[R]`` -> ``[pad_bs, N]``, ``[pad_bs, N]``,
        ``[pad_bs]``; rows ``>= bs`` are undefined."""
        n = self._n
        ins = [self._as_torch(a, info) for a in (predict, accept_index, accept_length)]
        outs = (self.out_predict, self.out_accept_index, self.out_accept_length)
        with self._stream_ctx(stream):
            call, real = self._begin(Op.GATHER_OUTPUTS, Dtype.INT32, pad_bs, bs)
            plan = self._plan(
                (Op.GATHER_OUTPUTS, pad_bs, real),
                lambda: self._gather_plan(pad_bs, real, outs, (n, n, 0)),
            )
            self._gather(call, plan, ins)
        k = info.kind
        return (
            self._out(k, "predict", pad_bs, self.out_predict[:pad_bs]),
            self._out(k, "accept_index", pad_bs, self.out_accept_index[:pad_bs]),
            self._out(k, "accept_length", pad_bs, self.out_accept_length[:pad_bs]),
        )

    def gather_verify_logprobs(
        self,
        logprobs: Any,
        info: ArrayInfo,
        *,
        pad_bs: int,
        bs: RealRows | None = None,
        stream: Any = None,
    ) -> Any:
        """float32 ``[R, N]`` -> ``[pad_bs, N]``; rows ``>= bs`` are undefined."""
        lp = self._as_torch(logprobs, info).view(torch.int32)
        out = self.out_logprobs.view(torch.int32)
        with self._stream_ctx(stream):
            call, real = self._begin(Op.GATHER_LOGPROBS, Dtype.INT32, pad_bs, bs)
            plan = self._plan(
                (Op.GATHER_LOGPROBS, pad_bs, real),
                lambda: self._gather_plan(pad_bs, real, (out,), (self._n,)),
            )
            self._gather(call, plan, [lp])
        return self._out(info.kind, "logprobs", pad_bs, self.out_logprobs[:pad_bs])

    def _gather(self, call: Call, plan: _Plan, ins: list[torch.Tensor]) -> None:
        body, own, replicate = plan.extra
        for dst, a in zip(body, ins, strict=True):
            dst.copy_(a[: dst.shape[0]])
        self._exchange_replicated(call, plan, replicate)
        for dst, a in zip(own, ins, strict=True):
            dst.copy_(a[: dst.shape[0]])
        for dst, got in plan.unpack:
            dst.copy_(got)

    def _exchange_replicated(self, call: Call, plan: _Plan, replicate: Any) -> None:
        if replicate is not None:  # the same block to every peer
            replicate[1:].copy_(replicate[:1].expand_as(replicate[1:]))
        self._exchange(call, plan)

    def argmax_batch_vocab(
        self,
        x: Any,
        info: ArrayInfo,
        *,
        pad_bs: int,
        vocab_limit: int,
        bs: RealRows | None = None,
        stream: Any = None,
    ) -> tuple[Any, Any]:
        """``x[pad_bs*N, V/tp]`` -> (token_ids int32 ``[R*N]``, logprobs float32
        ``[R*N]``) of this rank's requests; rows of requests ``>= bs`` undefined.

        Each rank reduces its shard per row (float32 max, first index of the max
        with ``torch.argmax`` semantics, sum of ``exp(x - max)``; columns
        ``>= vocab_limit`` excluded), sends the partials of peer ``p``'s real rows
        to ``p`` in one all-to-all, and combines the ``tp`` partials of its own rows
        (see :mod:`ipc_dpsample.backends.torch.argmax`)."""
        assert self._logits_dtype is not None
        dtype = Dtype.of(self._logits_dtype)
        t = self._as_torch(x, info)
        tp, n, me, vs = self._tp, self._n, self._rank, self._vs
        r = pad_bs // tp
        with self._stream_ctx(stream):
            call, real = self._begin(Op.ARGMAX, dtype, pad_bs, bs)
            plan = self._plan((Op.ARGMAX, pad_bs, real), lambda: self._argmax_plan(pad_bs, real))
            rows = real * n
            limit = min(max(vocab_limit - me * vs, 0), vs)
            local_partials(t[:rows], limit, me * vs, self._partials[:rows])
            src = self._partials.view(-1).view(torch.uint8)
            for dst, lo, hi in plan.pack:
                dst.copy_(src[lo:hi])
            self._exchange(call, plan)
            own, lo, hi, parts, ids, lps = plan.extra
            own.copy_(self._partials[lo:hi])
            for dst, got in plan.unpack:
                dst.copy_(got)
            combine_partials(parts, ids, lps)
        k = info.kind
        return (
            self._out(k, "token_ids", pad_bs, self.out_token_ids[: r * n]),
            self._out(k, "argmax_logprobs", pad_bs, self.out_argmax_logprobs[: r * n]),
        )

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
        stream: Any = None,
    ) -> tuple[Any, ...]:
        """``x[pad_bs*N, V/tp]``, ``candidates[pad_bs, N]`` -> (predict, accept_index,
        accept_length[, logprobs]) of the whole batch, every rank the same (see
        :mod:`ipc_dpsample.backends.torch.verify`: host NumPy records, one all-gather
        of them, the probe and full-row rounds only when rows are left open).

        The portable path: CPU tensors are read through zero-copy NumPy views; CUDA
        tensors are copied to the host (synchronously, on the op's stream) and the
        results copied back into the persistent device outputs. Rows of requests
        ``>= bs`` hold the reference's placeholders (undefined by contract)."""
        assert self._logits_dtype is not None
        name = self._logits_dtype
        t = self._as_torch(x, info)
        c = self._as_torch(candidates, candidates_info)
        with self._stream_ctx(stream):
            call, _ = self._begin(Op.VERIFY, Dtype.of(name), pad_bs, bs)
            local = host_numpy(t, name)
            cand = host_numpy(c, "int32")
            try:
                outs, rounds = run_verify(
                    local,
                    cand,
                    shard=self._rank,
                    tp=self._tp,
                    dtype=name,
                    params=params,
                    return_logprobs=return_logprobs,
                    allgather=lambda hdr, payload: self._allgather(call, hdr, payload),
                    capacity=self._block - _HDR,
                )
            except ParamsDiverged as exc:
                raise self._params_diverged(call, exc) from None
            self.last_verify_rounds = rounds
            dsts = (
                self.out_verify_predict,
                self.out_verify_accept_index,
                self.out_verify_accept_length,
                self.out_verify_logprobs,
            )[: len(outs)]
            for dst, got in zip(dsts, outs, strict=True):
                if self._cpu:
                    dst[:pad_bs].numpy()[...] = got
                else:
                    dst[:pad_bs].copy_(torch.from_numpy(got))
        keys = ("verify_predict", "verify_accept_index", "verify_accept_length", "verify_lp")
        k = info.kind
        return tuple(
            self._out(k, key, pad_bs, dst[:pad_bs]) for key, dst in zip(keys, dsts, strict=False)
        )

    def _allgather(self, call: Call, vhdr: np.ndarray, payload: np.ndarray) -> list[np.ndarray]:
        """The same block (verify header, then ``payload``) to every peer, through the
        all-to-all and its call-header check; every shard's block (this rank's own
        included) as host uint8 arrays in rank order."""
        nbytes = VHDR_BYTES + payload.nbytes
        own = np.concatenate([vhdr.view(np.uint8), payload])
        if self._tp == 1:
            return [own]
        plan = self._plan((int(Op.VERIFY), nbytes, -1), lambda: self._allgather_plan(nbytes))
        (send,) = plan.extra
        if self._cpu:
            send[:, _HDR : _HDR + nbytes] = own
            self._exchange(call, plan)
            got: Any = self._recv.numpy().reshape(self._tp - 1, self._block)
        else:
            send[:, _HDR : _HDR + nbytes].copy_(torch.from_numpy(own).to(self.device)[None])
            self._exchange(call, plan)
            got = self._recv2d[:, _HDR : _HDR + nbytes].cpu().numpy()
        blocks = [got[j, _HDR : _HDR + nbytes] if self._cpu else got[j] for j in range(len(got))]
        blocks.insert(self._rank, own)
        return blocks

    def _allgather_plan(self, nbytes: int) -> _Plan:
        send, splits, hdr, _, sizes = self._layout_sends([nbytes] * self._tp)
        block = next(size for size in sizes if size)
        send2d = send.view(self._tp - 1, block)
        return _Plan(send, splits, hdr, [], [], (send2d.numpy() if self._cpu else send2d,))

    def _params_diverged(self, call: Call, exc: ParamsDiverged) -> DpSampleError:
        if exc.internal:
            self._failure = DpSampleError(
                f"rank {self._rank}: in {call.describe()} rank {exc.peer} disagrees on "
                f"{', '.join(exc.fields)} although every argument agreed: the ranks "
                "computed different records (an ipc_dpsample bug, please report it; torch "
                "backend). This communicator is now unusable: every later call raises this "
                "error; close it and build a new one"
            )
        else:
            self._failure = DpSampleError(
                divergence_message(self._rank, exc.peer, call, call, "torch", exc.fields)
            )
        return self._failure

    # -- lifetime ------------------------------------------------------------------
    def check(self) -> None:
        """Raise the error that poisoned this communicator, if any."""
        if self._failure is not None:
            raise self._failure

    def close(self) -> None:
        """Drop the process group and every buffer (local; never waits for peers)."""
        pg, self._pg = self._pg, None
        if pg is not None and self._failure is not None:
            try:
                pg.abort()
            except Exception:
                pass
        self._views.clear()
        self._plans.clear()
        self.out_swap = None


_nullctx = contextlib.nullcontext()

_HOST_VIEW = {"bfloat16": (torch.int16, np.uint16)}


def host_numpy(t: torch.Tensor, dtype: str) -> np.ndarray:
    """A contiguous tensor as a NumPy array on the host: a zero-copy view on the CPU,
    a synchronous copy from a GPU; bfloat16 as its uint16 bits."""
    t = t.detach()
    if t.is_cuda:
        t = t.cpu()
    through = _HOST_VIEW.get(dtype)
    if through is None:
        return t.numpy()
    return t.view(through[0]).numpy().view(through[1])

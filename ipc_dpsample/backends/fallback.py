"""The non-one-sided path through a caller's collectives object (TokenSpeed's
``fallback_comm_backend``: a ``CommBackend`` with ``all_gather_into_tensor(output,
input, group)`` and ``all_to_all_single(output, input, group)``).

Every op is exactly one call of the object: the gathers one
``all_gather_into_tensor``, the swap and argmax one ``all_to_all_single``;
``verify_batch_vocab`` one ``all_gather_into_tensor`` per round of
:mod:`ipc_dpsample.backends.torch.verify` (one, rarely two or three), each block of
a fixed size (the largest round 1 of ``max_pad_bs``). Each
rank's block starts with the 4-word :meth:`Call.header
<ipc_dpsample.protocol.Call.header>`; blocks have fixed sizes (``max_pad_bs``-sized
for the gathers, ``pad_bs``-sized for the swap), so ranks whose calls diverged
still complete the collective and every rank raises the divergence error before
it writes an output. The object's own timeouts bound the waits (this package
cannot), the header check reads the host (not CUDA-graph capturable), and every
row moves whatever ``bs`` says (fixed counts; ``bs`` is checked through the
header).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..arrays import (
    ArrayInfo,
    ArrayKind,
    as_torch,
    check_host_stream,
    check_stream_type,
    torch_view,
)
from ..config import CommConfig
from ..errors import DpSampleError
from ..layout import VerifyParams
from ..protocol import Call, Dtype, Op, divergence_message
from .base import Backend, RealRows
from .torch.argmax import PARTIAL_WORDS, combine_partials, local_partials
from .torch.backend import host_numpy
from .torch.verify import MAX_RECORD_BYTES, VHDR_BYTES, ParamsDiverged, run_verify

__all__ = ["CollectivesBackend"]

_HDR = 4  # int32 words


class CollectivesBackend(Backend):
    """Ops through a caller-supplied collectives object (see the module docstring).

    Parameters
    ----------
    cfg : CommConfig
    collectives : object
        ``all_gather_into_tensor(output, input, group)`` and
        ``all_to_all_single(output, input, group)``.
    group : object
        Passed to the object's methods as is (the ``group`` the communicator got).
    device : torch.device
    """

    name = "torch"

    def __init__(self, cfg: CommConfig, collectives: Any, group: Any, device: torch.device):
        for method in ("all_gather_into_tensor", "all_to_all_single"):
            if not callable(getattr(collectives, method, None)):
                raise TypeError(
                    f"fallback_comm_backend {collectives!r} has no {method}(output, input, "
                    "group) method"
                )
        self.cfg, self.coll, self.group, self.device = cfg, collectives, group, device
        self._tp, self._n, self._rank = cfg.tp_size, cfg.num_tokens_per_req, cfg.rank
        self._vs = cfg.vocab_size // cfg.tp_size
        rmax = cfg.max_pad_bs // cfg.tp_size
        self._width = _HDR + rmax * (2 * self._n + 1)  # words per rank in a gather
        kw: dict[str, Any] = {"device": device}
        self._gsend = torch.zeros(self._width, dtype=torch.int32, **kw)
        self._grecv = torch.zeros(self._tp * self._width, dtype=torch.int32, **kw)
        self.out_predict = torch.empty(cfg.max_pad_bs, self._n, dtype=torch.int32, **kw)
        self.out_accept_index = torch.empty_like(self.out_predict)
        self.out_accept_length = torch.empty(cfg.max_pad_bs, dtype=torch.int32, **kw)
        self.out_logprobs = torch.empty(cfg.max_pad_bs, self._n, dtype=torch.float32, **kw)
        self.out_token_ids = torch.empty(rmax * self._n, dtype=torch.int32, **kw)
        self.out_argmax_logprobs = torch.empty(rmax * self._n, dtype=torch.float32, **kw)
        self._partials = torch.empty(
            cfg.max_pad_bs * self._n, PARTIAL_WORDS, dtype=torch.int32, **kw
        )
        self._dtype: str | None = None
        self.out_swap: torch.Tensor | None = None
        self._seq = 0
        self._failure: DpSampleError | None = None

    def prepare(self, logits_dtype: str) -> None:
        if logits_dtype != self._dtype:
            self._dtype = logits_dtype
            rows = self.cfg.max_pad_bs // self._tp * self._n
            torch_dtype = getattr(torch, logits_dtype)
            self.out_swap = torch.empty(
                rows, self.cfg.vocab_size, dtype=torch_dtype, device=self.device
            )

    # -- plumbing -----------------------------------------------------------------
    def _call(self, op: Op, dtype: Dtype, pad_bs: int, bs: RealRows | None, stream: Any) -> Call:
        if self._failure is not None:
            raise self._failure
        # the caller's collectives run on their own stream: only the form is checked
        if self.device.type == "cpu":
            check_host_stream(stream)
        else:
            check_stream_type(stream)
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise DpSampleError(
                "the fallback_comm_backend path cannot run inside CUDA-graph capture (its "
                "header check reads the host); capture with the onesided backend"
            )
        host_bs = bs.bs if bs is not None and bs.given and not bs.on_device else -1
        call = Call(int(op), int(dtype), pad_bs, self._n, host_bs, self._seq)
        self._seq += 1
        return call

    def _check(self, call: Call, headers: torch.Tensor) -> None:
        """``headers`` ``[tp, 4]``: raise the divergence error if any differs."""
        got = headers.cpu().tolist()
        mine = list(call.header())
        for peer, words in enumerate(got):
            if words != mine:
                self._failure = DpSampleError(
                    divergence_message(
                        self._rank, peer, call, Call.from_header(words, self._n), "fallback"
                    )
                )
                raise self._failure

    def _blocks(self, payload_words: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Send and receive buffers of tp blocks of a header + ``payload_words``."""
        words = _HDR + payload_words
        send = torch.empty(self._tp, words, dtype=torch.int32, device=self.device)
        return send, torch.empty_like(send)

    def _as_torch(self, x: Any, info: ArrayInfo) -> torch.Tensor:
        return as_torch(x, info.kind, self.device)

    @staticmethod
    def _out(kind: ArrayKind, t: torch.Tensor) -> Any:
        return torch_view(kind, t)

    # -- ops ----------------------------------------------------------------------
    def swap_batch_vocab(
        self,
        x: Any,
        info: ArrayInfo,
        *,
        pad_bs: int,
        bs: RealRows | None = None,
        stream: Any = None,
    ) -> Any:
        assert self._dtype is not None
        call = self._call(Op.SWAP, Dtype.of(self._dtype), pad_bs, bs, stream)
        t = self._as_torch(x, info)
        rows, tp = pad_bs // self._tp * self._n, self._tp
        src = t.reshape(-1).view(torch.uint8).view(tp, rows * self._vs * t.element_size())
        payload = -(-src.shape[1] // 4)
        send, recv = self._blocks(payload)
        send[:, :_HDR] = torch.tensor(call.header(), dtype=torch.int32)
        send[:, _HDR:].view(torch.uint8)[:, : src.shape[1]].copy_(src)
        self.coll.all_to_all_single(recv.view(-1), send.view(-1), self.group)
        self._check(call, recv[:, :_HDR])
        got = recv[:, _HDR:].view(torch.uint8)[:, : src.shape[1]].view(t.dtype)
        assert self.out_swap is not None
        out = self.out_swap[:rows]
        out.view(rows, tp, self._vs).copy_(got.view(tp, rows, self._vs).transpose(0, 1))
        return self._out(info.kind, out)

    def _gather(self, call: Call, parts: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        """One all_gather_into_tensor of [header | parts...] padded to the fixed width."""
        send = self._gsend
        send[:_HDR] = torch.tensor(call.header(), dtype=torch.int32)
        at = _HDR
        for p in parts:
            send[at : at + p.numel()].copy_(p.reshape(-1).view(torch.int32))
            at += p.numel()
        self.coll.all_gather_into_tensor(self._grecv, send, self.group)
        recv = self._grecv.view(self._tp, self._width)
        self._check(call, recv[:, :_HDR])
        at = _HDR
        for p, out in zip(parts, outs, strict=True):
            k = p.numel()
            out.view(torch.int32).view(self._tp, k).copy_(recv[:, at : at + k])
            at += k

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
        call = self._call(Op.GATHER_OUTPUTS, Dtype.INT32, pad_bs, bs, stream)
        ins = [self._as_torch(a, info) for a in (predict, accept_index, accept_length)]
        outs = [self.out_predict[:pad_bs], self.out_accept_index[:pad_bs]]
        outs.append(self.out_accept_length[:pad_bs])
        self._gather(call, ins, outs)
        return tuple(self._out(info.kind, o) for o in outs)  # type: ignore[return-value]

    def gather_verify_logprobs(
        self, logprobs: Any, info: ArrayInfo, *, pad_bs: int, bs: RealRows | None = None,
        stream: Any = None,
    ) -> Any:  # fmt: skip
        call = self._call(Op.GATHER_LOGPROBS, Dtype.INT32, pad_bs, bs, stream)
        out = self.out_logprobs[:pad_bs]
        self._gather(call, [self._as_torch(logprobs, info)], [out])
        return self._out(info.kind, out)

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
        assert self._dtype is not None
        call = self._call(Op.ARGMAX, Dtype.of(self._dtype), pad_bs, bs, stream)
        t = self._as_torch(x, info)
        tp, me, vs = self._tp, self._rank, self._vs
        rows = pad_bs // tp * self._n
        parts = self._partials[: pad_bs * self._n]
        local_partials(t, min(max(vocab_limit - me * vs, 0), vs), me * vs, parts)
        send, recv = self._blocks(rows * PARTIAL_WORDS)
        send[:, :_HDR] = torch.tensor(call.header(), dtype=torch.int32)
        send[:, _HDR:].copy_(parts.view(tp, rows * PARTIAL_WORDS))
        self.coll.all_to_all_single(recv.view(-1), send.view(-1), self.group)
        self._check(call, recv[:, :_HDR])
        ids, lps = self.out_token_ids[:rows], self.out_argmax_logprobs[:rows]
        combine_partials(recv[:, _HDR:].reshape(tp, rows, PARTIAL_WORDS), ids, lps)
        return self._out(info.kind, ids), self._out(info.kind, lps)

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
        """The torch backend's host algorithm (:func:`~.torch.verify.run_verify`) with
        each round one ``all_gather_into_tensor`` of fixed-size blocks: the call
        header, then the round's verify header and payload, zero-padded. Blocks keep
        one size whatever the round and the ranks' arguments, so ranks that diverged
        still complete the collective, and every rank raises."""
        assert self._dtype is not None
        name = self._dtype
        call = self._call(Op.VERIFY, Dtype.of(name), pad_bs, bs, stream)
        local = host_numpy(self._as_torch(x, info), name)
        cand = host_numpy(self._as_torch(candidates, candidates_info), "int32")
        capacity = VHDR_BYTES + self.cfg.max_pad_bs * self._n * MAX_RECORD_BYTES
        try:
            outs, _ = run_verify(
                local,
                cand,
                shard=self._rank,
                tp=self._tp,
                dtype=name,
                params=params,
                return_logprobs=return_logprobs,
                allgather=lambda hdr, payload: self._verify_round(call, hdr, payload, capacity),
                capacity=capacity,
            )
        except ParamsDiverged as exc:
            what = "the ranks computed different records (an ipc_dpsample bug)"
            self._failure = DpSampleError(
                f"rank {self._rank}: {what}: rank {exc.peer} disagrees on {', '.join(exc.fields)}"
                if exc.internal
                else divergence_message(self._rank, exc.peer, call, call, "fallback", exc.fields)
            )
            raise self._failure from None
        dsts = (self.out_predict, self.out_accept_index, self.out_accept_length)
        dsts += (self.out_logprobs,) if return_logprobs else ()
        for dst, got in zip(dsts, outs, strict=True):
            dst[:pad_bs].copy_(torch.from_numpy(np.ascontiguousarray(got)))
        return tuple(self._out(info.kind, dst[:pad_bs]) for dst in dsts)

    def _verify_round(
        self, call: Call, vhdr: np.ndarray, payload: np.ndarray, capacity: int
    ) -> list[np.ndarray]:
        """One round: every shard's verify header + payload, in rank order (host)."""
        own = np.concatenate([vhdr.view(np.uint8), payload])
        words = _HDR + -(-capacity // 4)
        send = torch.zeros(words, dtype=torch.int32)
        send[:_HDR] = torch.tensor(call.header(), dtype=torch.int32)
        send.view(torch.uint8)[4 * _HDR : 4 * _HDR + own.size] = torch.from_numpy(own)
        send = send.to(self.device)
        recv = torch.empty(self._tp * words, dtype=torch.int32, device=self.device)
        self.coll.all_gather_into_tensor(recv, send, self.group)
        blocks = recv.view(self._tp, words)
        self._check(call, blocks[:, :_HDR])
        host = blocks.cpu().numpy().view(np.uint8)
        return [host[s, 4 * _HDR : 4 * _HDR + own.size] for s in range(self._tp)]

    def check(self) -> None:
        if self._failure is not None:
            raise self._failure

    def close(self) -> None:
        self.coll = None

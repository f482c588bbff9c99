"""The portable backend: torch.distributed collectives on the caller's group.

CPU tensors (and NumPy arrays) travel over gloo, CUDA tensors over the group's
NCCL. Logits travel as raw bytes (``uint8`` views), so every dtype moves
bit-exactly on every process-group backend. The verify outputs are packed into
one int32 all-gather.

Mismatch check: every op starts with an all-gather of the same width, ``W = 4 +
R_max*(2N+1)`` int32 words per rank, whose first 4 words are a header (op, pad_bs,
N, op sequence). The gathers carry their payload in the rest of it (one collective
each); the swap sends the header alone in it, then its all-to-all. Because that
first collective has the same size for every op, ranks whose call sequences
diverged (another op, another ``pad_bs``, a skipped op) meet in it, and every rank
raises :class:`~ipc_dpsample.errors.DpSampleError` before any data lands in an
output. The swap pays one small extra collective for it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..arrays import ArrayInfo, ArrayKind
from ..config import CommConfig
from ..errors import DpSampleError
from ..group import TorchStoreGroup
from .base import Backend

__all__ = ["TorchBackend"]

_TORCH_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "int32": torch.int32,
}
OP_SWAP, OP_GATHER_OUTPUTS, OP_GATHER_LOGPROBS = 1, 2, 3
_OP_NAMES = {1: "swap_batch_vocab", 2: "gather_verify_outputs", 3: "gather_verify_logprobs"}
_HEADER = 4

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchBackend(Backend):
    """torch.distributed backend.

    Parameters
    ----------
    cfg : CommConfig
    group : TorchStoreGroup
    device : torch.device
        ``cpu`` or ``cuda:k``; every persistent buffer lives there.
    """

    name = "torch"

    def __init__(self, cfg: CommConfig, group: TorchStoreGroup, device: torch.device):
        self.cfg = cfg
        self.group = group
        self.device = device
        self.pg = group.process_group
        # a tuple subgroup runs on a members-only group driven directly
        self._direct = (
            None
            if self.pg is not None
            else group.members_process_group(device.type, timeout_s=max(60.0, cfg.timeout_s))
        )
        tp, n = cfg.tp_size, cfg.num_tokens_per_req
        rmax = cfg.max_pad_bs // tp
        self._seq = 0
        self._logits_dtype: str | None = None
        kw: dict[str, Any] = {"device": device}
        # every op's first collective: [tp, W] int32, header + packed gather payload
        self._width = _HEADER + rmax * (2 * n + 1)
        self._send = torch.zeros(self._width, dtype=torch.int32, **kw)
        self._recv = torch.empty(tp * self._width, dtype=torch.int32, **kw)
        self.out_predict = torch.empty(cfg.max_pad_bs, n, dtype=torch.int32, **kw)
        self.out_accept_index = torch.empty(cfg.max_pad_bs, n, dtype=torch.int32, **kw)
        self.out_accept_length = torch.empty(cfg.max_pad_bs, dtype=torch.int32, **kw)
        self.out_logprobs = torch.empty(cfg.max_pad_bs, n, dtype=torch.float32, **kw)
        self._staging: torch.Tensor | None = None
        self.out_swap: torch.Tensor | None = None
        self._views: dict[Any, Any] = {}
        if cfg.logits_dtype is not None:
            self.prepare(cfg.logits_dtype)

    # -- helpers -------------------------------------------------------------------
    def prepare(self, logits_dtype: str) -> None:
        if self._logits_dtype == logits_dtype:
            return
        cfg = self.cfg
        rmax = cfg.max_pad_bs // cfg.tp_size
        itemsize = torch.empty((), dtype=_TORCH_DTYPES[logits_dtype]).element_size()
        rows = rmax * cfg.num_tokens_per_req
        self._staging = torch.empty(
            cfg.tp_size * rows * (cfg.vocab_size // cfg.tp_size) * itemsize,
            dtype=torch.uint8,
            device=self.device,
        )
        self.out_swap = torch.empty(
            rows, cfg.vocab_size, dtype=_TORCH_DTYPES[logits_dtype], device=self.device
        )
        self._logits_dtype = logits_dtype
        self._views.clear()

    def _as_torch(self, x: Any, info: ArrayInfo) -> torch.Tensor:
        if info.kind is ArrayKind.TORCH:
            return x
        if info.kind is ArrayKind.NUMPY:
            return torch.from_numpy(x)
        return (
            torch.from_dlpack(x)
            if hasattr(x, "__dlpack__")
            else torch.as_tensor(x, device=self.device)
        )

    def _out(self, kind: ArrayKind, key: str, pad_bs: int, t: torch.Tensor) -> Any:
        k = (kind, key, pad_bs)
        v = self._views.get(k)
        if v is None:
            if kind is ArrayKind.TORCH:
                v = t
            elif kind is ArrayKind.NUMPY:
                v = t.numpy()
            elif kind is ArrayKind.CUPY:
                import cupy

                v = cupy.from_dlpack(t)
            else:
                from numba import cuda

                v = cuda.as_cuda_array(t)
            self._views[k] = v
        return v

    def _stream_ctx(self, stream: Any) -> Any:
        if stream is None or self.device.type != "cuda":
            return _nullctx
        if isinstance(stream, torch.cuda.Stream):
            return torch.cuda.stream(stream)
        from ..arrays import resolve_stream

        handle = resolve_stream(ArrayKind.TORCH, stream, self.device.index)
        return torch.cuda.stream(torch.cuda.ExternalStream(handle, device=self.device))

    def _header(self, op: int, pad_bs: int) -> list[int]:
        self._seq += 1
        return [op, pad_bs, self.cfg.num_tokens_per_req, self._seq & 0x7FFFFFFF]

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        if self._direct is not None:
            self._direct._allgather_base(out, inp).wait()
        else:
            _all_gather_single(out, inp, group=self.pg)

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        if self._direct is not None:
            self._direct.alltoall_base(out, inp, [], []).wait()
        else:
            dist.all_to_all_single(out, inp, group=self.pg)

    def _exchange(self, op: int, pad_bs: int) -> torch.Tensor:
        """All-gather ``self._send`` (its header set here) and raise on every rank if
        any rank's header differs. Returns the received ``[tp, W]`` words."""
        mine = self._header(op, pad_bs)
        self._send[:_HEADER].copy_(torch.tensor(mine, dtype=torch.int32))
        self._all_gather(self._recv, self._send)
        got = self._recv.view(self.cfg.tp_size, self._width)
        hdr = got[:, :_HEADER].cpu()
        expect = torch.tensor(mine, dtype=torch.int32)
        same = (hdr == expect).all(dim=1)
        if not bool(same.all()):
            bad = [r for r in range(self.cfg.tp_size) if not bool(same[r])]
            seen = {r: _describe_header(hdr[r].tolist()) for r in bad}
            raise DpSampleError(
                f"rank {self.group.rank}: peers called a different op or pad_bs: expected "
                f"{_describe_header(mine)}, got {seen}. The ranks' call sequences diverged; "
                "this communicator must be closed"
            )
        return got

    # -- collectives ---------------------------------------------------------------
    def swap_batch_vocab(
        self, x: Any, info: ArrayInfo, *, pad_bs: int, bs: Any = None, stream: Any
    ) -> Any:
        assert self._staging is not None and self.out_swap is not None
        cfg = self.cfg
        tp, n, vs = cfg.tp_size, cfg.num_tokens_per_req, cfg.vocab_size // cfg.tp_size
        rows = pad_bs // tp * n
        t = self._as_torch(x, info)
        with self._stream_ctx(stream):
            self._exchange(OP_SWAP, pad_bs)
            src = t.reshape(-1).view(torch.uint8)
            staging = self._staging[: src.numel()]
            self._all_to_all(staging, src)
            out = self.out_swap[:rows]
            itemsize = out.element_size()
            staged = staging.view(tp, rows, vs * itemsize)
            out.view(torch.uint8).view(rows, tp, vs * itemsize).copy_(staged.transpose(0, 1))
        return self._out(info.kind, "swap", pad_bs, out)

    def gather_verify_outputs(
        self,
        predict: Any,
        accept_index: Any,
        accept_length: Any,
        info: ArrayInfo,
        *,
        pad_bs: int,
        bs: Any = None,
        stream: Any,
    ) -> tuple[Any, Any, Any]:
        cfg = self.cfg
        tp, n = cfg.tp_size, cfg.num_tokens_per_req
        r = pad_bs // tp
        p = self._as_torch(predict, info)
        a = self._as_torch(accept_index, info)
        ln = self._as_torch(accept_length, info)
        with self._stream_ctx(stream):
            body = self._send[_HEADER : _HEADER + r * (2 * n + 1)].view(r, 2 * n + 1)
            body[:, :n].copy_(p)
            body[:, n : 2 * n].copy_(a)
            body[:, 2 * n].copy_(ln)
            got = self._exchange(OP_GATHER_OUTPUTS, pad_bs)[:, _HEADER : _HEADER + r * (2 * n + 1)]
            got = got.reshape(tp * r, 2 * n + 1)
            op_, oa, ol = (
                self.out_predict[:pad_bs],
                self.out_accept_index[:pad_bs],
                self.out_accept_length[:pad_bs],
            )
            op_.copy_(got[:, :n])
            oa.copy_(got[:, n : 2 * n])
            ol.copy_(got[:, 2 * n])
        k = info.kind
        return (
            self._out(k, "predict", pad_bs, op_),
            self._out(k, "accept_index", pad_bs, oa),
            self._out(k, "accept_length", pad_bs, ol),
        )

    def gather_verify_logprobs(
        self, logprobs: Any, info: ArrayInfo, *, pad_bs: int, bs: Any = None, stream: Any
    ) -> Any:
        cfg = self.cfg
        tp, n = cfg.tp_size, cfg.num_tokens_per_req
        r = pad_bs // tp
        lp = self._as_torch(logprobs, info)
        with self._stream_ctx(stream):
            self._send[_HEADER : _HEADER + r * n].view(torch.float32).copy_(lp.reshape(-1))
            got = self._exchange(OP_GATHER_LOGPROBS, pad_bs)[:, _HEADER : _HEADER + r * n]
            out = self.out_logprobs[:pad_bs]
            out.view(torch.int32).copy_(got.reshape(tp * r, n))
        return self._out(info.kind, "logprobs", pad_bs, out)

    def close(self) -> None:
        self._direct = None
        self._views.clear()
        self._staging = None
        self.out_swap = None


def _describe_header(h: list[int]) -> str:
    return f"{_OP_NAMES.get(h[0], f'op {h[0]}')}(pad_bs={h[1]}, N={h[2]}) #{h[3]}"


class _NullCtx:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_nullctx = _NullCtx()

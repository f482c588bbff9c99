"""Launch plans of the torch backend: how each op's blocks are laid out in the send
buffer and unpacked from the receive buffer (views built once per shape and
``bs``, so the per-call path only copies). See
:mod:`ipc_dpsample.backends.torch.backend` for the wire format."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from ...layout import real_reqs
from .argmax import PARTIAL_WORDS

__all__ = ["TorchPlans"]

_HDR = 16  # header bytes at the start of every block
_HDR_WORDS = _HDR // 4


def _round16(n: int) -> int:
    return (n + 15) // 16 * 16


class _Plan(NamedTuple):
    """What one (op, pad_bs, bs) call sends and where its results land."""

    send: torch.Tensor  # uint8, the packed blocks for the peers
    send_splits: list[int]  # bytes to each rank (0 to itself)
    send_hdr: Any  # int32 word indices of the headers in the send buffer [peers, 4]
    # swap on CPU: NumPy views (np.ndarray) of the same memory, else torch views
    pack: list[tuple[Any, int, int]]  # (send payload view, src byte lo, hi)
    unpack: list[tuple[Any, Any]]  # (destination view, received view)
    extra: tuple[Any, ...] = ()  # op-specific views


class TorchPlans:
    """The plan builders of :class:`~ipc_dpsample.backends.torch.backend.TorchBackend`
    (a mixin: they read its buffers and sizes)."""

    _send: torch.Tensor
    _recv2d: torch.Tensor
    _combine: torch.Tensor
    _block: int
    _cpu: bool
    _rank: int
    _tp: int
    _n: int
    device: torch.device
    out_swap: torch.Tensor | None
    out_token_ids: torch.Tensor
    out_argmax_logprobs: torch.Tensor

    def _layout_sends(
        self, sizes: list[int]
    ) -> tuple[torch.Tensor, list[int], Any, list[int], list[int]]:
        """Packed send blocks of ``sizes[p]`` payload bytes to each peer ``p``.

        Returns the send tensor, split sizes, header word indices, and per peer the
        block's byte offset (-1 for this rank) and padded block size."""
        offsets, splits, off = [], [], 0
        for p, nbytes in enumerate(sizes):
            if p == self._rank:
                offsets.append(-1)
                splits.append(0)
                continue
            size = self._block if not self._cpu else _round16(_HDR + nbytes)
            offsets.append(off)
            splits.append(size)
            off += size
        peers = [o for o in offsets if o >= 0]
        hdr = np.asarray(peers, dtype=np.int64)[:, None] // 4 + np.arange(_HDR_WORDS)
        if not self._cpu:
            hdr = torch.from_numpy(hdr).to(self.device)
        return self._send[:off], splits, hdr, offsets, splits

    @staticmethod
    def _pack_views(
        send: torch.Tensor, offsets: list[int], rows: list[int], rowbytes: int, stride: int
    ) -> list[tuple[torch.Tensor, int, int]]:
        """Per peer ``p``: its block's payload view and the source byte range, rows
        ``[p*stride, p*stride + rows[p])`` of a ``rowbytes``-wide source."""
        views = []
        for p, o in enumerate(offsets):
            if o >= 0:
                lo, nbytes = p * stride * rowbytes, rows[p] * rowbytes
                views.append((send[o + _HDR : o + _HDR + nbytes], lo, lo + nbytes))
        return views

    def _peer_ranges(self) -> list[tuple[int, int, int]]:
        """Contiguous peer ranges ``(first rank, end rank, first receive block)``."""
        me, tp = self._rank, self._tp
        return [r for r in ((0, me, 0), (me + 1, tp, me)) if r[1] > r[0]]

    def _swap_plan(self, pad_bs: int, real: int) -> _Plan:
        assert self.out_swap is not None
        tp, n, me, r = self._tp, self._n, self._rank, pad_bs // self._tp
        rowbytes = self._vs * self.out_swap.element_size()
        rows = [real_reqs(r, real, p) * n for p in range(tp)]
        send, splits, hdr, offsets, _ = self._layout_sends([k * rowbytes for k in rows])
        pack = self._pack_views(send, offsets, rows, rowbytes, r * n)
        out3 = self.out_swap[: r * n].view(torch.uint8).view(r * n, tp, rowbytes)
        mine = rows[me]
        unpack = []
        for p0, p1, j0 in self._peer_ranges():
            got = self._recv2d[j0 : j0 + p1 - p0, _HDR : _HDR + mine * rowbytes]
            unpack.append((out3[:mine, p0:p1], got.view(p1 - p0, mine, rowbytes).transpose(0, 1)))
        own_lo = me * r * n * rowbytes
        extra = (out3[:mine, me], own_lo, own_lo + mine * rowbytes)
        if self._cpu:  # NumPy views of the same memory: see TorchBackend.swap_batch_vocab
            pack = [(dst.numpy(), lo, hi) for dst, lo, hi in pack]
            unpack = [(dst.numpy(), got.numpy()) for dst, got in unpack]
            extra = (extra[0].numpy(), *extra[1:])
        return _Plan(send, splits, hdr, pack, unpack, extra)

    def _gather_plan(
        self, pad_bs: int, real: int, outs: tuple[torch.Tensor, ...], widths: tuple[int, ...]
    ) -> _Plan:
        """Plan of a gather of ``len(outs)`` int32 arrays ``[R, w]`` (``w = 0``: ``[R]``)
        packed side by side, each rank sending only its real rows."""
        tp, me, r = self._tp, self._rank, pad_bs // self._tp
        width = sum(max(w, 1) for w in widths)
        mine, most = real_reqs(r, real, me), real_reqs(r, real, 0)
        send, splits, hdr, offsets, sizes = self._layout_sends([mine * width * 4] * tp)
        words = self._send.view(torch.int32)  # tp == 1: packed but never sent
        first = next(o for o in offsets if o >= 0) if tp > 1 else 0
        block = words[first // 4 + _HDR_WORDS : first // 4 + _HDR_WORDS + mine * width]
        body, own, unpack, col = [], [], [], 0
        recv_words = self._recv2d.view(torch.int32)
        for out, w in zip(outs, widths, strict=True):
            wide = max(w, 1)
            field = block.view(mine, width)[:, col : col + wide]
            body.append(field if w else field[:, 0])
            out3 = out[:pad_bs].view(tp, r, *((w,) if w else ()))
            own.append(out3[me, :mine])
            for p0, p1, j0 in self._peer_ranges():
                got = recv_words[j0 : j0 + p1 - p0, _HDR_WORDS : _HDR_WORDS + most * width]
                got = got.view(p1 - p0, most, width)[:, :, col : col + wide]
                unpack.append((out3[p0:p1, :most], got if w else got[:, :, 0]))
            col += wide
        peers = tp - 1
        replicate = None
        if peers > 1:
            replicate = send.view(peers, sizes[1 if me == 0 else 0])
        pack: list[tuple[torch.Tensor, int, int]] = []
        return _Plan(send, splits, hdr, pack, unpack, (body, own, replicate))

    def _argmax_plan(self, pad_bs: int, real: int) -> _Plan:
        tp, n, me, r = self._tp, self._n, self._rank, pad_bs // self._tp
        rowbytes = PARTIAL_WORDS * 4
        rows = [real_reqs(r, real, p) * n for p in range(tp)]
        send, splits, hdr, offsets, _ = self._layout_sends([k * rowbytes for k in rows])
        pack = self._pack_views(send, offsets, rows, rowbytes, r * n)
        mine = rows[me]
        parts = self._combine[:, :mine]
        unpack = []
        for p0, p1, j0 in self._peer_ranges():
            got = self._recv2d[j0 : j0 + p1 - p0, _HDR : _HDR + mine * rowbytes]
            unpack.append((parts[p0:p1], got.view(torch.int32).view(p1 - p0, mine, PARTIAL_WORDS)))
        extra = (
            parts[me],
            me * r * n,
            me * r * n + mine,
            parts,
            self.out_token_ids[:mine],
            self.out_argmax_logprobs[:mine],
        )
        return _Plan(send, splits, hdr, pack, unpack, extra)

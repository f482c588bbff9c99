"""The host half of ``kernels/dp_common.cuh``: the arena layout, the descriptor every
kernel takes (a ctypes mirror of ``struct DpDesc``), the error block and the op
signature carried by every flag word.

All of it is pure (tested on the CPU); a test compiles the header with g++ and
compares every ``offsetof``/``sizeof`` with the structures here.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cached_property

from ...protocol import Call, Dtype, Op
from ..verify_plan import BROADCAST_MAX_ROWS

__all__ = [
    "ERROR_BLOCK_SIZE",
    "MAX_SIG_PAD_BS",
    "ArenaOffsets",
    "DpDesc",
    "DpErrorBlock",
    "pack_signature",
    "unpack_signature",
]

ALIGN = 256
#: pad_bs and bs each travel in 13 bits of the signature
MAX_SIG_PAD_BS = (1 << 13) - 1
_OP_SHIFT, _DTYPE_SHIFT, _GRAPH_SHIFT, _PAD_SHIFT = 29, 27, 26, 13
_FIELD = MAX_SIG_PAD_BS
#: ctrl words (u32) at the start of the arena, as in dp_common.cuh
CTRL_EPOCH, CTRL_COUNTER, CTRL_BROKEN, CTRL_VALUE = 0, 1, 2, 3
ERR_TIMEOUT, ERR_MISMATCH, ERR_PARAMS, ERR_VALUE = 1, 2, 3, 4
#: u32 words of the largest verify record (kernels/verify.cuh: DV_HDR + 2 * 128)
VERIFY_RECORD_WORDS = 12 + 2 * 128
#: persistent outputs, in DpDesc.out_off order
OUTPUTS = (
    "predict",
    "accept_index",
    "accept_length",
    "logprobs",
    "argmax_ids",
    "argmax_logprobs",
)


def _up(x: int, a: int = ALIGN) -> int:
    return (x + a - 1) // a * a


class DpErrorBlock(ctypes.Structure):
    """``struct DpErrorBlock``: the first error a kernel of this rank reported."""

    _fields_ = [
        ("code", ctypes.c_uint32),
        ("rank", ctypes.c_uint32),
        ("peer", ctypes.c_uint32),
        ("op", ctypes.c_uint32),
        ("expected", ctypes.c_uint32),
        ("mine", ctypes.c_uint32),
        ("seen", ctypes.c_uint64),
    ]


ERROR_BLOCK_SIZE = ctypes.sizeof(DpErrorBlock)


class DpDesc(ctypes.Structure):
    """``struct DpDesc``: the arena descriptor, passed by value to every kernel."""

    _fields_ = [
        ("peers", ctypes.c_uint64),
        ("base", ctypes.c_uint64),
        ("err", ctypes.c_uint64),
        ("timeout_ns", ctypes.c_uint64),
        ("flags_off", ctypes.c_uint64),
        ("ready_off", ctypes.c_uint64),
        ("ll_off", ctypes.c_uint64),
        ("ll_region_bytes", ctypes.c_uint64),
        ("ll_slots", ctypes.c_uint64),
        ("swap_off", ctypes.c_uint64),
        ("swap_region_bytes", ctypes.c_uint64),
        ("swap_fixed_off", ctypes.c_uint64),
        ("out_off", ctypes.c_uint64 * len(OUTPUTS)),
        ("rank", ctypes.c_uint32),
        ("tp", ctypes.c_uint32),
        ("n", ctypes.c_uint32),
        ("parity_mask", ctypes.c_uint32),
    ]


def pack_signature(op: Op, dtype: Dtype, pad_bs: int, graph: bool = False) -> int:
    """The 32-bit signature of an op call without its ``bs`` (the kernel adds the
    ``bs`` it reads): ``op << 29 | dtype << 27 | graph << 26 | pad_bs << 13``.

    Ranks that call different ops, pass a different ``pad_bs``, ``bs`` or logits
    dtype, or disagree on CUDA-graph mode produce different signatures, which the
    kernels turn into an error on every rank instead of moving wrong data.
    """
    if not 0 < pad_bs <= MAX_SIG_PAD_BS:
        raise ValueError(f"pad_bs={pad_bs} out of signature range (1..{MAX_SIG_PAD_BS})")
    return (
        int(op) << _OP_SHIFT
        | int(dtype) << _DTYPE_SHIFT
        | int(graph) << _GRAPH_SHIFT
        | pad_bs << _PAD_SHIFT
    )


def unpack_signature(sig: int, n: int = -1) -> Call:
    """The call a (full) signature describes."""
    return Call(
        op=(sig >> _OP_SHIFT) & 0x7,
        dtype=(sig >> _DTYPE_SHIFT) & 0x3,
        pad_bs=(sig >> _PAD_SHIFT) & _FIELD,
        n=n,
        bs=sig & _FIELD,
        graph=bool((sig >> _GRAPH_SHIFT) & 1),
    )


@dataclass(frozen=True)
class ArenaOffsets:
    """Byte offsets inside one rank's arena (each computed once: the per-call path
    reads them, and a chain of plain properties cost microseconds per op).

    Parameters
    ----------
    tp, max_pad_bs, num_tokens_per_req, vocab_size : int
        The communicator's shape (``R_max = max_pad_bs / tp``).
    itemsize : int
        Bytes per logits element the swap regions are sized for (2 or 4).
    """

    tp: int
    max_pad_bs: int
    num_tokens_per_req: int
    vocab_size: int
    itemsize: int

    @cached_property
    def r_max(self) -> int:
        return self.max_pad_bs // self.tp

    # control block: u32 epoch, counter, broken, value-error claim at 0..16; u64 probe[tp] at 64
    ctrl_off = 0
    probe_off = 64

    @cached_property
    def flags_off(self) -> int:
        """``u64 flags[2][tp]``."""
        return _up(self.probe_off + 8 * self.tp)

    @cached_property
    def ready_off(self) -> int:
        """``u64 ready[2][tp]``: the graph-mode swap's entry barrier words."""
        return self.flags_off + 2 * self.tp * 8

    @cached_property
    def ll_slots(self) -> int:
        """Packets per source rank in one LL region: ``R_max * max(2N + 1, 3N)``
        (verify outputs; argmax partials are three words per row)."""
        n = self.num_tokens_per_req
        return self.r_max * max(2 * n + 1, 3 * n)

    @cached_property
    def ll_region_bytes(self) -> int:
        return _up(self.tp * self.ll_slots * 8)

    @cached_property
    def ll_off(self) -> int:
        """``u64 ll[2][tp][ll_slots]``."""
        return _up(self.ready_off + 2 * self.tp * 8)

    @cached_property
    def swap_rows(self) -> int:
        return self.r_max * self.num_tokens_per_req

    @cached_property
    def swap_region_bytes(self) -> int:
        """One parity's ``[R_max * N, V]`` receive region."""
        return _up(self.swap_rows * self.vocab_size * self.itemsize)

    @cached_property
    def swap_off(self) -> int:
        return self.ll_off + 2 * self.ll_region_bytes

    @cached_property
    def swap_fixed_off(self) -> int:
        """A third ``[R_max * N, V]`` region: the fixed swap output used once ops are
        captured in CUDA graphs."""
        return self.swap_off + 2 * self.swap_region_bytes

    @cached_property
    def out_offsets(self) -> tuple[int, ...]:
        """Offsets of the persistent outputs, in :data:`OUTPUTS` order: predict,
        accept_index ``[max_pad_bs, N]``, accept_length ``[max_pad_bs]``, logprobs
        ``[max_pad_bs, N]``, argmax ids and logprobs ``[R_max * N]``."""
        n, pad = self.num_tokens_per_req, self.max_pad_bs
        sizes = (pad * n, pad * n, pad, pad * n, self.swap_rows, self.swap_rows)
        offs, at = [], self.swap_off + 3 * self.swap_region_bytes
        for words in sizes:
            offs.append(at)
            at += _up(words * 4)
        return tuple(offs)

    def out_off(self, name: str) -> int:
        return self.out_offsets[OUTPUTS.index(name)]

    @cached_property
    def verify_region_bytes(self) -> int:
        """One parity's ``verify_batch_vocab`` records: ``u32 [tp][rows][268]``
        (source-major: rank ``s`` writes its records at block ``s``), ``rows`` the
        larger of ``R_max * N`` (the owner's rows) and the rows of a batch whose records
        are broadcast (``verify_plan.BROADCAST_MAX_ROWS``, at most ``max_pad_bs * N``:
        every rank holds every row's records)."""
        bcast_rows = min(BROADCAST_MAX_ROWS, self.max_pad_bs * self.num_tokens_per_req)
        rows = max(self.swap_rows, bcast_rows)
        return _up(self.tp * rows * VERIFY_RECORD_WORDS * 4)

    @cached_property
    def verify_off(self) -> int:
        """The two verify regions (parity 0, then 1), after the outputs."""
        return self.out_offsets[-1] + _up(self.swap_rows * 4)

    @cached_property
    def total_bytes(self) -> int:
        last = self.verify_off + 2 * self.verify_region_bytes
        return _up(last, 2 << 20)

    def descriptor(
        self, *, peers: int, base: int, err: int, timeout_ns: int, rank: int, parity_mask: int
    ) -> DpDesc:
        """The kernels' descriptor of this layout for one rank's arena."""
        return DpDesc(
            peers=peers,
            base=base,
            err=err,
            timeout_ns=timeout_ns,
            flags_off=self.flags_off,
            ready_off=self.ready_off,
            ll_off=self.ll_off,
            ll_region_bytes=self.ll_region_bytes,
            ll_slots=self.ll_slots,
            swap_off=self.swap_off,
            swap_region_bytes=self.swap_region_bytes,
            swap_fixed_off=self.swap_fixed_off,
            out_off=(ctypes.c_uint64 * len(OUTPUTS))(*self.out_offsets),
            rank=rank,
            tp=self.tp,
            n=self.num_tokens_per_req,
            parity_mask=parity_mask,
        )

"""The symmetric arena: one dedicated ``cudaMalloc`` per rank holding every receive
region and flag of a communicator, its IPC export, and the device table of peer
arena bases.

:class:`ArenaLayout` is pure (offsets and sizes, tested on the CPU); it is the
Python half of the layout described at the top of ``kernels/onesided.cu``.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from functools import cached_property
from typing import Any

__all__ = [
    "ERROR_BLOCK_FORMAT",
    "ERROR_BLOCK_SIZE",
    "OP_CODES",
    "Arena",
    "ArenaLayout",
    "pack_signature",
    "unpack_signature",
]

ALIGN = 256
#: code, rank, peer, op, expected epoch, seen signature, seen word
ERROR_BLOCK_FORMAT = "<IIIIIIQ"
ERROR_BLOCK_SIZE = struct.calcsize(ERROR_BLOCK_FORMAT)
#: op codes carried in the top 4 bits of every signature
OP_CODES = {"swap_batch_vocab": 1, "gather_verify_outputs": 2, "gather_verify_logprobs": 3}
OP_NAMES = {v: k for k, v in OP_CODES.items()}
DTYPE_CODES = {"int32": 0, "bfloat16": 1, "float16": 2, "float32": 3}
DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}
MAX_SIG_PAD_BS = (1 << 23) - 1
#: signature bit of a swap issued in CUDA-graph mode (entry barrier, fixed output):
#: ranks that disagree on the mode must not exchange data
SIG_FIXED_OUTPUT = 1 << 23


def _up(x: int, a: int = ALIGN) -> int:
    return (x + a - 1) // a * a


def pack_signature(op: str, dtype: str, pad_bs: int, fixed_output: bool = False) -> int:
    """32-bit signature of an op call:
    ``op << 28 | dtype << 24 | fixed_output << 23 | pad_bs``.

    Ranks that call different ops, pass a different ``pad_bs`` or logits dtype, or
    disagree on whether swaps run in CUDA-graph mode produce different signatures,
    which the kernels turn into an error on every rank instead of moving wrong data.
    """
    if not 0 < pad_bs <= MAX_SIG_PAD_BS:
        raise ValueError(f"pad_bs={pad_bs} out of signature range (1..{MAX_SIG_PAD_BS})")
    mode = SIG_FIXED_OUTPUT if fixed_output else 0
    return (OP_CODES[op] << 28) | (DTYPE_CODES[dtype] << 24) | mode | pad_bs


def unpack_signature(sig: int) -> tuple[str, str, int]:
    """``(op, dtype, pad_bs)`` of a signature (see :func:`signature_mode` for the
    mode bit)."""
    op = OP_NAMES.get((sig >> 28) & 0xF, f"op{(sig >> 28) & 0xF}")
    dtype = DTYPE_NAMES.get((sig >> 24) & 0xF, f"dtype{(sig >> 24) & 0xF}")
    return op, dtype, sig & MAX_SIG_PAD_BS


def signature_mode(sig: int) -> str:
    """``"graph"`` for a swap issued in CUDA-graph mode, else ``"eager"``."""
    return "graph" if sig & SIG_FIXED_OUTPUT else "eager"


@dataclass(frozen=True)
class ArenaLayout:
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

    # control block: u32 epoch, counter, broken at 0..12; u64 probe[tp] at 64
    ctrl_off = 0
    probe_off = 64

    @cached_property
    def flags_off(self) -> int:
        """``u64 flags[2][tp]``."""
        return _up(self.probe_off + 8 * self.tp)

    @cached_property
    def ll_slots(self) -> int:
        """Packets per source rank in one LL region: ``R_max * (2N + 1)``."""
        return self.r_max * (2 * self.num_tokens_per_req + 1)

    @cached_property
    def ll_region_bytes(self) -> int:
        return _up(self.tp * self.ll_slots * 8)

    @cached_property
    def ready_off(self) -> int:
        """``u64 ready[2][tp]``: the graph-mode swap's entry barrier words."""
        return self.flags_off + 2 * self.tp * 8

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
        captured in CUDA graphs. Peers push into it directly, after an entry barrier
        (``ready``) that proves this rank has consumed the previous output."""
        return self.swap_off + 2 * self.swap_region_bytes

    @cached_property
    def out_predict_off(self) -> int:
        return self.swap_off + 3 * self.swap_region_bytes

    @cached_property
    def _out_2d_bytes(self) -> int:
        return _up(self.max_pad_bs * self.num_tokens_per_req * 4)

    @cached_property
    def out_accept_index_off(self) -> int:
        return self.out_predict_off + self._out_2d_bytes

    @cached_property
    def out_accept_length_off(self) -> int:
        return self.out_accept_index_off + self._out_2d_bytes

    @cached_property
    def out_logprobs_off(self) -> int:
        return self.out_accept_length_off + _up(self.max_pad_bs * 4)

    @cached_property
    def total_bytes(self) -> int:
        return _up(self.out_logprobs_off + self._out_2d_bytes, 2 << 20)


class Arena:
    """One rank's arena: a dedicated ``cudaMalloc`` (never pooled memory: an IPC
    handle of pooled memory names the pool's base), zeroed, plus a host-mapped
    error block.

    Parameters
    ----------
    layout : ArenaLayout
    device : int
        CUDA ordinal (must be current).
    """

    def __init__(self, layout: ArenaLayout, device: int):
        from cupy.cuda import runtime

        self.layout = layout
        self.device = device
        self.nbytes = layout.total_bytes
        self.ptr = 0
        self.err_host = 0
        self.ptr = int(runtime.malloc(self.nbytes))
        try:
            runtime.memset(self.ptr, 0, self.nbytes)
            self.err_host = int(runtime.hostAlloc(ERROR_BLOCK_SIZE, runtime.hostAllocMapped))
            ctypes.memset(self.err_host, 0, ERROR_BLOCK_SIZE)
            runtime.deviceSynchronize()
        except BaseException:
            self.free()
            raise

    def ipc_handle(self) -> bytes:
        """The 64-byte ``cudaIpcMemHandle_t`` of the arena."""
        from cupy.cuda import runtime

        return bytes(runtime.ipcGetMemHandle(self.ptr))

    def read_error(self) -> tuple[int, int, int, int, int, int, int]:
        """The error block as written by the kernels (code 0: none)."""
        raw = ctypes.string_at(self.err_host, ERROR_BLOCK_SIZE)
        return struct.unpack(ERROR_BLOCK_FORMAT, raw)  # type: ignore[return-value]

    def error_code(self) -> int:
        """Fast check: the error code word (0 when no kernel reported an error)."""
        return ctypes.c_uint32.from_address(self.err_host).value

    def free(self) -> None:
        """Free the memory (call only after every peer closed its mapping)."""
        from cupy.cuda import runtime

        if self.err_host:
            runtime.freeHost(self.err_host)
            self.err_host = 0
        if self.ptr:
            runtime.free(self.ptr)
            self.ptr = 0


def upload_u64_table(values: list[int], device: int) -> Any:
    """A device ``uint64[len(values)]`` array holding ``values``, synchronised (a
    kernel on a non-blocking stream may read it right away)."""
    import cupy
    import numpy as np

    with cupy.cuda.Device(device):
        table = cupy.asarray(np.asarray(values, dtype=np.uint64))
        cupy.cuda.runtime.deviceSynchronize()
    return table

"""Launch geometry of the NCCL backend, as pure functions: kernel names, vector
widths, grids, gather widths, and which bytes go to which peer."""

from __future__ import annotations

from dataclasses import dataclass

from ...layout import real_reqs

__all__ = [
    "ARGMAX_KERNEL_NAMES",
    "ARGMAX_SOURCE",
    "BLOCK",
    "KERNEL_NAMES",
    "NAME_EXPRESSIONS",
    "PARTIAL_BYTES",
    "PERMUTE_TYPES",
    "SOURCE",
    "VERIFY_BLOCK",
    "VERIFY_KERNEL_NAMES",
    "VERIFY_SOURCE",
    "PermuteLaunch",
    "argmax_buffer_bytes",
    "argmax_slots",
    "linear_grid",
    "packed_width",
    "permute_launch",
    "permute_name",
    "swap_moves",
    "vector_width",
    "verify_moves",
]

SOURCE = "nccl.cu"
BLOCK = 256
_MAX_GRID = 65535

#: Vector type of ``nccl_permute<V>`` per width in bytes.
PERMUTE_TYPES = {16: "Vec16", 8: "u64", 4: "u32", 2: "u16", 1: "u8"}


def permute_name(width: int) -> str:
    """The name expression of the permute kernel moving ``width``-byte vectors,
    e.g. ``"nccl_permute<Vec16>"``."""
    return f"nccl_permute<{PERMUTE_TYPES[width]}>"


#: Template instantiations compiled through ``RawModule(name_expressions=...)``.
NAME_EXPRESSIONS = tuple(permute_name(w) for w in PERMUTE_TYPES)
#: Every kernel the backend loads from :data:`SOURCE`.
KERNEL_NAMES = (
    *NAME_EXPRESSIONS,
    "nccl_header",
    "nccl_finish",
    "nccl_verify_finish",
    "nccl_pack",
    "nccl_unpack",
)
#: The argmax kernels (kernels/argmax.cu, shared with other backends).
ARGMAX_SOURCE = "argmax.cu"
ARGMAX_KERNEL_NAMES = ("dp_argmax_partials", "dp_argmax_combine")
#: Bytes of one row's argmax partial: max bits, global index, sumexp bits (u32 each).
PARTIAL_BYTES = 12
#: The verify kernels (kernels/verify.cu, the device code shared with the one-sided
#: backend): records of the whole local input, the owner's combine.
VERIFY_SOURCE = "verify.cu"
VERIFY_KERNEL_NAMES = ("dp_verify_records", "dp_verify_records_nolist", "dp_verify_combine")
#: Threads per CTA of both verify kernels (``DV_BLOCK`` in verify.cuh: their shared
#: arrays hold at most that many).
VERIFY_BLOCK = 256


def packed_width(max_pad_bs: int, tp: int, n: int) -> int:
    """Words (int32) per rank in the gather buffers: ``4 + max_pad_bs/tp * (2N + 1)``.

    Both gathers use it regardless of ``pad_bs`` so that mismatched calls still move
    equal byte counts (NCCL completes and the headers report the mismatch)."""
    return 4 + max_pad_bs // tp * (2 * n + 1)


def vector_width(rowbytes: int, *addresses: int) -> int:
    """Widest of 16, 8, 4, 2, 1 bytes that divides ``rowbytes`` and every address."""
    for w in (16, 8, 4, 2):
        if rowbytes % w == 0 and all(a % w == 0 for a in addresses):
            return w
    return 1


@dataclass(frozen=True)
class PermuteLaunch:
    """Launch geometry of a permute kernel.

    Attributes
    ----------
    grid, block : int
    tps_log2 : int
        log2 of the threads that copy one (row, source) segment.
    """

    grid: int
    block: int
    tps_log2: int


def permute_launch(rows: int, tp: int, rowbytes: int, width: int) -> PermuteLaunch:
    """Geometry for ``rows * tp`` segments of ``rowbytes`` bytes in ``width``-byte vectors.

    Each segment gets the smallest power of two of threads covering its vectors (at
    most one block), so short rows share a block and long rows loop.

    Raises
    ------
    ValueError
        ``rowbytes`` is not a multiple of ``width``.
    """
    if rowbytes % width:
        raise ValueError(f"rowbytes={rowbytes} is not a multiple of width={width}")
    vecs = rowbytes // width
    tps_log2 = 0
    while (1 << tps_log2) < vecs and (1 << tps_log2) < BLOCK:
        tps_log2 += 1
    segs_per_block = BLOCK >> tps_log2
    segments = rows * tp
    grid = max(1, min(_MAX_GRID, -(-segments // segs_per_block)))
    return PermuteLaunch(grid, BLOCK, tps_log2)


def linear_grid(total: int) -> int:
    """Blocks of :data:`BLOCK` threads for a grid-stride loop over ``total`` items
    (at most 1024)."""
    return max(1, min(1024, -(-total // BLOCK)))


def swap_moves(
    tp: int, rank: int, reqs: int, n: int, rowbytes: int, bs: int | None, route_self: bool
) -> tuple[tuple[int, int, int, int, int], ...]:
    """The data steps of a swap (or of any op whose input rows are grouped by owner).

    Step ``k`` sends to ``dst = (rank + k) % tp`` the rows of ``dst``'s real
    requests (contiguous: input rows ``[dst*R*N, dst*R*N + real_reqs(R, bs, dst)*N)``)
    and receives from ``src = (rank - k) % tp`` the rows of this rank's real requests.

    Parameters
    ----------
    tp, rank : int
    reqs : int
        ``R = pad_bs / tp``.
    n : int
        ``N``.
    rowbytes : int
        Bytes of one input row.
    bs : int or None
        Host count of real requests; None moves every row (fixed counts: a device
        ``bs`` or ``bs=None``).
    route_self : bool
        Include step 0 (this rank to itself).

    Returns
    -------
    tuple of ``(dst, send_offset, send_bytes, src, recv_bytes)``
        Offsets in bytes from the input's base; the receive of ``src`` lands at
        ``src * R * N * rowbytes`` of the staging buffer.
    """
    chunk = reqs * n * rowbytes
    mine = real_reqs(reqs, bs, rank) * n * rowbytes
    out = []
    for k in range(0 if route_self else 1, tp):
        dst, src = (rank + k) % tp, (rank - k) % tp
        out.append((dst, dst * chunk, real_reqs(reqs, bs, dst) * n * rowbytes, src, mine))
    return tuple(out)


def argmax_buffer_bytes(tp: int, chunk_max: int) -> int:
    """Bytes of the argmax partials buffer that :func:`argmax_slots` lays out, for
    per-peer blocks of at most ``chunk_max`` bytes."""
    return 2 * tp * tp * chunk_max


def argmax_slots(tp: int, rank: int, chunk: int) -> tuple[int, int, int]:
    """Where the argmax partials live in one buffer: ``(send_offset, recv_offset,
    stride)`` in bytes.

    The partials kernel writes the send blocks ``[tp][chunk]`` (block ``p`` goes to
    rank ``p``) at ``send_offset``; the block received from rank ``s`` lands at
    ``recv_offset + s * stride``, which the combine kernel reads with one stride.
    The receive slot of this rank IS its own send block (no copy, no self send),
    and no other receive slot overlaps a send block or another receive slot:
    ``stride = tp * chunk`` keeps the receive slots on both sides of the send
    region. Everything fits in :func:`argmax_buffer_bytes`.
    """
    stride = tp * chunk
    send = (tp - 1) * (tp - 1) * chunk
    recv = send + rank * chunk - rank * stride
    return send, recv, stride


def verify_moves(tp: int, rank: int, chunk: int) -> tuple[tuple[int, int, int, int, int], ...]:
    """The data steps of ``verify_batch_vocab``: step ``k`` sends the records of
    ``dst = (rank + k) % tp``'s rows (block ``dst`` of the send buffer, ``chunk``
    bytes at ``dst * chunk``) and receives ``chunk`` bytes from ``src = (rank - k) %
    tp`` (into slot ``src`` of the receive buffer). This rank's own block never
    travels.

    Parameters
    ----------
    tp, rank : int
    chunk : int
        Bytes of one peer's block: ``R * N * record_words(cap) * 4``; the same for
        every pair and every ``bs`` (fixed counts).

    Returns
    -------
    tuple of ``(dst, send_offset, send_bytes, src, recv_bytes)``, as :func:`swap_moves`.
    """
    return tuple(
        ((rank + k) % tp, (rank + k) % tp * chunk, chunk, (rank - k) % tp, chunk)
        for k in range(1, tp)
    )

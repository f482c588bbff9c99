"""The host half of ``kernels/verify.cuh``: which batches the verify kernels decide, the
per-request parameter block they read, the record size and the call's digest.

The kernels decide greedy rows, temperature-only rows and top-k rows (``2..128``, with or
without top-p and min-p) exactly; a batch with a real request that has top-p or min-p
*without* top-k needs the row's whole key order (the sharded host algorithm's probe and
full-row rounds), so a GPU backend moves that batch's logits instead
(:func:`kernel_path_refusal` says why). Everything here is pure and tested on the CPU.
"""

from __future__ import annotations

import zlib

import numpy as np

from ..layout import SAMPLING_EPS, TOP_K_MAX, VerifyParams

__all__ = [
    "BROADCAST_MAX_ROWS",
    "DV_HDR",
    "DV_MAX_N",
    "DV_MAX_SOURCES",
    "DV_MERGE_MAX",
    "PARAM_FIELDS",
    "SPLIT_MIN_COLUMNS",
    "SPLIT_TARGET_UNITS",
    "VERIFY_BLOCK_FEW_ROWS",
    "VERIFY_BLOCK_MANY_ROWS",
    "call_digest",
    "device_list_cap",
    "kernel_path_refusal",
    "list_cap",
    "pack_params",
    "param_bytes",
    "param_offsets",
    "record_words",
    "verify_block",
    "verify_broadcast",
    "verify_splits",
]

#: Header words of a record (``kernels/verify.cuh``).
DV_HDR = 12
#: Entries the owner's merge holds in shared memory: ``tp * list_cap`` at most.
DV_MERGE_MAX = 8 * TOP_K_MAX
#: Rows per request the combine holds (``N``).
DV_MAX_N = 64
#: Records per row the combine holds (``DV_MAX_TP``): ``tp * splits`` at most.
DV_MAX_SOURCES = 64
#: A small batch's rows are split into column blocks, one CTA and one record each, until
#: the GPU has about this many blocks per call (:func:`verify_splits`; about two CTAs per
#: SM of an H100 or H200) ...
SPLIT_TARGET_UNITS = 256
#: ... of at least this many columns each.
SPLIT_MIN_COLUMNS = 2048
#: Threads of a one-sided record CTA (one row at a time) when the rows of the ranks on a
#: GPU fit in one wave of such CTAs: each row over more threads, a shorter row latency ...
VERIFY_BLOCK_FEW_ROWS = 256
#: ... and when they do not: more CTAs per SM (both measured on an H100: BENCHMARKS.md).
VERIFY_BLOCK_MANY_ROWS = 128
#: ``auto`` broadcasts the one-sided records (every rank combines every request: one
#: round, no gather) up to this many rows ``pad_bs * N`` (:func:`verify_broadcast`).
BROADCAST_MAX_ROWS = 64

#: The per-request arrays the kernels read (``struct DvParamPtrs``), in argument order.
PARAM_FIELDS = (
    ("temperature", np.dtype("<f4")),
    ("top_k", np.dtype("<i4")),
    ("top_p", np.dtype("<f4")),
    ("min_p", np.dtype("<f4")),
    ("seed", np.dtype("<i8")),
    ("offset", np.dtype("<i8")),
)


def _modes(params: VerifyParams) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """bool ``[bs]`` each: greedy, top-k (sampled), top-p/min-p without top-k (sampled)."""
    b = params.bs
    greedy = (params.temperature[:b] < SAMPLING_EPS) | (params.top_k[:b] == 1)
    top_k = ~greedy & (params.top_k[:b] >= 2)
    other = ~greedy & ~top_k & ((params.top_p[:b] < 1) | (params.min_p[:b] > 0))
    return greedy, top_k, other


def list_cap(params: VerifyParams) -> int:
    """The call's list capacity: the largest top-k of a sampled top-k request (0: none)."""
    _, top_k, _ = _modes(params)
    return int(params.top_k[: params.bs][top_k].max()) if top_k.any() else 0


def device_list_cap(top_k_given: bool) -> int:
    """The list capacity of a call whose parameters stay on the device: any request may
    have any top-k (128 when ``top_k`` is given, else 0)."""
    return TOP_K_MAX if top_k_given else 0


def record_words(cap: int) -> int:
    """u32 words of one record with list capacity ``cap``."""
    return DV_HDR + 2 * cap


def kernel_path_refusal(params: VerifyParams, tp: int) -> str | None:
    """Why the verify kernels cannot decide this call (None: they can)."""
    _, _, other = _modes(params)
    if other.any():
        i = int(np.flatnonzero(other)[0])
        return (
            f"request {i} has top_p={params.top_p[i]:g} / min_p={params.min_p[i]:g} without "
            "top-k, which needs the row's whole key order"
        )
    if params.num_tokens_per_req > DV_MAX_N:
        return f"N={params.num_tokens_per_req} > {DV_MAX_N} rows per request"
    cap = list_cap(params)
    if tp * cap > DV_MERGE_MAX:
        return f"tp={tp} x top_k={cap} > {DV_MERGE_MAX} merge entries"
    return None


def param_offsets(pad_bs: int) -> tuple[int, ...]:
    """Byte offsets of the six arrays in :func:`pack_params`' buffer (8-byte aligned)."""
    offs, at = [], 0
    for _, dt in PARAM_FIELDS:
        offs.append(at)
        at += -(-pad_bs * dt.itemsize // 8) * 8
    return tuple(offs)


def param_bytes(pad_bs: int) -> int:
    """Bytes of :func:`pack_params`' buffer for ``pad_bs`` requests."""
    return param_offsets(pad_bs)[-1] + pad_bs * PARAM_FIELDS[-1][1].itemsize


def pack_params(params: VerifyParams) -> np.ndarray:
    """The normalised parameters as one uint8 buffer: the six ``[pad_bs]`` arrays of
    :data:`PARAM_FIELDS` at :func:`param_offsets` (phantom requests neutral)."""
    pad = params.pad_bs
    offs = param_offsets(pad)
    out = np.zeros(param_bytes(pad), np.uint8)
    for (name, dt), off in zip(PARAM_FIELDS, offs, strict=True):
        out[off : off + pad * dt.itemsize] = np.asarray(getattr(params, name), dt).view(np.uint8)
    return out


def call_digest(
    vocab_limit: int,
    cap: int,
    return_logprobs: bool,
    n: int,
    splits: int = 1,
    broadcast: bool = False,
) -> int:
    """A 31-bit digest of the call-wide arguments every rank must pass alike
    (``vocab_limit``, the list capacity, ``return_logprobs``, ``N``, the record kernel's
    column blocks per row when more than one, and whether the records are broadcast).
    The kernels mix in each request's normalised parameters, every record carries the
    result and the combining rank compares: ranks that disagree raise."""
    words = [vocab_limit, cap, int(return_logprobs), n] + ([splits] if splits != 1 else [])
    if broadcast:
        words.append(-1)  # (no other word is negative)
    return zlib.crc32(np.array(words, np.int64).tobytes()) & 0x7FFFFFFF


def verify_broadcast(*, rows: int, tp: int, cap: int, region_words: int, mode: str) -> bool:
    """Whether a one-sided ``verify_batch_vocab`` call broadcasts its records.

    The default route sends each row's records to the row's owner, which combines its
    requests; a gather then gives every rank every result: two rounds between the ranks.
    Broadcast sends every record to every rank and each rank combines every request,
    writing the results in place: one round and one launch less, for ``tp`` times the
    record bytes and ``tp`` times the combine work (each rank's CTAs take requests in
    parallel). That pays for small batches, where a round costs more than the bytes.

    Parameters
    ----------
    rows : int
        ``pad_bs * N``.
    tp : int
        Ranks.
    cap : int
        The call's list capacity (:func:`list_cap`; 0 without top-k).
    region_words : int
        u32 words of one parity's verify region: broadcast needs ``tp * rows`` records.
    mode : str
        ``auto`` (broadcast up to :data:`BROADCAST_MAX_ROWS` rows), ``on`` (whenever the
        region holds them), ``off`` (never); ``IPC_DPSAMPLE_VERIFY_BROADCAST``.

    Returns
    -------
    bool
        Every rank computes the same from the same call and environment; the call digest
        carries it, so ranks whose environments disagree raise instead of combining
        records from the wrong places.
    """
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"mode={mode!r}; expected 'auto', 'on' or 'off'")
    if tp == 1 or mode == "off":
        return False
    fits = tp * rows * record_words(cap) <= region_words
    return fits and (mode == "on" or rows <= BROADCAST_MAX_ROWS)


def verify_block(*, rows: int, gpu_sharing: int, resident_ctas: int) -> int:
    """Threads per CTA of the one-sided record kernel for a call of ``rows`` rows.

    Parameters
    ----------
    rows : int
        ``pad_bs * N``, the rows of the padded batch on each rank.
    gpu_sharing : int
        The most ranks of the group on one GPU.
    resident_ctas : int
        :data:`VERIFY_BLOCK_FEW_ROWS`-thread CTAs of the kernel that fit on the GPU at once.

    Returns
    -------
    int
        :data:`VERIFY_BLOCK_FEW_ROWS` when the rows of every rank on the GPU fit in one wave
        of such CTAs, else :data:`VERIFY_BLOCK_MANY_ROWS`. It depends only on the call's
        shape and the group's layout, so every rank picks the same (the records do not
        depend on it: every block size computes the same bits).
    """
    if rows * max(1, gpu_sharing) <= max(1, resident_ctas):
        return VERIFY_BLOCK_FEW_ROWS
    return VERIFY_BLOCK_MANY_ROWS


def verify_splits(
    *,
    rows: int,
    tp: int,
    vocab_shard: int,
    cap: int,
    region_words: int,
    gpu_sharing: int = 1,
    want: int = 0,
) -> int:
    """Column blocks per row of the one-sided record kernel (``dp_verify_push``): each
    block is one CTA's work and one record, and the owners combine ``tp * splits``
    records per row exactly as ``tp`` (a block is a finer shard). A small batch gets
    several, so that its rows' latency spreads over more SMs: about
    :data:`SPLIT_TARGET_UNITS` blocks per GPU of at least :data:`SPLIT_MIN_COLUMNS`
    columns, within what the owners hold (:data:`DV_MAX_SOURCES` records per row,
    :data:`DV_MERGE_MAX` list entries, ``region_words`` u32 of records per parity).
    It depends only on the call's shape and the group's layout on its GPUs, so every
    rank computes the same (and the call digest carries it).

    Parameters
    ----------
    rows : int
        ``pad_bs * N``, the rows of the padded batch (a captured call may replay any
        ``bs``).
    tp, vocab_shard : int
        Ranks, and columns of a shard (``V / tp``).
    cap : int
        The call's list capacity (:func:`list_cap`; 0 without top-k).
    region_words : int
        u32 words of one parity's verify region.
    gpu_sharing : int
        The most ranks of the group on one GPU (ranks sharing a GPU share its SMs).
    want : int
        0: the rule above. Else this many (``IPC_DPSAMPLE_VERIFY_SPLITS``, a tuning
        knob), within what the owners hold and at most one block per column.

    Returns
    -------
    int
        Column blocks per row, at least 1.
    """
    if want > 0:
        s = min(want, max(1, vocab_shard))
    else:
        s = max(1, SPLIT_TARGET_UNITS // max(1, gpu_sharing) // max(1, rows))
        s = min(s, max(1, vocab_shard // SPLIT_MIN_COLUMNS))
    s = min(s, max(1, DV_MAX_SOURCES // tp))
    if cap:
        s = min(s, max(1, DV_MERGE_MAX // (tp * cap)))
    s = min(s, max(1, region_words // (max(1, rows) * record_words(cap))))
    return max(1, s)

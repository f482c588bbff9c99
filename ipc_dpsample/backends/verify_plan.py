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
    "DV_HDR",
    "DV_MAX_N",
    "DV_MERGE_MAX",
    "PARAM_FIELDS",
    "call_digest",
    "device_list_cap",
    "kernel_path_refusal",
    "list_cap",
    "pack_params",
    "param_bytes",
    "param_offsets",
    "record_words",
]

#: Header words of a record (``kernels/verify.cuh``).
DV_HDR = 12
#: Entries the owner's merge holds in shared memory: ``tp * list_cap`` at most.
DV_MERGE_MAX = 8 * TOP_K_MAX
#: Rows per request the combine holds (``N``).
DV_MAX_N = 64

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


def call_digest(vocab_limit: int, cap: int, return_logprobs: bool, n: int) -> int:
    """A 31-bit digest of the call-wide arguments every rank must pass alike
    (``vocab_limit``, the list capacity, ``return_logprobs``, ``N``). The kernels mix
    in each request's normalised parameters, every record carries the result and the
    row's owner compares: ranks that disagree raise."""
    head = np.array([vocab_limit, cap, int(return_logprobs), n], np.int64)
    return zlib.crc32(head.tobytes()) & 0x7FFFFFFF

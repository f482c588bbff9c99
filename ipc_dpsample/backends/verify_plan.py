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
    "PARAMS_DTYPE",
    "kernel_path_refusal",
    "list_cap",
    "pack_params",
    "params_digest",
    "record_words",
]

#: Header words of a record (``kernels/verify.cuh``).
DV_HDR = 12
#: Entries the owner's merge holds in shared memory: ``tp * list_cap`` at most.
DV_MERGE_MAX = 8 * TOP_K_MAX
#: Rows per request the combine holds (``N``).
DV_MAX_N = 64

#: ``struct DvParams``: one request's parameters as the kernels read them.
PARAMS_DTYPE = np.dtype(
    [
        ("temperature", "<f4"),
        ("top_k", "<i4"),
        ("top_p", "<f4"),
        ("min_p", "<f4"),
        ("seed", "<i8"),
        ("offset", "<i8"),
    ]
)
assert PARAMS_DTYPE.itemsize == 32


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


def pack_params(params: VerifyParams) -> np.ndarray:
    """``DvParams [pad_bs]`` of the normalised parameters (phantom requests neutral)."""
    out = np.zeros(params.pad_bs, PARAMS_DTYPE)
    out["temperature"] = params.temperature
    out["top_k"] = params.top_k
    out["top_p"] = params.top_p
    out["min_p"] = params.min_p
    out["seed"] = params.seed
    out["offset"] = params.offset
    return out


def params_digest(params: VerifyParams, packed: np.ndarray, cap: int, return_logprobs: bool) -> int:
    """A 31-bit digest of what every rank must pass alike: the real requests' packed
    parameters, ``vocab_limit``, ``bs``, the list capacity and ``return_logprobs``. Every
    record carries it and the owner compares (ranks that disagree raise)."""
    head = np.array(
        [params.vocab_limit, params.bs, cap, int(return_logprobs), params.num_tokens_per_req],
        np.int64,
    )
    crc = zlib.crc32(head.tobytes())
    crc = zlib.crc32(packed[: params.bs].tobytes(), crc)
    return crc & 0x7FFFFFFF

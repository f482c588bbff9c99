"""Shape math and the NumPy reference of the three collectives: the executable spec.

Layout contract
---------------
* ``swap_batch_vocab``: rank ``s`` gives ``x_s[pad_bs * N, V / tp]`` (the whole padded
  batch, its own vocabulary shard). Rank ``r`` gets ``y_r[pad_bs / tp * N, V]`` where
  row ``local_req * N + d`` is global request ``r * R + local_req`` (``R = pad_bs / tp``)
  at draft position ``d`` and columns ``[s * V/tp, (s + 1) * V/tp)`` came from rank
  ``s``: ``y_r[i, s*Vs:(s+1)*Vs] = x_s[r*R*N + i, :]``.
* gathers: rank ``src`` gives ``a_src[R, ...]``; every rank gets ``[pad_bs, ...]``
  whose row ``src * R + i`` is row ``i`` of rank ``src``.
* ``argmax_batch_vocab``: the input of a swap; rank ``r`` gets, for each row of
  its swap output, the index of the first maximal element of the full row trimmed
  to ``vocab_limit`` (``torch.argmax`` semantics: a NaN wins, first NaN first) and
  its log-softmax value over those columns in float32.
* real rows (``bs``): the real requests are the prefix ``[0, bs)`` of the padded
  batch. Rank ``r`` owns :meth:`Layout.real_reqs` of them (a prefix of its
  ``R``); swap and argmax outputs are defined on the rows of those requests
  (``real_reqs * N`` leading rows), gathered outputs on their ``bs`` leading rows.
  Every other row is undefined (the one-sided backend leaves it untouched).

The swap and gather references move bits only, so they work for any NumPy dtype
(bfloat16 is carried as its ``uint16`` bit pattern); the argmax reference decodes
values (:func:`as_float32`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "MASS_GROUPS",
    "MASS_GROUP_BINADES",
    "MASS_MANTISSA_BITS",
    "MAX_VOCAB",
    "SAMPLING_EPS",
    "TOP_K_DISABLED",
    "TOP_K_MAX",
    "TRITON_UNIFORM_SCALE",
    "UNIFORM_MIN",
    "Layout",
    "VerifyParams",
    "accept_chain",
    "as_float32",
    "check_candidates",
    "check_logits",
    "det_exp2_frac",
    "det_log",
    "finish_verify",
    "group_mass",
    "gumbel_noise",
    "log_softmax_at",
    "mass_terms",
    "min_p_log",
    "noise_stream_key",
    "philox4x32_10",
    "prefix_masses",
    "real_reqs",
    "reference_argmax_batch_vocab",
    "reference_gather",
    "reference_gather_verify_logprobs",
    "reference_gather_verify_outputs",
    "reference_swap_batch_vocab",
    "reference_verify_batch_vocab",
    "reference_verify_rows",
    "sample_full_rows",
    "top_p_threshold",
    "torch_argmax",
    "uniform_from_uint32",
    "verify_params",
    "verify_vocab_limit",
]


@dataclass(frozen=True)
class Layout:
    """Shapes of one communicator's operations.

    Parameters
    ----------
    tp : int
        Number of ranks.
    max_pad_bs : int
        Largest padded batch size; a multiple of ``tp``.
    num_tokens_per_req : int
        ``N``, rows per request (draft tokens + 1).
    vocab_size : int
        ``V``, padded communication vocabulary; a multiple of ``tp``.
    """

    tp: int
    max_pad_bs: int
    num_tokens_per_req: int
    vocab_size: int

    @property
    def vocab_shard(self) -> int:
        """``V / tp``: columns each rank holds before the swap."""
        return self.vocab_size // self.tp

    @property
    def max_reqs_per_rank(self) -> int:
        """``max_pad_bs / tp``."""
        return self.max_pad_bs // self.tp

    def reqs_per_rank(self, pad_bs: int) -> int:
        """``R = pad_bs / tp``: requests owned by each rank."""
        return pad_bs // self.tp

    def swap_input_shape(self, pad_bs: int) -> tuple[int, int]:
        """``(pad_bs * N, V / tp)``."""
        return (pad_bs * self.num_tokens_per_req, self.vocab_shard)

    def swap_output_shape(self, pad_bs: int) -> tuple[int, int]:
        """``(pad_bs / tp * N, V)``."""
        return (pad_bs // self.tp * self.num_tokens_per_req, self.vocab_size)

    def verify_local_shape(self, pad_bs: int) -> tuple[int, int]:
        """``(pad_bs / tp, N)``: ``predict``, ``accept_index`` and ``logprobs`` per rank."""
        return (pad_bs // self.tp, self.num_tokens_per_req)

    def verify_gathered_shape(self, pad_bs: int) -> tuple[int, int]:
        """``(pad_bs, N)``."""
        return (pad_bs, self.num_tokens_per_req)

    def swap_bytes_per_rank(self, pad_bs: int, itemsize: int, bs: int | None = None) -> int:
        """Bytes one rank sends in a swap (its input rows of real requests, own rows
        included; every row when ``bs`` is None)."""
        reqs = pad_bs if bs is None else min(max(bs, 0), pad_bs)
        return reqs * self.num_tokens_per_req * self.vocab_shard * itemsize

    def real_reqs(self, pad_bs: int, bs: int | None, rank: int) -> int:
        """Real requests among rank ``rank``'s ``R`` (see :func:`real_reqs`)."""
        return real_reqs(pad_bs // self.tp, bs, rank)


def real_reqs(reqs_per_rank: int, bs: int | None, rank: int) -> int:
    """How many of rank ``rank``'s requests ``[rank*R, (rank+1)*R)`` are real when the
    real ones are the prefix ``[0, bs)``: ``clamp(bs - rank*R, 0, R)`` (``R`` when
    ``bs`` is None)."""
    if bs is None:
        return reqs_per_rank
    return max(0, min(reqs_per_rank, bs - rank * reqs_per_rank))


def reference_swap_batch_vocab(
    inputs: Sequence[np.ndarray], *, tp: int, num_tokens_per_req: int, pad_bs: int
) -> list[np.ndarray]:
    """NumPy reference of ``swap_batch_vocab``.

    Parameters
    ----------
    inputs : sequence of tp arrays ``[pad_bs * N, V / tp]``, any dtype
        ``inputs[s]`` is rank ``s``'s ``local_logits``.
    tp, num_tokens_per_req, pad_bs : int

    Returns
    -------
    list of tp arrays ``[pad_bs / tp * N, V]``, same dtype
        Element ``r`` is what rank ``r`` must receive.
    """
    if len(inputs) != tp:
        raise ValueError(f"got {len(inputs)} inputs, expected tp={tp}")
    n = num_tokens_per_req
    rows_per_rank = pad_bs // tp * n
    shard = inputs[0].shape[1]
    for s, x in enumerate(inputs):
        if x.shape != (pad_bs * n, shard):
            raise ValueError(f"inputs[{s}] shape {x.shape} != expected {(pad_bs * n, shard)}")
    # [src, dst, rows, shard] -> [dst, rows, src, shard]
    stacked = np.stack(inputs).reshape(tp, tp, rows_per_rank, shard)
    out = stacked.transpose(1, 2, 0, 3).reshape(tp, rows_per_rank, tp * shard)
    return [np.ascontiguousarray(out[r]) for r in range(tp)]


def reference_gather(locals_: Sequence[np.ndarray]) -> np.ndarray:
    """NumPy reference of an all-gather along dimension 0: row ``src * R + i`` of the
    result is row ``i`` of ``locals_[src]``."""
    first = locals_[0]
    for src, a in enumerate(locals_):
        if a.shape != first.shape or a.dtype != first.dtype:
            raise ValueError(
                f"locals_[{src}] is {a.shape} {a.dtype}, expected {first.shape} {first.dtype}"
            )
    return np.concatenate(list(locals_), axis=0)


def reference_gather_verify_outputs(
    predict: Sequence[np.ndarray],
    accept_index: Sequence[np.ndarray],
    accept_length: Sequence[np.ndarray],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """NumPy reference of ``gather_verify_outputs``.

    Parameters
    ----------
    predict, accept_index : sequences of tp int32 arrays ``[R, N]``
    accept_length : sequence of tp int32 arrays ``[R]``

    Returns
    -------
    (predict ``[pad_bs, N]``, accept_index ``[pad_bs, N]``, accept_length ``[pad_bs]``), int32
    """
    return (
        reference_gather(predict),
        reference_gather(accept_index),
        reference_gather(accept_length),
    )


def reference_gather_verify_logprobs(logprobs: Sequence[np.ndarray]) -> np.ndarray:
    """NumPy reference of ``gather_verify_logprobs``: tp float32 ``[R, N]`` ->
    float32 ``[pad_bs, N]``."""
    return reference_gather(logprobs)


def as_float32(x: np.ndarray, dtype: str) -> np.ndarray:
    """Values of ``x`` as float32: ``dtype`` ``"bfloat16"`` reads ``x`` as the uint16
    bit patterns of bfloat16 values; ``"float16"``/``"float32"`` convert."""
    if dtype == "bfloat16":
        bits = np.asarray(x).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32)
    if dtype in ("float16", "float32"):
        return np.asarray(x).astype(np.float32)
    raise ValueError(f"dtype={dtype!r}; expected bfloat16, float16 or float32")


def _argmax_row_stats(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``torch.argmax`` and ``torch.log_softmax(...)[argmax]`` of each float32 row."""
    nan = np.isnan(rows)
    any_nan = nan.any(axis=1)
    idx = np.where(any_nan, nan.argmax(axis=1), np.argmax(np.where(nan, -np.inf, rows), axis=1))
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        x = rows.astype(np.float64)
        m = x.max(axis=1)
        finite_max = np.isfinite(m)
        shifted = np.where(finite_max[:, None], x - np.where(finite_max, m, 0)[:, None], np.nan)
        # (x - max) - log(sum exp(x - max)), as torch.log_softmax orders it: forming
        # max + log(sum) first would lose log(sum) next to a max of 1e38
        log_sum = np.log(np.exp(shifted).sum(axis=1))
        chosen = x[np.arange(len(x)), idx]
        lp = np.where(
            finite_max & ~any_nan, (chosen - np.where(finite_max, m, 0)) - log_sum, np.nan
        )
    return idx.astype(np.int32), lp.astype(np.float32)


def reference_argmax_batch_vocab(
    inputs: Sequence[np.ndarray],
    *,
    tp: int,
    num_tokens_per_req: int,
    pad_bs: int,
    dtype: str,
    vocab_limit: int | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """NumPy reference of ``argmax_batch_vocab``.

    Parameters
    ----------
    inputs : sequence of tp arrays ``[pad_bs * N, V / tp]``
        ``inputs[s]`` is rank ``s``'s ``local_logits`` (bfloat16 as uint16 bits).
    tp, num_tokens_per_req, pad_bs : int
    dtype : {"bfloat16", "float16", "float32"}
    vocab_limit : int or None
        Columns ``>= vocab_limit`` of the full row never count (None: ``V``).

    Returns
    -------
    list of tp pairs (token_ids int32 ``[R*N]``, logprobs float32 ``[R*N]``)
        Element ``r`` is what rank ``r`` must receive: for swap-output row ``i`` of
        rank ``r``, the first index of the row's maximum (a NaN wins, like
        ``torch.argmax``; an all ``-inf`` row gives 0) and
        ``torch.log_softmax(row.float())[index]`` (NaN when the row holds a NaN or
        ``+inf`` or only ``-inf``).
    """
    full = reference_swap_batch_vocab(
        inputs, tp=tp, num_tokens_per_req=num_tokens_per_req, pad_bs=pad_bs
    )
    v = full[0].shape[1]
    limit = v if vocab_limit is None else vocab_limit
    if not 1 <= limit <= v:
        raise ValueError(f"vocab_limit={vocab_limit}; expected 1 <= vocab_limit <= V={v}")
    return [_argmax_row_stats(as_float32(y, dtype)[:, :limit]) for y in full]


# ======================================================================================
# Sampled verify (``verify_batch_vocab``): the noise, the filters, the reference
# ======================================================================================
#
# Everything below is the executable spec of one sampled speculative-verify step that
# TokenSpeed's Batch-DP route computes as swap -> sample -> verify -> gather. The
# contract in words is ``docs/verify_contract.md``; the sharded algorithm that computes
# the same bits from per-shard records is :mod:`ipc_dpsample.verify_shards`.
#
# Every float operation that decides a token is an IEEE-754 basic operation (+, -, *, /
# in float32 or float64, rounded to nearest even, no fused multiply-add) or an integer
# operation, so NumPy, torch on the CPU and CUDA kernels (``__fdiv_rn``, ``__dmul_rn``,
# ``__dadd_rn``... or ``-fmad=false``) reproduce it bit for bit. The two transcendental
# functions the decisions need, a logarithm (the Gumbel noise, min-p) and ``2**f`` (the
# fixed-point masses of top-p), are therefore *defined* here as fixed polynomials
# (:func:`det_log`, :func:`det_exp2_frac`) instead of being left to each libm.

SAMPLING_EPS = np.float32(1e-6)
"""Temperatures ``< SAMPLING_EPS`` (float32 compare) mean greedy: TokenSpeed's
``_SAMPLING_EPS``, below which its ``SamplingParams`` rewrites a request to top-k 1."""
TOP_K_MAX = 128
"""Largest top-k the sharded algorithm carries (a shard sends its top-k list)."""
TOP_K_DISABLED = 1 << 30
"""TokenSpeed's ``_TOP_K_DISABLED`` sentinel; any ``top_k >= vocab_limit`` is also off."""
UNIFORM_MIN = np.float32(1e-7)
"""Lower clamp of the uniform before the Gumbel transform, as TokenSpeed's kernels."""
TRITON_UNIFORM_SCALE = np.float32(4.6566127342e-10)
"""Triton's ``uint_to_uniform_float`` scale for 32-bit words (as float32)."""
MASS_MANTISSA_BITS = 24
"""Bits of the fixed-point mantissa of one token's probability mass (top-p)."""
MASS_GROUP_BINADES = 8
"""Binades per exponent group of the fixed-point masses (a group spans 8 ln 2 nats)."""
MASS_GROUPS = 7
"""Exponent groups below the row's top group that can still hold mass (older ones add 0)."""
MAX_VOCAB = 1 << 21
"""Largest ``vocab_limit`` for which the fixed-point group sums cannot overflow 2**53."""

_U32 = np.uint64(0xFFFFFFFF)
_PHILOX32 = (0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85)  # M0, M1, W0, W1


def philox4x32_10(
    counter: Sequence[np.ndarray | int], key: Sequence[np.ndarray | int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Philox4x32-10 (Salmon et al. 2011, Random123's ``philox4x32``), vectorised.

    Parameters
    ----------
    counter : four arrays or ints, broadcastable, values in ``[0, 2**32)``
        The 128-bit counter ``(c0, c1, c2, c3)``.
    key : two arrays or ints, broadcastable with ``counter``, values in ``[0, 2**32)``
        The 64-bit key ``(k0, k1)``.

    Returns
    -------
    four uint32 arrays of the broadcast shape
        The output block ``(x0, x1, x2, x3)``. Triton's ``tl.randint(seed, offset)`` is
        ``x0`` for counter ``(offset & 0xffffffff, offset >> 32, 0, 0)`` (the high word
        0 for 32-bit offsets) and key ``(seed & 0xffffffff, seed >> 32)``.
    """
    m0, m1, w0, w1 = (np.uint64(v) for v in _PHILOX32)
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & _U32 for c in counter)
    k0, k1 = (np.asarray(k, dtype=np.uint64) & _U32 for k in key)
    c0, c1, c2, c3, k0, k1 = np.broadcast_arrays(c0, c1, c2, c3, k0, k1)
    for _ in range(10):
        p0 = m0 * c0  # 32 x 32 -> 64 bits: exact in uint64
        p1 = m1 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & _U32, (p0 >> 32) ^ c3 ^ k1, p0 & _U32
        k0 = (k0 + w0) & _U32
        k1 = (k1 + w1) & _U32
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))  # type: ignore[return-value]


def noise_stream_key(seed: np.ndarray, position_offset: np.ndarray) -> np.ndarray:
    """The per-row key of the Gumbel noise: Triton's ``tl.randint(seed, offset + d)``.

    Triton's ``randint`` runs Philox4x32-10 whatever the width of its arguments: an
    int64 offset is split into the counter words ``(low 32 bits, high 32 bits)`` and
    the int64 seed into the key ``(low 32 bits, high 32 bits)``; the result is word 0,
    a 32-bit value (Triton 3.x ``randint4x``; checked against Triton on a GPU by
    ``tests/test_triton_parity_gpu.py``).

    Parameters
    ----------
    seed : int64 array
        The request's seed (read as its two's-complement bits).
    position_offset : int64 array, same shape
        ``offset[req] + d`` for draft position ``d`` (int64 wrap-around).

    Returns
    -------
    uint64 array
        ``philox4x32_10((off & 0xffffffff, off >> 32, 0, 0),
        (seed & 0xffffffff, seed >> 32))[0]``, a value below ``2**32``: the uniforms'
        Philox key is then ``(key, 0)`` (:func:`gumbel_noise`), as Triton's
        ``tl.rand(key, id)`` reads its 32-bit seed.
    """
    seed = np.asarray(seed, dtype=np.int64).view(np.uint64)
    off = np.asarray(position_offset, dtype=np.int64).view(np.uint64)
    hi = np.uint64(32)
    return philox4x32_10((off & _U32, off >> hi, 0, 0), (seed & _U32, seed >> hi))[0].astype(
        np.uint64
    )


def uniform_from_uint32(x: np.ndarray) -> np.ndarray:
    """Triton's ``uint_to_uniform_float`` of 32-bit words, then TokenSpeed's clamp.

    ``x`` is read as int32, negative values map to ``-x - 1`` (``~x``), the int32 is
    rounded to float32 and multiplied by :data:`TRITON_UNIFORM_SCALE` in float32
    (both round to nearest even), then clamped below at :data:`UNIFORM_MIN`.

    Parameters
    ----------
    x : uint32 array

    Returns
    -------
    float32 array in ``[1e-7, 1)``
    """
    i = np.asarray(x, dtype=np.uint32).view(np.int32)
    i = np.where(i < 0, ~i, i)
    u = i.astype(np.float32) * TRITON_UNIFORM_SCALE
    return np.maximum(u, UNIFORM_MIN)


# ln 2, sqrt(1/2) and the series coefficients as exact doubles (hex: what a kernel copies)
_LN2 = float.fromhex("0x1.62e42fefa39efp-1")
_SQRT_HALF = float.fromhex("0x1.6a09e667f3bcdp-1")
_LOG2E = float.fromhex("0x1.71547652b82fep+0")
# log(m) = s * (2 + 2/3 s^2 + 2/5 s^4 + ... + 2/23 s^22), s = (m - 1) / (m + 1)
_LOG_SERIES = tuple(2.0 / (2 * k + 1) for k in range(12))
# 2**f = sum_{n <= 17} (f ln 2)^n / n!
_EXP_SERIES = tuple(1.0 / float(np.prod(np.arange(1, n + 1, dtype=np.float64))) for n in range(18))


def det_log(x: np.ndarray) -> np.ndarray:
    """Natural logarithm of positive finite float64 values, *defined* by a fixed sequence
    of IEEE double operations so that every backend computes the same bits.

    ``x = m * 2**e`` (``frexp``, then ``m`` doubled and ``e`` decremented while
    ``m < sqrt(1/2)``), ``s = (m - 1) / (m + 1)``, ``P`` the Horner evaluation of
    ``sum_k 2/(2k+1) s2**k`` (``k = 11 .. 0``, ``s2 = s*s``), and the result
    ``e*ln2 + s*P``, every step rounded to nearest double, no fused multiply-add.
    Accuracy: within 2 ulp of the true logarithm (tested against ``np.log``).

    Parameters
    ----------
    x : float64 array, positive and finite (normal numbers)

    Returns
    -------
    float64 array
    """
    m, e = np.frexp(np.asarray(x, dtype=np.float64))
    small = m < _SQRT_HALF
    m = np.where(small, m * 2.0, m)
    ef = (e - small).astype(np.float64)
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    p = np.full_like(s, _LOG_SERIES[-1])
    for c in _LOG_SERIES[-2::-1]:
        p = p * s2 + c
    return ef * _LN2 + s * p


def det_exp2_frac(f: np.ndarray) -> np.ndarray:
    """``2**f`` for float64 ``f`` in ``[0, 1)``, defined as the Horner evaluation of the
    degree-17 Taylor series of ``exp(t)`` at ``t = f*ln2`` (coefficients the doubles
    nearest ``1/n!``), IEEE double operations without fused multiply-add.

    Parameters
    ----------
    f : float64 array in ``[0, 1)``

    Returns
    -------
    float64 array in ``[1, 2]``
    """
    t = np.asarray(f, dtype=np.float64) * _LN2
    p = np.full_like(t, _EXP_SERIES[-1])
    for c in _EXP_SERIES[-2::-1]:
        p = p * t + c
    return p


def gumbel_noise(stream_key: np.ndarray, token_ids: np.ndarray) -> np.ndarray:
    """The Gumbel noise of tokens: ``g = float32(-log(-log(u)))`` in float64
    (:func:`det_log`), ``u = uniform_from_uint32(philox4x32_10((id, 0, 0, 0),
    (key & 0xffffffff, key >> 32))[0])``: TokenSpeed's ``tl.rand(gumbel_seed, id)``.

    Parameters
    ----------
    stream_key : uint64 array, broadcastable against ``token_ids``
        :func:`noise_stream_key` of the row.
    token_ids : int array
        Global token ids (columns of the full vocabulary), ``>= 0``.

    Returns
    -------
    float32 array of the broadcast shape
    """
    key = np.asarray(stream_key, dtype=np.uint64)
    ids = np.asarray(token_ids).astype(np.uint64)
    x0 = philox4x32_10((ids, 0, 0, 0), (key & _U32, key >> np.uint64(32)))[0]
    u = uniform_from_uint32(x0).astype(np.float64)
    return (-det_log(-det_log(u))).astype(np.float32)


def mass_terms(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The fixed-point probability mass of tokens with scaled logits ``z``.

    ``exp(z)`` is written ``a * 2**(8*grp - 24)`` with an integer ``a`` in
    ``[2**24, 2**33)`` and an integer *exponent group* ``grp``: ``t = z * log2(e)``
    (float64), ``k = floor(t)``, ``q = floor(det_exp2_frac(t - k) * 2**24)``,
    ``grp = floor(k / 8)``, ``a = q << (k - 8*grp)``. The decomposition depends on
    ``z`` alone (no row maximum), so sums per group add exactly and associatively across
    any split of the vocabulary; :func:`group_mass` turns them into one integer.

    Parameters
    ----------
    z : float32 array
        Scaled logits (``logit / temperature``); ``-inf`` has no mass.

    Returns
    -------
    grp : float64 array, same shape
        The group (an integer value; ``-inf`` where ``z`` is ``-inf``). float64 holds
        the group of any finite float32 ``z`` exactly.
    a : int64 array, same shape
        The mantissa in units of ``2**(8*grp - 24)`` (0 where ``z`` is ``-inf``).
    """
    z = np.asarray(z, dtype=np.float32)
    finite = np.isfinite(z)
    with np.errstate(invalid="ignore", over="ignore"):
        t = np.where(finite, z.astype(np.float64) * _LOG2E, 0.0)
        k = np.floor(t)
        q = np.floor(det_exp2_frac(t - k) * float(1 << MASS_MANTISSA_BITS))
        grp = np.floor(k / MASS_GROUP_BINADES)
        r = k - MASS_GROUP_BINADES * grp  # 0..7, exact
        a = (q * np.exp2(r)).astype(np.int64)
    return np.where(finite, grp, -np.inf), np.where(finite, a, 0)


def group_mass(group_sums: np.ndarray) -> np.ndarray:
    """One integer mass from per-group sums: ``sum_d sums[..., d] >> (8*d)``.

    Parameters
    ----------
    group_sums : int64 array ``[..., MASS_GROUPS]``
        Element ``d`` is the exact sum of :func:`mass_terms` ``a`` over the tokens of
        exponent group ``G - d``, ``G`` the group of the row's largest scaled logit.

    Returns
    -------
    int64 array ``[...]``
        The mass in units of ``2**(8*G - 24)`` (each group truncated to that unit).
    """
    shifts = (MASS_GROUP_BINADES * np.arange(MASS_GROUPS)).astype(np.int64)
    return (np.asarray(group_sums, dtype=np.int64) >> shifts).sum(axis=-1)


def top_p_threshold(top_p: np.ndarray, total: np.ndarray) -> np.ndarray:
    """``ceil(top_p * total)`` exactly (``top_p`` float32, ``total`` int64 masses): a token
    is in the nucleus iff the mass strictly before it is ``< top_p * total``, i.e.
    ``< ceil(top_p * total)``.

    Parameters
    ----------
    top_p : float32 array ``[rows]``
    total : int64 array ``[rows]``

    Returns
    -------
    int64 array ``[rows]``
    """
    out = np.empty(len(total), dtype=np.int64)
    for i, (p, w) in enumerate(zip(np.asarray(top_p, np.float32), np.asarray(total), strict=True)):
        num, den = float(p).as_integer_ratio()
        out[i] = -((-num * int(w)) // den)
    return out


def min_p_log(min_p: np.ndarray) -> np.ndarray:
    """``float32(det_log(min_p))`` for ``min_p`` in ``(0, 1)``: a token is kept iff
    ``z >= float32(z_max + min_p_log)`` (float32 add), TokenSpeed's
    ``vals >= row_max + log(min_p)``."""
    mp = np.asarray(min_p, dtype=np.float32)
    safe = np.where(mp > 0, mp, np.float32(1)).astype(np.float64)
    return np.where(mp > 0, det_log(safe).astype(np.float32), np.float32(0))


def torch_argmax(rows: np.ndarray) -> np.ndarray:
    """``torch.argmax`` of each float32 row: the first NaN if any, else the first maximum
    (an all ``-inf`` row gives 0). int64 ``[rows]``."""
    nan = np.isnan(rows)
    any_nan = nan.any(axis=1)
    return np.where(any_nan, nan.argmax(axis=1), np.argmax(np.where(nan, -np.inf, rows), axis=1))


def log_softmax_at(rows: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``float32(log_softmax(row)[idx])`` computed in float64 from float32 rows, as
    ``(x - max) - log(sum(exp(x - max)))`` (torch's order); NaN where the row holds a NaN,
    a ``+inf``, or only ``-inf``. Accuracy: the float64 value is within a few ulp of
    double of the exact one, so the float32 result is the correctly rounded float32
    except in rare rounding-boundary cases (then 1 ulp off)."""
    nan_row = np.isnan(rows).any(axis=1)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        x = rows.astype(np.float64)
        m = np.where(nan_row, np.nan, np.max(np.where(np.isnan(x), -np.inf, x), axis=1))
        ok = np.isfinite(m)
        safe_m = np.where(ok, m, 0.0)
        log_sum = np.log(np.exp(x - safe_m[:, None]).sum(axis=1))
        chosen = x[np.arange(len(x)), idx]
        lp = np.where(ok, (chosen - safe_m) - log_sum, np.nan)
    return lp.astype(np.float32)


_DTYPE_STORAGE = {
    "bfloat16": np.dtype(np.uint16),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
}


def _param_array(name: str, value: object, dtype: type, shape: tuple[int, ...]) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype != np.dtype(dtype):
        raise TypeError(f"{name} dtype {arr.dtype} != expected {np.dtype(dtype)}")
    if arr.shape != shape:
        raise ValueError(f"{name} shape {arr.shape} != expected {shape}")
    return arr


@dataclass(frozen=True)
class VerifyParams:
    """The validated per-request parameters of one ``verify_batch_vocab`` call, and their
    per-row expansion (row ``req * N + d``). Build with :func:`verify_params`.

    Attributes
    ----------
    pad_bs, num_tokens_per_req, vocab_limit, bs : int
        ``bs`` real requests (a prefix); rows of the others are not computed.
    temperature : float32 ``[pad_bs]``
    top_k : int64 ``[pad_bs]``
        Normalised: 0 = off, else ``1..TOP_K_MAX``.
    top_p : float32 ``[pad_bs]``
        1 = off.
    min_p : float32 ``[pad_bs]``
        0 = off.
    seed, offset : int64 ``[pad_bs]``
    """

    pad_bs: int
    num_tokens_per_req: int
    vocab_limit: int
    bs: int
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    seed: np.ndarray
    offset: np.ndarray

    @property
    def rows(self) -> int:
        """``pad_bs * N``."""
        return self.pad_bs * self.num_tokens_per_req

    @property
    def real_rows(self) -> int:
        """``bs * N``: the leading rows that are computed."""
        return self.bs * self.num_tokens_per_req

    def per_row(self, a: np.ndarray) -> np.ndarray:
        """A per-request array repeated for the ``N`` rows of each request."""
        return np.repeat(a, self.num_tokens_per_req)

    @property
    def greedy_rows(self) -> np.ndarray:
        """bool ``[rows]``: temperature below :data:`SAMPLING_EPS`, or top-k 1."""
        return self.per_row((self.temperature < SAMPLING_EPS) | (self.top_k == 1))

    @property
    def stream_keys(self) -> np.ndarray:
        """uint64 ``[rows]``: :func:`noise_stream_key` of ``(seed, offset + d)``."""
        d = np.tile(np.arange(self.num_tokens_per_req, dtype=np.int64), self.pad_bs)
        with np.errstate(over="ignore"):
            off = self.per_row(self.offset) + d  # int64 wrap-around, as Triton's add
        return noise_stream_key(self.per_row(self.seed), off)


def verify_vocab_limit(vocab_limit: int | None, vocab_size: int) -> int:
    """``verify_batch_vocab``'s ``vocab_limit`` (None: ``vocab_size``), checked:
    ``1 <= vocab_limit <= min(vocab_size, MAX_VOCAB)``, else ``ValueError``."""
    limit = vocab_size if vocab_limit is None else int(vocab_limit)
    if not 1 <= limit <= vocab_size:
        raise ValueError(f"vocab_limit={vocab_limit}; expected 1 <= vocab_limit <= V={vocab_size}")
    if limit > MAX_VOCAB:
        raise ValueError(
            f"vocab_limit={limit} exceeds {MAX_VOCAB}, the largest vocabulary whose "
            "fixed-point masses fit in 53 bits"
        )
    return limit


def verify_params(
    *,
    pad_bs: int,
    num_tokens_per_req: int,
    vocab_size: int,
    temperature: np.ndarray,
    seed: np.ndarray,
    offset: np.ndarray,
    top_k: np.ndarray | None = None,
    top_p: np.ndarray | None = None,
    min_p: np.ndarray | None = None,
    vocab_limit: int | None = None,
    bs: int | None = None,
) -> VerifyParams:
    """Validate and normalise the per-request sampling parameters of ``verify_batch_vocab``.

    Parameters
    ----------
    pad_bs, num_tokens_per_req, vocab_size : int
        The padded batch, ``N`` and the padded vocabulary ``V``.
    temperature : float32 ``[pad_bs]``
        Finite, ``>= 0``; ``< SAMPLING_EPS`` means greedy.
    seed, offset : int64 ``[pad_bs]``
        The noise stream of each request (draft position ``d`` uses ``offset + d``).
    top_k : int32 ``[pad_bs]`` or None
        0, :data:`TOP_K_DISABLED` or any value ``>= vocab_limit`` = off; ``1..128``
        = on; anything else raises. None = off for every request.
    top_p : float32 ``[pad_bs]`` or None
        In ``(0, 1]``, 1 = off.
    min_p : float32 ``[pad_bs]`` or None
        In ``[0, 1)``, 0 = off.
    vocab_limit : int or None
        Columns ``>= vocab_limit`` never win and never count (None: ``V``);
        ``1 <= vocab_limit <= min(V, MAX_VOCAB)``.
    bs : int or None
        Real requests, the prefix ``[0, bs)`` (None: ``pad_bs``). Parameter values
        are checked on real requests only.

    Returns
    -------
    VerifyParams

    Raises
    ------
    TypeError
        A parameter of the wrong dtype (the message names the expected one).
    ValueError
        A wrong shape or a value out of range (the message names the allowed range).
    """
    shape = (pad_bs,)
    limit = verify_vocab_limit(vocab_limit, vocab_size)
    nreal = pad_bs if bs is None else int(bs)
    if not 0 <= nreal <= pad_bs:
        raise ValueError(f"bs={bs}; expected 0 <= bs <= pad_bs={pad_bs}")
    real = slice(0, nreal)
    temp = _param_array("temperature", temperature, np.float32, shape)
    bad = ~(np.isfinite(temp[real]) & (temp[real] >= 0))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"temperature[{i}]={temp[i]}; expected a finite value >= 0 (0 = greedy)")
    seed_a = _param_array("seed", seed, np.int64, shape)
    offset_a = _param_array("offset", offset, np.int64, shape)
    if top_k is None:
        k = np.zeros(shape, np.int64)
    else:
        raw = _param_array("top_k", top_k, np.int32, shape).astype(np.int64)
        off = (raw == 0) | (raw >= limit)
        bad = ~off & ~((raw >= 1) & (raw <= TOP_K_MAX))
        bad[nreal:] = False
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"top_k[{i}]={raw[i]}; expected 1..{TOP_K_MAX}, or 0 / >= vocab_limit="
                f"{limit} (incl. {TOP_K_DISABLED}) for off"
            )
        k = np.where(off, 0, raw)
    if top_p is None:
        p = np.ones(shape, np.float32)
    else:
        p = _param_array("top_p", top_p, np.float32, shape)
        bad = ~((p[real] > 0) & (p[real] <= 1))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"top_p[{i}]={p[i]}; expected 0 < top_p <= 1 (1 = off)")
    if min_p is None:
        mp = np.zeros(shape, np.float32)
    else:
        mp = _param_array("min_p", min_p, np.float32, shape)
        bad = ~((mp[real] >= 0) & (mp[real] < 1))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"min_p[{i}]={mp[i]}; expected 0 <= min_p < 1 (0 = off)")
    # phantom requests: neutral values, so nothing below can trip over garbage
    k = k.copy()
    k[nreal:] = 0
    p = p.copy()
    p[nreal:] = 1
    mp = mp.copy()
    mp[nreal:] = 0
    temp = temp.copy()
    temp[nreal:] = 0
    return VerifyParams(
        pad_bs=pad_bs,
        num_tokens_per_req=num_tokens_per_req,
        vocab_limit=limit,
        bs=nreal,
        temperature=temp,
        top_k=k,
        top_p=p,
        min_p=mp,
        seed=seed_a,
        offset=offset_a,
    )


_SAMPLE_CHUNK_ELEMS = 1 << 21  # rows are sampled in chunks of about this many elements


def sample_full_rows(
    x: np.ndarray,
    *,
    temperature: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
    min_p: np.ndarray,
    greedy: np.ndarray,
    stream_key: np.ndarray,
) -> np.ndarray:
    """The token each full row samples: the contract of ``verify_batch_vocab`` per row.

    * **Degenerate or greedy rows** (``greedy``, a NaN, or ``z_max =
      float32(max / temperature)`` not finite: a ``+inf``, only ``-inf``, overflow) give
      :func:`torch_argmax` of the row: the first NaN, else the first maximum.
    * **Sampled rows**: ``z = float32(x / temperature)``, ``score = float32(z + g)``
      with ``g`` = :func:`gumbel_noise` of (row's stream key, column). The *key order*
      of the columns is (raw logit descending, column ascending). Kept columns:
      top-k = the first ``k`` in key order; top-p = those whose exclusive prefix mass in
      key order (within the top-k set when top-k is on), by :func:`mass_terms` and
      :func:`group_mass`, is ``< top_p * W`` with ``W`` the mass of that set;
      min-p = ``z >= float32(z_max + min_p_log(min_p))``. The filters intersect (each
      is computed on the top-k set, not on the others' survivors); the first column in
      key order always survives. The token is the kept column of largest score, the
      lowest column on ties.

    Parameters
    ----------
    x : float32 ``[rows, vocab_limit]``
        Raw logits (the columns a row may pick).
    temperature, top_p, min_p : float32 ``[rows]``
    top_k : int ``[rows]``
        0 = off, else ``1..TOP_K_MAX``.
    greedy : bool ``[rows]``
    stream_key : uint64 ``[rows]``
        :func:`noise_stream_key` of each row.

    Returns
    -------
    int32 ``[rows]``
    """
    x = np.asarray(x, dtype=np.float32)
    v = x.shape[1]
    tok = torch_argmax(x)
    has_nan = np.isnan(x).any(axis=1)
    temp = np.where(greedy, np.float32(1), temperature).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        xmax = np.max(np.where(np.isnan(x), np.float32(-np.inf), x), axis=1)
        zmax = xmax / temp
    sampled = np.flatnonzero(~greedy & ~has_nan & np.isfinite(zmax))
    step = max(1, _SAMPLE_CHUNK_ELEMS // max(v, 1))
    ids = np.arange(v)
    for lo in range(0, len(sampled), step):
        idx = sampled[lo : lo + step]
        xs = x[idx]
        with np.errstate(over="ignore", invalid="ignore"):
            z = xs / temp[idx, None]
        score = z + gumbel_noise(stream_key[idx, None], ids[None, :])
        k = top_k[idx]
        kept = np.ones(xs.shape, dtype=bool)
        p = top_p[idx]
        for kv in np.unique(k[k > 0]):  # top-k: the first k columns in key order
            rows = np.flatnonzero(k == kv)
            cols = _first_k_in_key_order(xs[rows], int(kv))  # [rows, k], key order
            in_top_k = np.zeros((len(rows), v), dtype=bool)
            np.put_along_axis(in_top_k, cols, True, axis=1)
            kept[rows] = in_top_k
            p_rows = np.flatnonzero(p[rows] < 1)
            if len(p_rows):  # top-p within the top-k set: its columns in key order
                r = rows[p_rows]
                zs = np.take_along_axis(z[r], cols[p_rows], axis=1)
                before = prefix_masses(zs, np.ones(zs.shape, dtype=bool))
                thr = top_p_threshold(p[r], before[:, -1])
                out = before[:, :-1] >= thr[:, None]  # outside the nucleus
                kept[np.repeat(r, out.sum(axis=1)), cols[p_rows][out]] = False
        p_rows = np.flatnonzero((p < 1) & (k == 0))
        if len(p_rows):  # top-p over the whole row: every column in key order
            order = np.argsort(-xs[p_rows], axis=1, kind="stable")
            zs = np.take_along_axis(z[p_rows], order, axis=1)
            before = prefix_masses(zs, np.ones(zs.shape, dtype=bool))
            thr = top_p_threshold(p[p_rows], before[:, -1])
            keep = np.empty(zs.shape, dtype=bool)
            np.put_along_axis(keep, order, before[:, :-1] < thr[:, None], axis=1)
            kept[p_rows] &= keep
        mp = min_p[idx]
        m_rows = np.flatnonzero(mp > 0)
        if len(m_rows):
            thr_z = zmax[idx][m_rows] + min_p_log(mp[m_rows])
            kept[m_rows] &= z[m_rows] >= thr_z[:, None]
        tok[idx] = np.argmax(np.where(kept, score, np.float32(-np.inf)), axis=1)
    return tok.astype(np.int32)


def _first_k_in_key_order(xs: np.ndarray, k: int) -> np.ndarray:
    """int ``[rows, k]``: the first ``k`` columns of each float32 row (no NaN) in key
    order (value descending, column ascending; ``-0.0 == +0.0``), without sorting the
    row: the k-th value by partition, every larger column, the lowest columns among
    those equal to it, then those ``k`` sorted."""
    kth = -np.partition(-xs, k - 1, axis=1)[:, k - 1]
    gt = xs > kth[:, None]
    eq = xs == kth[:, None]
    need = k - gt.sum(axis=1)
    take = gt | (eq & (np.cumsum(eq, axis=1) <= need[:, None]))
    cols = np.nonzero(take)[1].reshape(len(xs), k)  # ascending column per row
    vals = np.take_along_axis(xs, cols, axis=1)
    order = np.lexsort((cols, -vals), axis=1)  # value descending, then column
    return np.take_along_axis(cols, order, axis=1)


def prefix_masses(z_sorted: np.ndarray, in_set: np.ndarray) -> np.ndarray:
    """Exclusive prefix masses of rows sorted in key order, plus the total.

    Parameters
    ----------
    z_sorted : float32 ``[rows, n]``
        Scaled logits in key order; column 0 is the row's maximum.
    in_set : bool ``[rows, n]``
        The columns that count (the top-k set).

    Returns
    -------
    int64 ``[rows, n + 1]``
        Column ``j`` is the mass of the set's columns before ``j``; column ``n`` the
        set's mass ``W``.
    """
    grp, a = mass_terms(z_sorted)
    top = grp[:, :1]
    rows, n = z_sorted.shape
    out = np.zeros((rows, n + 1), dtype=np.int64)
    part = np.zeros((rows, n + 1), dtype=np.int64)
    with np.errstate(invalid="ignore"):
        d = top - grp
    for g in range(MASS_GROUPS):  # sum_g (exact group prefix sum) >> 8g, as group_mass
        np.cumsum(np.where(in_set & (d == g), a, 0), axis=1, out=part[:, 1:])
        out += part >> (MASS_GROUP_BINADES * g)
    return out


def accept_chain(
    candidates: np.ndarray, sampled: np.ndarray, reqs_per_rank: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ "Sample, then match": TokenSpeed's ``verify_chain_target_sampled`` on every request,
    numbered as its Batch-DP route numbers ``accept_index``.

    Parameters
    ----------
    candidates : int32 ``[pad_bs, N]``
        Column 0 the last accepted token, ``1..`` the drafts.
    sampled : int32 ``[pad_bs, N]``
        The token each row sampled.
    reqs_per_rank : int
        ``R = pad_bs / tp``: ``accept_index`` counts rows of the owning rank.

    Returns
    -------
    predict : int32 ``[pad_bs, N]``
        ``sampled`` (TokenSpeed defines positions ``<= accepted``; the positions after
        them hold the sampled tokens too).
    accept_index : int32 ``[pad_bs, N]``
        ``(g % R) * N + j`` for the accepted positions ``j <= accepted`` of request ``g``
        (position 0 always), -1 after them.
    accept_length : int32 ``[pad_bs]``
        Accepted drafts + 1.
    """
    pad_bs, n = candidates.shape
    match = candidates[:, 1:] == sampled[:, :-1]
    accepted = np.cumprod(match, axis=1).sum(axis=1) if n > 1 else np.zeros(pad_bs, np.int64)
    j = np.arange(n)
    base = (np.arange(pad_bs) % reqs_per_rank) * n
    accept_index = np.where(j[None, :] <= accepted[:, None], base[:, None] + j[None, :], -1)
    return (
        sampled.astype(np.int32, copy=True),
        accept_index.astype(np.int32),
        (accepted + 1).astype(np.int32),
    )


def check_candidates(candidates: np.ndarray, pad_bs: int) -> int:
    """Check ``candidates`` is int32 ``[pad_bs, N]`` (``N >= 1``) and return ``N``; raise
    ``TypeError`` / ``ValueError`` naming the expected dtype / shape otherwise."""
    c = np.asarray(candidates)
    if c.dtype != np.int32:
        raise TypeError(f"candidates dtype {c.dtype} != expected int32")
    if c.ndim != 2 or c.shape[0] != pad_bs or c.shape[1] < 1:
        raise ValueError(f"candidates shape {c.shape} != expected (pad_bs={pad_bs}, N >= 1)")
    return int(c.shape[1])


def check_logits(name: str, x: np.ndarray, dtype: str, shape: tuple[int, int]) -> None:
    """Check logits ``x`` are stored as ``dtype`` says (bfloat16: uint16 bits, float16,
    float32) with ``shape``; raise ``TypeError`` / ``ValueError`` naming the expectation."""
    if dtype not in _DTYPE_STORAGE:
        raise ValueError(f"dtype={dtype!r}; expected bfloat16, float16 or float32")
    want = _DTYPE_STORAGE[dtype]
    if np.asarray(x).dtype != want:
        raise TypeError(
            f"{name} dtype {np.asarray(x).dtype} != expected {want} for dtype={dtype!r}"
            + (" (bfloat16 travels as its uint16 bits)" if dtype == "bfloat16" else "")
        )
    if x.shape != shape:
        raise ValueError(f"{name} shape {x.shape} != expected {shape}")


def reference_verify_rows(
    logits: np.ndarray,
    candidates: np.ndarray,
    *,
    tp: int,
    dtype: str,
    temperature: np.ndarray,
    seed: np.ndarray,
    offset: np.ndarray,
    top_k: np.ndarray | None = None,
    top_p: np.ndarray | None = None,
    min_p: np.ndarray | None = None,
    vocab_limit: int | None = None,
    bs: int | None = None,
    return_logprobs: bool = False,
) -> tuple[np.ndarray, ...]:
    """NumPy reference of ``verify_batch_vocab`` on full rows.

    Parameters
    ----------
    logits : ``[pad_bs * N, V]``, bfloat16 (uint16 bits), float16 or float32
        Row ``req * N + d`` is request ``req`` at draft position ``d`` (the rows of
        ``swap_batch_vocab``'s input, with every shard's columns side by side).
    candidates : int32 ``[pad_bs, N]``
    tp : int
        Ranks; only numbers ``accept_index`` (rows of the owning rank, ``R = pad_bs/tp``).
    dtype : {"bfloat16", "float16", "float32"}
    temperature, seed, offset, top_k, top_p, min_p, vocab_limit, bs
        See :func:`verify_params`.
    return_logprobs : bool
        Also return ``float32(log_softmax(raw logits[:vocab_limit])[predict])``.

    Returns
    -------
    predict : int32 ``[pad_bs, N]``
    accept_index : int32 ``[pad_bs, N]``
    accept_length : int32 ``[pad_bs]``
    logprobs : float32 ``[pad_bs, N]``, only with ``return_logprobs``
        See :func:`accept_chain` and :func:`sample_full_rows`. Requests ``>= bs`` are
        undefined (a backend may leave them untouched); the reference writes
        ``predict = 0``, ``accept_index = -1``, ``accept_length = 0`` and NaN
        logprobs there.
    """
    pad_bs = int(np.asarray(candidates).shape[0]) if np.asarray(candidates).ndim == 2 else -1
    n = check_candidates(candidates, pad_bs)
    if tp < 1 or pad_bs % tp:
        raise ValueError(f"pad_bs={pad_bs} must be a positive multiple of tp={tp}")
    v = int(np.asarray(logits).shape[1]) if np.asarray(logits).ndim == 2 else -1
    check_logits("logits", logits, dtype, (pad_bs * n, v))
    params = verify_params(
        pad_bs=pad_bs,
        num_tokens_per_req=n,
        vocab_size=v,
        temperature=temperature,
        seed=seed,
        offset=offset,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        vocab_limit=vocab_limit,
        bs=bs,
    )
    real = params.real_rows
    x = as_float32(np.asarray(logits)[:real, : params.vocab_limit], dtype)
    per = params.per_row
    tok = sample_full_rows(
        x,
        temperature=per(params.temperature)[:real],
        top_k=per(params.top_k)[:real],
        top_p=per(params.top_p)[:real],
        min_p=per(params.min_p)[:real],
        greedy=params.greedy_rows[:real],
        stream_key=params.stream_keys[:real],
    )
    return finish_verify(
        candidates, tok, params, tp, log_softmax_at(x, tok) if return_logprobs else None
    )


def finish_verify(
    candidates: np.ndarray,
    tokens: np.ndarray,
    params: VerifyParams,
    tp: int,
    logprobs: np.ndarray | None,
) -> tuple[np.ndarray, ...]:
    """The outputs of ``verify_batch_vocab`` from the sampled tokens of the real rows.

    Parameters
    ----------
    candidates : int32 ``[pad_bs, N]``
    tokens : int32 ``[bs * N]``
    params : VerifyParams
    tp : int
    logprobs : float32 ``[bs * N]`` or None

    Returns
    -------
    (predict, accept_index, accept_length[, logprobs]) as :func:`reference_verify_rows`
    """
    bs, n = params.bs, params.num_tokens_per_req
    sampled = np.zeros((params.pad_bs, n), np.int32)
    sampled[:bs] = np.asarray(tokens, dtype=np.int32).reshape(bs, n)
    predict, accept_index, accept_length = accept_chain(
        np.asarray(candidates), sampled, params.pad_bs // tp
    )
    predict[bs:] = 0
    accept_index[bs:] = -1
    accept_length[bs:] = 0
    if logprobs is None:
        return predict, accept_index, accept_length
    lp = np.full((params.pad_bs, n), np.nan, np.float32)
    lp[:bs] = np.asarray(logprobs, np.float32).reshape(bs, n)
    return predict, accept_index, accept_length, lp


def reference_verify_batch_vocab(
    inputs: Sequence[np.ndarray],
    candidates: np.ndarray,
    *,
    tp: int,
    pad_bs: int,
    dtype: str,
    temperature: np.ndarray,
    seed: np.ndarray,
    offset: np.ndarray,
    top_k: np.ndarray | None = None,
    top_p: np.ndarray | None = None,
    min_p: np.ndarray | None = None,
    vocab_limit: int | None = None,
    bs: int | None = None,
    return_logprobs: bool = False,
) -> tuple[np.ndarray, ...]:
    """NumPy reference of ``verify_batch_vocab`` from the ranks' vocabulary shards.

    Parameters
    ----------
    inputs : sequence of tp arrays ``[pad_bs * N, V / tp]``
        ``inputs[s]`` is rank ``s``'s ``local_logits`` (columns ``[s*V/tp, (s+1)*V/tp)``
        of the full rows; bfloat16 as uint16 bits), as ``swap_batch_vocab`` takes them.
    candidates : int32 ``[pad_bs, N]``
    tp, pad_bs : int
    dtype, temperature, seed, offset, top_k, top_p, min_p, vocab_limit, bs, return_logprobs
        See :func:`reference_verify_rows`.

    Returns
    -------
    What every rank gets, as :func:`reference_verify_rows`: ``predict``,
    ``accept_index`` (rows of the owning rank: ``(g % (pad_bs/tp)) * N + j``),
    ``accept_length`` (and ``logprobs``).
    """
    if len(inputs) != tp:
        raise ValueError(f"got {len(inputs)} inputs, expected tp={tp}")
    n = check_candidates(candidates, pad_bs)
    shard = int(np.asarray(inputs[0]).shape[1]) if np.asarray(inputs[0]).ndim == 2 else -1
    for s, x in enumerate(inputs):
        check_logits(f"inputs[{s}]", np.asarray(x), dtype, (pad_bs * n, shard))
    return reference_verify_rows(
        np.concatenate([np.asarray(x) for x in inputs], axis=1),
        candidates,
        tp=tp,
        dtype=dtype,
        temperature=temperature,
        seed=seed,
        offset=offset,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        vocab_limit=vocab_limit,
        bs=bs,
        return_logprobs=return_logprobs,
    )

"""The package's full-row sampler in torch: ``layout.sample_full_rows`` and
``layout.accept_chain`` bit for bit, on any device.

What it is for: TokenSpeed's Batch-DP route "``swap_batch_vocab``, then sample the rank's
full rows, then ``gather_verify_outputs``" with exactly the semantics of
``verify_batch_vocab`` (``docs/verify_contract.md``), so that route and the fused op give
the same tokens; and a device-side sampler for the torch backend (no host copies).

API::

    params = row_params(temperature=..., seed=..., offset=..., num_tokens_per_req=N,
                        vocab_limit=V)                      # per request -> per row
    tokens = sample_rows(rows, **params._asdict())          # int32 [rows]
    predict, accept_index, accept_length = verify_rows(rows, candidates, temperature=...,
                                                       seed=..., offset=...)

How the bits come out equal to the NumPy reference (the contract's "float definitions"):

* **Float steps are separate eager ops**, each an IEEE basic operation rounded to nearest:
  no ``addcmul`` / ``addcdiv`` / ``torch.lerp`` / ``torch.compile`` (any of them may fuse
  a multiply and an add into one rounding), no division by a Python scalar (CUDA turns
  ``t / c`` into ``t * (1/c)``; ``floor(k / 8)`` is written ``floor(k * 0.125)``, exact).
  torch's vectorised ``add``/``sub`` are ``fma(other, alpha, self)`` with ``alpha = 1``,
  which is the correctly rounded sum. float32 steps (``logit / T``, ``z + g``, the
  uniform's scale and clamp, min-p's ``z_max + log``) take float32 tensor operands, never
  Python floats, so no step runs in another precision.
* **Transcendentals** only through the layout's polynomial definitions (:func:`_det_log`,
  :func:`_det_exp2_frac`, the same coefficients): ``torch.log``/``torch.exp`` decide no
  token (they only appear in the optional logprobs).
* **Integers**: Philox4x32-10 runs on int64 tensors holding 32-bit words in
  ``[0, 2**32)``: a 32x32 -> 64 product is split by 16-bit halves of the constant (each
  partial product < 2**48), every value non-negative and below 2**63, so no signed
  overflow and no sign-dependent shift happens; int64 inputs (seeds, offsets) are read
  as their two's-complement bits by ``& 0xffffffff`` and ``>> 32`` (arithmetic shift,
  then mask); the stream key is a 32-bit word. ``offset + d`` is added in 32-bit words
  (int64 wrap-around).
* **Orders**: the key order (logit descending, id ascending, ``-0.0 == +0.0``) is one
  tie-free int64 per column (the float's bits made monotone, times ``2**32``, plus
  ``2**32 - 1 - id``), so ``torch.topk`` / ``torch.sort`` give the reference's stable
  order exactly; every "first maximum" / "first NaN" is an explicit ``amin`` over ids, not
  a reliance on ``argmax``'s tie rule.
* **Top-p** compares exact integers: fixed-point group masses (int64 cumsums) against
  ``ceil(top_p * W)``, computed exactly from the float32's mantissa and exponent in 48-bit
  limbs (:func:`_ceil_times`).

Host synchronisation: :func:`sample_rows` with ``plan=None`` makes one (it copies a
``[rows]`` int8 class code to the host, to sample each row only on the path it needs).
With a :class:`SamplePlan` it makes none (every enabled path runs on every row, the
results are selected per row with ``torch.where``), so it can be captured in a CUDA
graph. :func:`row_params` with ``check=True`` makes one (value validation); with
``check=False`` none. Memory: rows are processed in chunks of about ``chunk_elems``
elements (``2**21``: about 16 MiB per float64/int64 temporary).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .layout import (
    _EXP_SERIES,
    _LN2,
    _LOG2E,
    _LOG_SERIES,
    _PHILOX32,
    _SQRT_HALF,
    MASS_GROUP_BINADES,
    MASS_GROUPS,
    MASS_MANTISSA_BITS,
    SAMPLING_EPS,
    TOP_K_DISABLED,
    TOP_K_MAX,
    TRITON_UNIFORM_SCALE,
    UNIFORM_MIN,
    verify_vocab_limit,
)

__all__ = [
    "RowParams",
    "SamplePlan",
    "accept_chain",
    "gumbel_noise",
    "log_softmax_at",
    "noise_stream_key",
    "plan_rows",
    "row_params",
    "sample_rows",
    "verify_rows",
]

_M32 = 0xFFFFFFFF
CHUNK_ELEMS = 1 << 21
"""Default elements per chunk of rows (the reference's ``_SAMPLE_CHUNK_ELEMS``)."""
_LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INT_DTYPES = (torch.int32, torch.int64)


# -- Philox in int64 limbs --------------------------------------------------------------
def _mul32(x: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of ``x * m``: ``x`` int64 in ``[0, 2**32)``, ``m < 2**32``.
    ``m`` is split in 16-bit halves, so every partial product is below ``2**48``."""
    a = x * (m & 0xFFFF)
    b = x * (m >> 16)
    t = a + ((b & 0xFFFF) << 16)  # x*m = t + (b >> 16) * 2**32, t < 2**49
    return (b >> 16) + (t >> 32), t & _M32


def _mulhi32(x: torch.Tensor, m: int) -> torch.Tensor:
    """The high 32 bits of ``x * m`` (:func:`_mul32` without the low word)."""
    a = x * (m & 0xFFFF)
    b = x * (m >> 16)
    return (b >> 16) + ((a + ((b & 0xFFFF) << 16)) >> 32)


def _philox4x32_word0(
    c0: torch.Tensor, k0: torch.Tensor, k1: torch.Tensor, c1: torch.Tensor | None = None
) -> torch.Tensor:
    """Word 0 of Philox4x32-10 for counter ``(c0, c1, 0, 0)`` (``c1`` 0 when None) and
    key ``(k0, k1)``: int64 tensors of 32-bit values, broadcastable. The zero words start
    as ``[1, ..]`` tensors, so the first two rounds run on the broadcast shapes only
    where the values differ."""
    m0, m1, w0, w1 = _PHILOX32
    c2 = c3 = torch.zeros((1,) * c0.dim(), dtype=torch.int64, device=c0.device)
    if c1 is None:
        c1 = c2
    for _ in range(9):
        hi0, lo0 = _mul32(c0, m0)
        hi1, lo1 = _mul32(c2, m1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + w0) & _M32
        k1 = (k1 + w1) & _M32
    return _mulhi32(c2, m1) ^ c1 ^ k0  # round 10: only word 0 is needed


def _split64(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int64 tensor as its two's-complement bits' (high, low) 32-bit words."""
    return (v >> 32) & _M32, v & _M32


def noise_stream_key(seed: torch.Tensor, position_offset: torch.Tensor) -> torch.Tensor:
    """Triton's ``tl.randint(seed, offset + d)``, as :func:`ipc_dpsample.layout.noise_stream_key`.

    Parameters
    ----------
    seed, position_offset : int64 tensors, same shape
        The request's seed and ``offset + d`` (read as their bits).

    Returns
    -------
    int64 tensor, same shape
        ``philox4x32_10((off & 0xffffffff, off >> 32, 0, 0), (seed & 0xffffffff,
        seed >> 32))[0]``, in ``[0, 2**32)``.
    """
    off_hi, off_lo = _split64(position_offset)
    seed_hi, seed_lo = _split64(seed)
    return _philox4x32_word0(off_lo, seed_lo, seed_hi, off_hi)


# -- the float definitions (layout.det_log, layout.det_exp2_frac) ------------------------
def _det_log(x: torch.Tensor) -> torch.Tensor:
    """:func:`ipc_dpsample.layout.det_log` on a float64 tensor (positive normal values):
    the same operations in the same order, one eager op each (no fused multiply-add)."""
    m, e = torch.frexp(x)
    small = m < _SQRT_HALF
    m = torch.where(small, m * 2.0, m)
    ef = (e - small.to(e.dtype)).to(torch.float64)
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    p = torch.full_like(s, _LOG_SERIES[-1])
    for c in _LOG_SERIES[-2::-1]:
        p = p * s2
        p = p + c
    return ef * _LN2 + s * p


def _det_exp2_frac(f: torch.Tensor) -> torch.Tensor:
    """:func:`ipc_dpsample.layout.det_exp2_frac` on a float64 tensor in ``[0, 1)``."""
    t = f * _LN2
    p = torch.full_like(t, _EXP_SERIES[-1])
    for c in _EXP_SERIES[-2::-1]:
        p = p * t
        p = p + c
    return p


def _f32(value: float, device: torch.device) -> torch.Tensor:
    """A float32 0-d tensor, so that a float32 op takes a float32 operand."""
    return torch.tensor(float(value), dtype=torch.float32, device=device)


def gumbel_noise(stream_key: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """The Gumbel noise of tokens, :func:`ipc_dpsample.layout.gumbel_noise` bit for bit.

    Parameters
    ----------
    stream_key : int64 tensor, broadcastable against ``token_ids`` (e.g. ``[rows, 1]``)
        :func:`noise_stream_key` of the row.
    token_ids : int tensor (e.g. ``[1, V]`` or ``[rows, k]``)
        Global token ids, ``0 <= id < 2**32``.

    Returns
    -------
    float32 tensor of the broadcast shape
    """
    key = stream_key.to(torch.int64)
    x = _philox4x32_word0(token_ids.to(torch.int64), key & _M32, (key >> 32) & _M32)
    i = torch.where(x >= 1 << 31, x ^ _M32, x)  # int32(x), and ~i when negative: < 2**31
    dev = x.device
    u = i.to(torch.float32) * _f32(TRITON_UNIFORM_SCALE, dev)  # float32 multiply
    u = torch.maximum(u, _f32(UNIFORM_MIN, dev))
    return (-_det_log(-_det_log(u.to(torch.float64)))).to(torch.float32)


# -- top-p masses and threshold (layout.mass_terms, prefix_masses, top_p_threshold) -----
def _mass_terms(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ipc_dpsample.layout.mass_terms`: (group float64, mantissa int64) of float32 z."""
    finite = torch.isfinite(z)
    t = torch.where(finite, z.to(torch.float64) * _LOG2E, 0.0)
    k = torch.floor(t)
    q = torch.floor(_det_exp2_frac(t - k) * float(1 << MASS_MANTISSA_BITS))
    grp = torch.floor(k * (1.0 / MASS_GROUP_BINADES))  # = floor(k / 8), exact
    r = k - grp * float(MASS_GROUP_BINADES)  # 0..7, exact
    a = q.to(torch.int64) << r.to(torch.int64)  # = q * 2**r, q < 2**26
    return torch.where(finite, grp, float("-inf")), torch.where(finite, a, 0)


def _prefix_masses(
    z_sorted: torch.Tensor, in_set: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ipc_dpsample.layout.prefix_masses`, split: the exclusive prefix masses
    int64 ``[rows, n]`` and the set's mass ``W`` int64 ``[rows]`` (``in_set`` None: all)."""
    grp, a = _mass_terms(z_sorted)
    d = grp[:, :1] - grp
    before = torch.zeros_like(a)
    total = torch.zeros_like(a[:, 0])
    for g in range(MASS_GROUPS):  # sum_g (exact group prefix sum) >> 8g, as the reference
        mask = d == g
        if in_set is not None:
            mask = mask & in_set
        term = torch.where(mask, a, 0)
        inclusive = torch.cumsum(term, dim=1)
        before += (inclusive - term) >> (MASS_GROUP_BINADES * g)
        total += inclusive[:, -1] >> (MASS_GROUP_BINADES * g)
    return before, total


def _ceil_times(p: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``ceil(p * w)`` exactly, as :func:`ipc_dpsample.layout.top_p_threshold`.

    ``p`` float32 ``[rows]`` in ``(0, 1]`` is ``mant * 2**-s`` (its bits: ``mant < 2**24``,
    ``s >= 23``); ``w`` int64 ``[rows]`` in ``[0, 2**63)``. ``X = mant * w < 2**87`` is
    formed as ``hi * 2**48 + lo``, then shifted right by ``s`` with the remainder's
    non-zero-ness rounding up. Returns int64 ``[rows]``.
    """
    bits = p.contiguous().view(torch.int32).to(torch.int64)
    e = (bits >> 23) & 0xFF
    frac = bits & 0x7FFFFF
    mant = torch.where(e > 0, frac | 0x800000, frac)
    s = torch.where(e > 0, 150 - e, 149)
    a = mant * (w >> 24)  # < 2**63
    lo = mant * (w & 0xFFFFFF) + ((a & 0xFFFFFF) << 24)  # < 2**49
    hi = (a >> 24) + (lo >> 48)
    lo = lo & ((1 << 48) - 1)
    one = torch.ones_like(s)
    s_lo = s.clamp(max=48)  # s <= 48: hi << (48 - s) <= p * w fits
    q_lo = (hi << (48 - s_lo)) + (lo >> s_lo)
    r_lo = (lo & ((one << s_lo) - 1)) != 0
    s_hi = (s - 48).clamp(0, 62)
    q_hi = hi >> s_hi
    r_hi = (lo != 0) | ((hi & ((one << s_hi) - 1)) != 0)
    big = s > 48
    return torch.where(big, q_hi, q_lo) + torch.where(big, r_hi, r_lo).to(torch.int64)


def _top_p_kept(before: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Nucleus membership in key order: the exclusive prefix mass ``< ceil(p * W)``."""
    return before < threshold[:, None]


def _min_p_kept(z: torch.Tensor, z_max: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """``z >= float32(z_max + float32(det_log(min_p)))`` where ``min_p > 0`` (float32 add)."""
    on = min_p > 0
    one = torch.ones_like(min_p)
    log_mp = _det_log(torch.where(on, min_p, one).to(torch.float64)).to(torch.float32)
    threshold = z_max + log_mp
    return ~on[:, None] | (z >= threshold[:, None])


# -- row helpers -------------------------------------------------------------------------
def _order_key(x: torch.Tensor) -> torch.Tensor:
    """The key order as one tie-free int64 per column (larger = earlier): float32 bits
    made monotone in the value (``-0.0`` as ``+0.0``) times ``2**32``, plus
    ``2**32 - 1 - id``. ``x`` float32 ``[rows, V]`` without NaN; returns int64."""
    bits = x.view(torch.int32)
    bits = torch.where(bits == -(1 << 31), 0, bits)  # -0.0 == +0.0
    mono = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)
    ids = torch.arange(x.shape[1], dtype=torch.int64, device=x.device)
    return mono * (1 << 32) + (_M32 - ids)


def _first_max(s: torch.Tensor) -> torch.Tensor:
    """The lowest column holding the row's maximum, int64 ``[rows]`` (no NaN in ``s``)."""
    ids = torch.arange(s.shape[1], dtype=torch.int64, device=s.device)
    hit = s == s.amax(dim=1, keepdim=True)
    return torch.where(hit, ids, s.shape[1]).amin(dim=1)


def _row_stats(
    x: torch.Tensor, temp: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per float32 row: ``layout.torch_argmax`` (int64), ``z_max = float32(max / temp)``
    and whether the row may sample (no NaN, ``z_max`` finite)."""
    v = x.shape[1]
    ids = torch.arange(v, dtype=torch.int64, device=x.device)
    nan = torch.isnan(x)
    first_nan = torch.where(nan, ids, v).amin(dim=1)
    xm = torch.where(nan, _f32(float("-inf"), x.device), x)
    x_max = xm.amax(dim=1)
    first_max = torch.where(xm == x_max[:, None], ids, v).amin(dim=1)
    z_max = x_max / temp
    return (
        torch.where(first_nan < v, first_nan, first_max),
        z_max,
        (first_nan == v) & torch.isfinite(z_max),
    )


def _sample_top_k(
    x: torch.Tensor,
    temp: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    z_max: torch.Tensor,
    key: torch.Tensor,
    k_cap: int,
) -> torch.Tensor:
    """Rows with top-k on (``1 <= top_k <= k_cap``): everything on the first ``k_cap``
    columns in key order (the top-k set is a prefix of them; so are the top-p and min-p
    sets). ``x`` float32 ``[rows, V]`` without NaN/+inf. Returns int64 token ids."""
    ids = torch.topk(_order_key(x), k_cap, dim=1).indices  # key order
    z = x.gather(1, ids) / temp[:, None]  # float32 division
    score = z + gumbel_noise(key[:, None], ids)
    j = torch.arange(k_cap, device=x.device)
    in_set = j[None, :] < top_k[:, None]
    before, total = _prefix_masses(z, in_set)
    kept = in_set & ((top_p[:, None] == 1) | _top_p_kept(before, _ceil_times(top_p, total)))
    kept = kept & _min_p_kept(z, z_max, min_p)
    best = _first_max(torch.where(kept, score, _f32(float("-inf"), x.device)))
    return ids.gather(1, best[:, None])[:, 0]


def _sample_full(
    x: torch.Tensor,
    temp: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    z_max: torch.Tensor,
    key: torch.Tensor,
    with_top_p: bool,
) -> torch.Tensor:
    """Rows with top-k off: the noise of every column; with ``with_top_p`` the rows'
    ``top_p < 1`` is applied (one sort of the row by the key order), else ignored."""
    v = x.shape[1]
    z = x / temp[:, None]
    ids = torch.arange(v, dtype=torch.int64, device=x.device)
    score = z + gumbel_noise(key[:, None], ids[None, :])
    kept = _min_p_kept(z, z_max, min_p)
    if with_top_p:
        order_key = _order_key(x)
        sorted_key, order = torch.sort(order_key, dim=1, descending=True)
        before, total = _prefix_masses(z.gather(1, order), None)
        # the nucleus is a key-order prefix (before is non-decreasing): its last key
        n_keep = _top_p_kept(before, _ceil_times(top_p, total)).sum(dim=1)
        edge = sorted_key.gather(1, (n_keep - 1).clamp(min=0)[:, None])
        kept = kept & ((top_p[:, None] == 1) | (order_key >= edge))
    return _first_max(torch.where(kept, score, _f32(float("-inf"), x.device)))


# -- the sampler -------------------------------------------------------------------------
@dataclass(frozen=True)
class SamplePlan:
    """Which paths :func:`sample_rows` runs, as Python flags: no host sync needed.

    Every flag must be True if some sampled (non-greedy) row needs that path, else those
    rows get a wrong token; a True flag that no row needs costs time only. ``SamplePlan()``
    (all True) is always right. :func:`plan_rows` computes the tight plan (one sync).

    Attributes
    ----------
    top_k : bool
        Some row has top-k on: a ``topk`` of the row and the noise of ``min(128, V)``
        columns.
    full : bool
        Some row has top-k off: the noise of every column.
    full_top_p : bool
        Some row with top-k off has ``top_p < 1``: one sort of the whole row.
    """

    top_k: bool = True
    full: bool = True
    full_top_p: bool = True


def plan_rows(top_k: torch.Tensor, top_p: torch.Tensor, greedy: torch.Tensor) -> SamplePlan:
    """The tight :class:`SamplePlan` for per-row parameters (``[rows]`` tensors, as
    :func:`sample_rows` takes them). One host sync."""
    sampled = ~greedy
    flags = torch.stack(
        [
            (sampled & (top_k > 0)).any(),
            (sampled & (top_k == 0)).any(),
            (sampled & (top_k == 0) & (top_p < 1)).any(),
        ]
    ).tolist()
    return SamplePlan(top_k=flags[0], full=flags[1], full_top_p=flags[2])


def _check_rows_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _LOGIT_DTYPES:
        raise TypeError(f"{name} dtype {t.dtype} != expected float32, bfloat16 or float16")
    if t.dim() != 2:
        raise ValueError(f"{name} shape {tuple(t.shape)} != expected (rows, V)")
    return t


def _check_param(
    name: str, t: object, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...], dev: object
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} dtype {t.dtype} != expected {want}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} shape {tuple(t.shape)} != expected {shape}")
    if t.device != dev:
        raise ValueError(f"{name} is on {t.device}, expected the logits' device {dev}")
    return t


def sample_rows(
    rows: torch.Tensor,
    *,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    greedy: torch.Tensor,
    stream_key: torch.Tensor,
    vocab_limit: int | None = None,
    plan: SamplePlan | None = None,
    chunk_elems: int = CHUNK_ELEMS,
) -> torch.Tensor:
    """The token each full row samples: :func:`ipc_dpsample.layout.sample_full_rows` bit
    for bit (the contract of ``verify_batch_vocab`` per row), on the rows' device.

    Parameters
    ----------
    rows : float32, bfloat16 or float16 ``[n, V]``, any device, any strides
        Full rows of raw logits; column = global token id.
    temperature : float32 ``[n]``
        ``> 0`` on sampled rows (read on non-greedy rows only).
    top_k : int32 or int64 ``[n]``
        Normalised: 0 = off, else ``1..TOP_K_MAX`` (and ``< vocab_limit``), as
        :func:`row_params` gives it.
    top_p : float32 ``[n]``
        In ``(0, 1]``, 1 = off.
    min_p : float32 ``[n]``
        In ``[0, 1)``, 0 = off.
    greedy : bool ``[n]``
        The argmax rows (temperature below ``SAMPLING_EPS`` or top-k 1).
    stream_key : int64 ``[n]``
        :func:`noise_stream_key` of each row.
    vocab_limit : int or None
        Columns ``>= vocab_limit`` are absent (None: ``V``); ``<= MAX_VOCAB``.
    plan : SamplePlan or None
        None: one host sync finds which path each row needs and samples every row on its
        path only. A :class:`SamplePlan`: no host sync (capturable in a CUDA graph);
        every enabled path runs on every row and ``torch.where`` picks per row.
    chunk_elems : int
        Rows are processed in chunks of ``max(1, chunk_elems // vocab_limit)``.

    Returns
    -------
    int32 ``[n]`` on the rows' device

    Raises
    ------
    TypeError, ValueError
        A tensor of the wrong type, dtype, shape or device, or a bad ``vocab_limit``
        (values of the parameters are not checked here: :func:`row_params` does).
    """
    _check_rows_tensor("rows", rows)
    n, v = rows.shape
    dev = rows.device
    shape = (n,)
    _check_param("temperature", temperature, (torch.float32,), shape, dev)
    _check_param("top_k", top_k, _INT_DTYPES, shape, dev)
    _check_param("top_p", top_p, (torch.float32,), shape, dev)
    _check_param("min_p", min_p, (torch.float32,), shape, dev)
    _check_param("greedy", greedy, (torch.bool,), shape, dev)
    _check_param("stream_key", stream_key, (torch.int64,), shape, dev)
    limit = verify_vocab_limit(vocab_limit, v)
    if chunk_elems < 1:
        raise ValueError(f"chunk_elems={chunk_elems}; expected >= 1")
    x = rows[:, :limit]
    step = max(1, chunk_elems // limit)
    k_cap = min(TOP_K_MAX, limit)
    temp = torch.where(greedy, _f32(1.0, dev), temperature)

    tok = torch.empty(n, dtype=torch.int64, device=dev)
    z_max = torch.empty(n, dtype=torch.float32, device=dev)
    ok = torch.empty(n, dtype=torch.bool, device=dev)
    for lo in range(0, n, step):
        part = slice(lo, lo + step)
        tok[part], z_max[part], ok[part] = _row_stats(x[part].to(torch.float32), temp[part])
    ok &= ~greedy  # the rows that sample; every other row keeps its argmax
    top_k = top_k.to(torch.int64)

    def sample(i: slice | torch.Tensor, path: int, xs: torch.Tensor) -> torch.Tensor:
        if path == 1:
            return _sample_top_k(
                xs, temp[i], top_k[i], top_p[i], min_p[i], z_max[i], stream_key[i], k_cap
            )
        return _sample_full(xs, temp[i], top_p[i], min_p[i], z_max[i], stream_key[i], path == 3)

    if plan is None:
        # class per row: 0 argmax, 1 top-k, 2 full row, 3 full row with top-p
        code = torch.where(top_k > 0, 1, torch.where(top_p < 1, 3, 2)).to(torch.int8)
        code = torch.where(ok, code, 0).cpu()  # the one host sync
        for path in (1, 2, 3):
            idx = torch.nonzero(code == path).flatten().to(dev)
            for lo in range(0, len(idx), step):
                i = idx[lo : lo + step]
                tok.index_copy_(0, i, sample(i, path, x.index_select(0, i).to(torch.float32)))
        return tok.to(torch.int32)

    one = _f32(1.0, dev)
    for lo in range(0, n, step):
        part = slice(lo, lo + step)
        ok_p = ok[part]
        # rows that do not sample become harmless (0 logits, temperature 1) for the paths
        xs = torch.where(ok_p[:, None], x[part].to(torch.float32), _f32(0.0, dev))
        temp[part] = torch.where(ok_p, temp[part], one)
        pick = tok[part]
        if plan.full:
            full = sample(part, 3 if plan.full_top_p else 2, xs)
            pick = torch.where(ok_p & (top_k[part] == 0), full, pick)
        if plan.top_k:
            pick = torch.where(ok_p & (top_k[part] > 0), sample(part, 1, xs), pick)
        tok[part] = pick
    return tok.to(torch.int32)


# -- per-request parameters -> per-row ---------------------------------------------------
class RowParams(NamedTuple):
    """Per-row sampling parameters, the keywords of :func:`sample_rows`
    (``sample_rows(rows, **params._asdict())``); row ``req * N + d``.

    Attributes
    ----------
    temperature : float32 ``[rows]``
    top_k : int64 ``[rows]``
        Normalised: 0 = off, else ``1..TOP_K_MAX``.
    top_p : float32 ``[rows]``
        1 = off.
    min_p : float32 ``[rows]``
        0 = off.
    greedy : bool ``[rows]``
        ``temperature < SAMPLING_EPS`` or ``top_k == 1``.
    stream_key : int64 ``[rows]``
        :func:`noise_stream_key` of ``(seed, offset + d)``.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    greedy: torch.Tensor
    stream_key: torch.Tensor


def _first_bad(name: str, values: torch.Tensor, bad: torch.Tensor, expected: str) -> str:
    i = int(torch.nonzero(bad)[0, 0])
    return f"{name}[{i}]={values[i].item()}; expected {expected}"


def row_params(
    *,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
    num_tokens_per_req: int,
    vocab_limit: int,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    bs: int | None = None,
    check: bool = True,
) -> RowParams:
    """Per-request parameters -> per-row ones, as :func:`ipc_dpsample.layout.verify_params`
    and its ``per_row`` / ``greedy_rows`` / ``stream_keys``.

    Parameters
    ----------
    temperature : float32 ``[G]``
        Finite, ``>= 0``; ``< SAMPLING_EPS`` means greedy.
    seed, offset : int64 ``[G]``
        The noise stream of each request (position ``d`` uses ``offset + d``, wrapping).
    num_tokens_per_req : int
        ``N``, rows per request.
    vocab_limit : int
        Top-k values ``>= vocab_limit`` are off.
    top_k : int32 or int64 ``[G]`` or None
        0, ``TOP_K_DISABLED`` or ``>= vocab_limit`` = off; ``1..128`` = on. None: off.
    top_p : float32 ``[G]`` or None
        In ``(0, 1]``, 1 = off. None: off.
    min_p : float32 ``[G]`` or None
        In ``[0, 1)``, 0 = off. None: off.
    bs : int or None
        Only the first ``bs`` requests get rows (and are checked); None: ``G``.
    check : bool
        Validate the values (one host sync); False: no sync, values trusted.

    Returns
    -------
    RowParams
        ``[bs * N]`` tensors on the parameters' device.

    Raises
    ------
    TypeError
        A parameter of the wrong type or dtype.
    ValueError
        A wrong shape or device, or (with ``check``) a value out of range; the message
        names the first bad request and the allowed range.
    """
    if not isinstance(temperature, torch.Tensor) or temperature.dim() != 1:
        raise TypeError("temperature must be a float32 torch.Tensor [G]")
    g = temperature.shape[0]
    dev = temperature.device
    shape = (g,)
    n = int(num_tokens_per_req)
    if n < 1:
        raise ValueError(f"num_tokens_per_req={num_tokens_per_req}; expected >= 1")
    nreal = g if bs is None else int(bs)
    if not 0 <= nreal <= g:
        raise ValueError(f"bs={bs}; expected 0 <= bs <= G={g}")
    _check_param("temperature", temperature, (torch.float32,), shape, dev)
    _check_param("seed", seed, (torch.int64,), shape, dev)
    _check_param("offset", offset, (torch.int64,), shape, dev)
    real = slice(0, nreal)
    temp = temperature[real]
    if top_k is None:
        k = torch.zeros(nreal, dtype=torch.int64, device=dev)
    else:
        k = _check_param("top_k", top_k, _INT_DTYPES, shape, dev)[real].to(torch.int64)
    if top_p is None:
        p = torch.ones(nreal, dtype=torch.float32, device=dev)
    else:
        p = _check_param("top_p", top_p, (torch.float32,), shape, dev)[real]
    if min_p is None:
        mp = torch.zeros(nreal, dtype=torch.float32, device=dev)
    else:
        mp = _check_param("min_p", min_p, (torch.float32,), shape, dev)[real]
    k_off = (k == 0) | (k >= vocab_limit)
    if check:
        bad_t = ~(torch.isfinite(temp) & (temp >= 0))
        bad_k = ~k_off & ~((k >= 1) & (k <= TOP_K_MAX))
        bad_p = ~((p > 0) & (p <= 1))
        bad_m = ~((mp >= 0) & (mp < 1))
        if torch.stack([b.any() for b in (bad_t, bad_k, bad_p, bad_m)]).any():  # one sync
            if bad_t.any():
                raise ValueError(
                    _first_bad("temperature", temp, bad_t, "a finite value >= 0 (0 = greedy)")
                )
            if bad_k.any():
                raise ValueError(
                    _first_bad(
                        "top_k",
                        k,
                        bad_k,
                        f"1..{TOP_K_MAX}, or 0 / >= vocab_limit={vocab_limit} "
                        f"(incl. {TOP_K_DISABLED}) for off",
                    )
                )
            if bad_p.any():
                raise ValueError(_first_bad("top_p", p, bad_p, "0 < top_p <= 1 (1 = off)"))
            raise ValueError(_first_bad("min_p", mp, bad_m, "0 <= min_p < 1 (0 = off)"))
    k = torch.where(k_off, 0, k)
    greedy = (temp < float(SAMPLING_EPS)) | (k == 1)

    def per_row(a: torch.Tensor) -> torch.Tensor:  # expand, no repeat_interleave (graphs)
        return a[:, None].expand(nreal, n).reshape(-1)

    # offset + d in 32-bit words: int64 wrap-around without a signed overflow
    off_hi, off_lo = _split64(offset[real])
    d = torch.arange(n, dtype=torch.int64, device=dev)
    lo = off_lo[:, None] + d[None, :]
    hi = (off_hi[:, None] + (lo >> 32)) & _M32
    seed_hi, seed_lo = _split64(per_row(seed[real]))
    keys = _philox4x32_word0((lo & _M32).reshape(-1), seed_lo, seed_hi, hi.reshape(-1))
    return RowParams(
        temperature=per_row(temp),
        top_k=per_row(k),
        top_p=per_row(p),
        min_p=per_row(mp),
        greedy=per_row(greedy),
        stream_key=keys,
    )


# -- the verify step on one rank's rows ----------------------------------------------------
def accept_chain(
    candidates: torch.Tensor, sampled: torch.Tensor, reqs_per_rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ "Sample, then match", :func:`ipc_dpsample.layout.accept_chain` in torch.

    Parameters
    ----------
    candidates : int32 or int64 ``[G, N]``
        Column 0 the last accepted token, ``1..`` the drafts.
    sampled : int ``[G, N]``, same device
        The token each row sampled.
    reqs_per_rank : int
        ``R``: ``accept_index`` numbers rows of the owning rank, ``(g % R) * N + j``.

    Returns
    -------
    predict : int32 ``[G, N]``
    accept_index : int32 ``[G, N]``
        ``(g % R) * N + j`` for ``j <= accepted``, -1 after.
    accept_length : int32 ``[G]``
        Accepted drafts + 1.
    """
    g, n = candidates.shape
    dev = candidates.device
    if n > 1:
        match = (candidates[:, 1:] == sampled[:, :-1].to(candidates.dtype)).to(torch.int32)
        accepted = torch.cumprod(match, dim=1).sum(dim=1)
    else:
        accepted = torch.zeros(g, dtype=torch.int64, device=dev)
    j = torch.arange(n, device=dev)
    base = (torch.arange(g, device=dev) % reqs_per_rank) * n
    index = torch.where(j[None, :] <= accepted[:, None], base[:, None] + j[None, :], -1)
    return (
        sampled.to(torch.int32).clone(),
        index.to(torch.int32),
        (accepted + 1).to(torch.int32),
    )


def log_softmax_at(
    rows: torch.Tensor, tokens: torch.Tensor, *, chunk_elems: int = CHUNK_ELEMS
) -> torch.Tensor:
    """``float32(log_softmax(row)[token])`` in float64, as
    :func:`ipc_dpsample.layout.log_softmax_at`: ``(x - max) - log(sum(exp(x - max)))``, NaN
    for a row holding a NaN, a ``+inf`` or only ``-inf``.

    Accuracy: torch's ``exp``/``log`` and summation order differ from NumPy's, so the
    float64 value differs from the reference's by a few float64 ulps of ``|logprob|``
    (both terms have the same sign: no cancellation); the float32 results are equal except
    where that value lies within ~1e-15 (relative) of a float32 rounding boundary, and then
    1 float32 ulp apart.

    Parameters
    ----------
    rows : float32, bfloat16 or float16 ``[n, V]`` (already trimmed to ``vocab_limit``)
    tokens : int ``[n]``, same device

    Returns
    -------
    float32 ``[n]``
    """
    n, v = rows.shape
    out = torch.empty(n, dtype=torch.float32, device=rows.device)
    step = max(1, chunk_elems // max(v, 1))
    for lo in range(0, n, step):
        part = slice(lo, lo + step)
        x = rows[part].to(torch.float64)
        nan_row = torch.isnan(x).any(dim=1)
        m = torch.where(torch.isnan(x), float("-inf"), x).amax(dim=1)
        row_ok = ~nan_row & torch.isfinite(m)
        m = torch.where(row_ok, m, 0.0)
        log_sum = torch.log(torch.exp(x - m[:, None]).sum(dim=1))
        chosen = x.gather(1, tokens[part].to(torch.int64)[:, None])[:, 0]
        out[part] = torch.where(row_ok, (chosen - m) - log_sum, float("nan")).to(torch.float32)
    return out


def verify_rows(
    rows: torch.Tensor,
    candidates: torch.Tensor,
    *,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    reqs_per_rank: int | None = None,
    vocab_limit: int | None = None,
    bs: int | None = None,
    return_logprobs: bool = False,
    plan: SamplePlan | None = None,
    check: bool = True,
    chunk_elems: int = CHUNK_ELEMS,
) -> tuple[torch.Tensor, ...]:
    """Sampled verify of full rows: ``verify_batch_vocab``'s results for these requests.

    For TokenSpeed's Batch-DP route, ``rows`` is one rank's ``swap_batch_vocab`` output
    (its ``R`` requests, row ``local_req * N + d``) and ``gather_verify_outputs`` of the
    results gives what ``verify_batch_vocab`` gives every rank. With the whole batch's
    rows and ``reqs_per_rank = pad_bs / tp`` it is ``layout.reference_verify_rows``.

    Parameters
    ----------
    rows : float32, bfloat16 or float16 ``[G * N, V]``
    candidates : int32 or int64 ``[G, N]``, same device
        Column 0 the last accepted token, ``1..`` the drafts.
    temperature, seed, offset, top_k, top_p, min_p : ``[G]`` tensors
        As :func:`row_params`.
    reqs_per_rank : int or None
        ``R``, numbering ``accept_index`` as ``(g % R) * N + j`` (None: ``G``).
    vocab_limit : int or None
        None: ``V``.
    bs : int or None
        Real requests, a prefix of the ``G``; the others are not sampled and get
        ``predict = 0``, ``accept_index = -1``, ``accept_length = 0``, NaN logprobs (as
        ``layout.finish_verify``).
    return_logprobs : bool
        Also return :func:`log_softmax_at` of the raw rows at ``predict``.
    plan : SamplePlan or None
        See :func:`sample_rows`.
    check : bool
        See :func:`row_params`. ``check=False`` with a ``plan``: no host sync at all.
    chunk_elems : int
        See :func:`sample_rows` (the results do not depend on it; larger chunks launch
        fewer kernels and hold larger temporaries).

    Returns
    -------
    predict : int32 ``[G, N]``
    accept_index : int32 ``[G, N]``
    accept_length : int32 ``[G]``
    logprobs : float32 ``[G, N]``, only with ``return_logprobs``
    """
    _check_rows_tensor("rows", rows)
    if not isinstance(candidates, torch.Tensor) or candidates.dtype not in _INT_DTYPES:
        raise TypeError("candidates must be an int32 or int64 torch.Tensor [G, N]")
    if candidates.dim() != 2 or candidates.shape[1] < 1:
        raise ValueError(f"candidates shape {tuple(candidates.shape)} != expected (G, N >= 1)")
    g, n = candidates.shape
    if rows.shape[0] != g * n:
        raise ValueError(f"rows shape {tuple(rows.shape)} != expected ({g * n}, V) (G={g}, N={n})")
    if candidates.device != rows.device:
        raise ValueError(f"candidates is on {candidates.device}, expected {rows.device}")
    per_rank = g if reqs_per_rank is None else int(reqs_per_rank)
    if per_rank < 1 or g % per_rank:
        raise ValueError(f"reqs_per_rank={reqs_per_rank} must be positive and divide G={g}")
    limit = verify_vocab_limit(vocab_limit, rows.shape[1])
    params = row_params(
        temperature=temperature,
        seed=seed,
        offset=offset,
        num_tokens_per_req=n,
        vocab_limit=limit,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        bs=bs,
        check=check,
    )
    nreal = g if bs is None else int(bs)
    x = rows[: nreal * n]
    tokens = sample_rows(
        x, **params._asdict(), vocab_limit=limit, plan=plan, chunk_elems=chunk_elems
    )
    sampled = torch.zeros((g, n), dtype=torch.int32, device=rows.device)
    sampled[:nreal] = tokens.view(nreal, n)
    predict, accept_index, accept_length = accept_chain(candidates, sampled, per_rank)
    predict[nreal:] = 0
    accept_index[nreal:] = -1
    accept_length[nreal:] = 0
    if not return_logprobs:
        return predict, accept_index, accept_length
    logprobs = torch.full((g, n), float("nan"), dtype=torch.float32, device=rows.device)
    logprobs[:nreal] = log_softmax_at(x[:, :limit], tokens).view(nreal, n)
    return predict, accept_index, accept_length, logprobs

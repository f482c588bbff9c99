"""The sharded algorithm of ``verify_batch_vocab``: per-shard records and their combine.

Every rank ``s`` holds columns ``[s*V/tp, (s+1)*V/tp)`` of every row (``swap_batch_vocab``'s
input layout). Instead of moving the logits, each rank reduces each row of its shard to one
fixed-size *record* (:func:`record_dtype`, :func:`shard_records`); after one all-gather of
records every rank combines them (:func:`combine_records`) into the token the full row
samples under :func:`ipc_dpsample.layout.sample_full_rows`, bit for bit, and runs the accept
chain for the whole batch. Rows the records cannot decide (only top-p without top-k, and
min-p rows whose staircase was cut, see below) stay *pending*; every rank derives the same
pending rows and the same probes from the same records, so a second, small round needs no
coordination: each shard sends, per probe, the exact masses of its columns before the probe
(:func:`probe_records`, 896 bytes per row) and :func:`combine_probes` closes the row. What is
still open then (a cut staircase) takes the exact fallback: the row's full logits.
:func:`verify_batch_vocab_sharded` runs the whole pipeline on NumPy shards and returns what
:func:`ipc_dpsample.layout.reference_verify_batch_vocab` returns.

Why the combine is exact
------------------------
Write ``key order`` for (raw logit descending, token id ascending), a total order; the
kept set of every filter is a *prefix* of it (top-k: the first k; top-p: the columns whose
exclusive prefix mass is below ``p*W``; min-p: ``z >= thr``, a value threshold). The token
is the kept column of best (score desc, id asc), ``score = float32(z + g)`` with the noise
``g`` a function of (request stream, global id) only, so any rank can compute any
column's score.

* greedy / degenerate rows: the best of the shards' ``torch.argmax`` (value desc, id asc;
  a NaN anywhere: the lowest NaN id).
* temperature only: each shard's best (score, id); the best of the bests.
* top-k (k <= 128): each shard's first ``k`` in key order; the merge of those lists under
  key order holds the row's first ``k``. Top-p and min-p are then computed on the merged
  list exactly as the full row computes them on its top-k set.
* min-p: ``thr = float32(z_max + min_p_log)`` needs the row's ``z_max``, i.e. the best of
  the shards' maxima, known only at the combine. Each shard sends its *staircase*: the
  columns (within its own, weaker band ``z >= float32(z_max_s + min_p_log)``) taken in
  score order that beat every earlier one in key order. For any key-order prefix, the
  shard's best-scoring column in it is the first staircase entry inside the prefix, so
  once ``thr`` is known the combine reads each shard's best kept column off its staircase.
  Staircases are short (records of a random order: about ``ln n`` entries); a staircase
  cut at ``stair_cap`` entries before reaching ``thr`` flags the row.
* top-p without top-k: masses are the fixed-point integers of
  :func:`ipc_dpsample.layout.mass_terms`, grouped by an *absolute* exponent group, so the
  shards' per-group sums add exactly: the row's total ``W`` is exact from 7 words per
  shard. Each shard also sends its first ``M = list_cap`` columns in key order. Every
  column before the best unsent column ``u`` (in key order) is in the merge, so the
  exclusive prefix masses of that *complete prefix* are exact, and so is its total
  ``B_end``. If ``B_end >= p*W`` the nucleus closes inside the complete prefix: exact. If
  not, the complete prefix and ``u`` itself are kept, and the token is decided when the
  best of them out-scores every column whose membership is unknown (list columns after the
  complete prefix; each shard's staircase of unsent columns). Otherwise the row is pending:
  its candidates, in score order, down to the first known-kept one, are *probes*; round 2
  sends each probe's exclusive prefix mass (per shard, per group: exact again), which
  decides each probe's membership.

Rows left to round 2 or 3 are rare for peaked (LLM-like) rows and frequent for very flat
ones (a nucleus of thousands of tokens): ``docs/verify_contract.md`` has measured rates.

The record (wire format)
------------------------
One record per row per shard, :func:`record_dtype` with ``list_cap = 128`` and
``stair_cap = 16``: 328 little-endian 32-bit words (1312 bytes), 8-byte fields 8-byte
aligned. ``id`` fields are global token ids; :data:`NO_ID` (``2**31 - 1``) marks "none"
(its value is ``-inf``).

======  ==============  =====  ===============================================================
words   field           dtype  content
======  ==============  =====  ===============================================================
0       flags           u32    bit 0: a NaN in the shard's columns; bit 1: staircase cut;
                               bits 8-15: staircase entries used; bits 16-23: list entries used
1       greedy_id       i32    ``torch.argmax`` of the shard's columns (first NaN if any)
2       greedy_val      f32    its raw logit (the shard's maximum; NaN; ``-inf`` when empty)
3       rtop_id         i32    best column in key order that is *not* in the list
4       rtop_val        f32    its raw logit
5       reserved        u32    0
6-7     sumexp          f64    ``sum(exp(x - greedy_val))`` over the columns (logprobs; 0 when
                               the maximum is not finite)
8-9     mass_group      f64    exponent group of the shard's ``z_max`` (``-inf``: none)
10-23   mass[7]         i64    ``mass[d]``: sum of the mass mantissas of group ``mass_group - d``
24-39   stair_score     f32    staircase: scores, in decreasing score order
40-55   stair_val       f32    staircase: raw logits (increasing key order)
56-71   stair_id        i32    staircase: ids
72-199  list_val        f32    list: raw logits in key order
200-327 list_id         i32    list: ids
======  ==============  =====  ===============================================================

What a row fills (a backend may send only the used words): greedy rows words 0-2;
temperature-only rows also one staircase entry; top-k rows the list (``k`` entries);
min-p rows ``rtop`` and the staircase; top-p rows ``rtop``, ``mass``, the list (``M``) and
the staircase (its first entry, and all of it with min-p); ``sumexp`` with logprobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .layout import (
    MASS_GROUPS,
    SAMPLING_EPS,
    VerifyParams,
    as_float32,
    check_candidates,
    check_logits,
    det_log,
    finish_verify,
    group_mass,
    gumbel_noise,
    mass_terms,
    min_p_log,
    prefix_masses,
    sample_full_rows,
    top_p_threshold,
    uniform_from_uint32,
    verify_params,
)

__all__ = [
    "FLAG_HAS_NAN",
    "FLAG_STAIR_CUT",
    "KEPT",
    "LIST_CAP",
    "NO_ID",
    "PROBE",
    "PROBE_CAP",
    "STAIR_CAP",
    "UNKNOWN",
    "Combined",
    "Pending",
    "combine_probes",
    "combine_records",
    "full_row_tokens",
    "probe_dtype",
    "probe_records",
    "record_caps",
    "record_dtype",
    "record_words",
    "shard_records",
    "sharded_tokens",
    "verify_batch_vocab_sharded",
]

LIST_CAP = 128
"""Longest list a shard sends (top-k's ``k``; top-p's ``M``)."""
STAIR_CAP = 16
"""Longest staircase a shard sends."""
NO_ID = np.int32(2**31 - 1)
"""The id of "no column" (it loses every tie)."""
FLAG_HAS_NAN = 1
FLAG_STAIR_CUT = 2
_STAIR_SHIFT = 8
_LIST_SHIFT = 16


def record_dtype(list_cap: int = LIST_CAP, stair_cap: int = STAIR_CAP) -> np.dtype:
    """The per-row-per-shard record as a packed NumPy structured dtype (the wire format).

    Parameters
    ----------
    list_cap : int
        List entries, ``1..255``.
    stair_cap : int
        Staircase entries, ``1..255``.

    Returns
    -------
    numpy.dtype
        ``6 + 2 + 2 + 14 + 3*stair_cap + 2*list_cap`` 32-bit words, see the module
        docstring; ``record.view(np.uint32)`` is the wire image.
    """
    for name, cap in (("list_cap", list_cap), ("stair_cap", stair_cap)):
        if not 1 <= cap <= 255:
            raise ValueError(f"{name}={cap}; expected 1..255 (an 8-bit count in flags)")
    if (3 * stair_cap + 2 * list_cap) % 2:
        raise ValueError(f"stair_cap={stair_cap} must be even, so the record is 8-byte sized")
    return np.dtype(
        [
            ("flags", "<u4"),
            ("greedy_id", "<i4"),
            ("greedy_val", "<f4"),
            ("rtop_id", "<i4"),
            ("rtop_val", "<f4"),
            ("reserved", "<u4"),
            ("sumexp", "<f8"),
            ("mass_group", "<f8"),
            ("mass", "<i8", (MASS_GROUPS,)),
            ("stair_score", "<f4", (stair_cap,)),
            ("stair_val", "<f4", (stair_cap,)),
            ("stair_id", "<i4", (stair_cap,)),
            ("list_val", "<f4", (list_cap,)),
            ("list_id", "<i4", (list_cap,)),
        ]
    )


def record_words(list_cap: int = LIST_CAP, stair_cap: int = STAIR_CAP) -> int:
    """32-bit words of one record (328 for the defaults)."""
    return record_dtype(list_cap, stair_cap).itemsize // 4


def record_caps(params: VerifyParams) -> tuple[int, int]:
    """The smallest record capacities ``(list_cap, stair_cap)`` that keep a call's
    records as decisive as the defaults (``docs/verify_contract.md``, "Bytes and
    rounds"): the list holds the largest top-k of the real rows, or :data:`LIST_CAP`
    when a sampled row has top-p without top-k; the staircase holds :data:`STAIR_CAP`
    entries when a sampled row has top-p or min-p without top-k, else 2 (the one entry
    a temperature-only row sends, rounded up to keep the record 8-byte sized). The
    list also covers the top-k of greedy rows, which :func:`shard_records` checks.

    A function of the normalised parameters only, so ranks that agree on them agree
    on the record size.
    """
    real = params.bs
    k = params.top_k[:real]
    sampled = ~((params.temperature[:real] < SAMPLING_EPS) | (k == 1))
    no_k = sampled & (k == 0)
    top_p_only = bool((no_k & (params.top_p[:real] < 1)).any())
    banded = bool((no_k & (params.min_p[:real] > 0)).any())
    # every real row's top-k (greedy ones too: shard_records checks them all)
    list_cap = LIST_CAP if top_p_only else max(1, int(k.max(initial=0)))
    stair_cap = STAIR_CAP if (top_p_only or banded) else 2
    return list_cap, stair_cap


def _empty_records(rows: int, dt: np.dtype) -> np.ndarray:
    rec = np.zeros(rows, dtype=dt)
    rec["greedy_id"] = NO_ID
    rec["greedy_val"] = -np.inf
    rec["rtop_id"] = NO_ID
    rec["rtop_val"] = -np.inf
    rec["mass_group"] = -np.inf
    rec["stair_id"] = NO_ID
    rec["list_id"] = NO_ID
    return rec


def _key_order(x: np.ndarray) -> np.ndarray:
    """Columns in key order (value descending, column ascending); NaN as ``-inf``."""
    return np.argsort(-np.where(np.isnan(x), np.float32(-np.inf), x), kind="stable")


def _staircase(
    cand: np.ndarray, score: np.ndarray, rank: np.ndarray, cap: int
) -> tuple[np.ndarray, bool]:
    """The staircase of columns ``cand``: in (score desc, column asc) order, the columns
    whose key rank beats every earlier one's; the first ``cap`` of them and whether
    there were more."""
    if len(cand) == 0:
        return cand, False
    by_score = cand[np.lexsort((cand, -score[cand]))]
    kr = rank[by_score]
    record = np.empty(len(kr), dtype=bool)
    record[0] = True
    record[1:] = kr[1:] < np.minimum.accumulate(kr)[:-1]
    steps = by_score[record]
    return steps[:cap], len(steps) > cap


def shard_records(
    local_logits: np.ndarray,
    *,
    shard: int,
    tp: int,
    dtype: str,
    params: VerifyParams,
    list_cap: int = LIST_CAP,
    stair_cap: int = STAIR_CAP,
) -> np.ndarray:
    """The records one shard sends: every row reduced over the shard's columns only.

    Parameters
    ----------
    local_logits : ``[pad_bs * N, V / tp]`` (bfloat16 as uint16 bits, float16, float32)
        Rank ``shard``'s columns ``[shard*V/tp, (shard+1)*V/tp)`` of every row.
    shard, tp : int
    dtype : {"bfloat16", "float16", "float32"}
    params : VerifyParams
        The call's parameters (:func:`ipc_dpsample.layout.verify_params`).
    list_cap, stair_cap : int
        The record's capacities; ``list_cap >= top-k`` of every row.

    Returns
    -------
    ``record_dtype(list_cap, stair_cap)`` array ``[pad_bs * N]``
        Rows of requests ``>= bs`` are empty records.
    """
    dt = record_dtype(list_cap, stair_cap)
    width = int(local_logits.shape[1])
    check_logits("local_logits", local_logits, dtype, (params.rows, width))
    if int(params.top_k.max(initial=0)) > list_cap:
        raise ValueError(f"top_k={int(params.top_k.max())} exceeds list_cap={list_cap}")
    base = shard * width
    n_valid = max(0, min(width, params.vocab_limit - base))
    real = params.real_rows
    rec = _empty_records(params.rows, dt)
    if n_valid == 0 or real == 0:
        return rec
    x = as_float32(np.asarray(local_logits)[:real, :n_valid], dtype)
    ids = base + np.arange(n_valid)

    # greedy and logprob partials, every row (np.argmax is torch.argmax: the first NaN,
    # else the first maximum), in row chunks that keep the float64 temporaries small
    g = np.empty(real, np.int64)
    sumexp = np.empty(real, np.float64)
    step = max(1, _CHUNK_ELEMS // n_valid)
    for lo in range(0, real, step):
        part = x[lo : lo + step]
        g[lo : lo + step] = gi = np.argmax(part, axis=1)
        gv = part[np.arange(len(part)), gi]
        ok = np.isfinite(gv)
        with np.errstate(invalid="ignore", over="ignore"):
            sh = part.astype(np.float64) - np.where(ok, gv, 0).astype(np.float64)[:, None]
            sumexp[lo : lo + step] = np.where(ok, np.exp(sh).sum(axis=1), 0.0)
    gval = x[np.arange(real), g]
    has_nan = np.isnan(gval)
    rec["greedy_id"][:real] = ids[g]
    rec["greedy_val"][:real] = gval
    rec["flags"][:real] |= np.where(has_nan, FLAG_HAS_NAN, 0).astype(np.uint32)
    rec["sumexp"][:real] = sumexp

    per = params.per_row
    temp = per(params.temperature)[:real]
    top_k = per(params.top_k)[:real]
    top_p = per(params.top_p)[:real]
    min_p = per(params.min_p)[:real]
    lmp = min_p_log(min_p)
    sampled = np.flatnonzero(~params.greedy_rows[:real])
    if len(sampled) == 0:
        return rec
    keys = params.stream_keys
    step = max(1, _CHUNK_ELEMS // n_valid)
    for lo in range(0, len(sampled), step):
        _sampled_records(
            rec,
            sampled[lo : lo + step],
            x,
            has_nan,
            ids,
            keys,
            temp,
            top_k,
            top_p,
            min_p,
            lmp,
            list_cap,
            stair_cap,
        )
    return rec


_CHUNK_ELEMS = 1 << 19
"""Sampled rows are reduced in chunks of about this many elements (bounded temporaries)."""
_NOISE_CHUNK = 1 << 14
"""Noise values computed per pass (the Philox temporaries stay in cache)."""
_M0, _M1, _W0, _W1 = (np.uint64(v) for v in (0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85))
_U32 = np.uint64(0xFFFFFFFF)
_SH32 = np.uint64(32)
_MAX_KEY = np.int64(np.iinfo(np.int64).max)
_COL_BITS = 21  # columns and global ids are < MAX_VOCAB = 2**21


def _philox_x0(ids: np.ndarray, key: np.ndarray) -> np.ndarray:
    """``philox4x32_10((ids, 0, 0, 0), (key & 0xffffffff, key >> 32))[0]`` for flat uint64
    ``ids`` and ``key`` of one length (the same integer operations, round 1 specialised to
    the zero counter words and round 10 to the one output word)."""
    k0 = key & _U32
    k1 = key >> _SH32
    p0 = ids * _M0
    c0 = k0
    c1 = None  # zero
    c2 = p0 >> _SH32
    c2 ^= k1
    c3 = p0
    c3 &= _U32
    for rnd in range(1, 10):
        k0 = k0 + _W0
        k0 &= _U32
        k1 = k1 + _W1
        k1 &= _U32
        p1 = c2 * _M1
        n0 = p1 >> _SH32
        if c1 is not None:
            n0 ^= c1
        n0 ^= k0
        if rnd == 9:
            return n0
        p0 = c0 * _M0
        n2 = p0 >> _SH32
        n2 ^= c3
        n2 ^= k1
        p1 &= _U32
        p0 &= _U32
        c0, c1, c2, c3 = n0, p1, n2, p0
    raise AssertionError("unreachable")


def _uniforms(stream: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """float64 of :func:`ipc_dpsample.layout.uniform_from_uint32` of the Philox words of
    flat (stream key, global id) pairs, computed in cache-sized chunks."""
    n = len(ids)
    out = np.empty(n, np.float64)
    stream = np.asarray(stream, np.uint64)
    ids = np.asarray(ids).astype(np.uint64)
    for lo in range(0, n, _NOISE_CHUNK):
        hi = min(n, lo + _NOISE_CHUNK)
        w = _philox_x0(ids[lo:hi], stream[lo:hi]).astype(np.uint32)
        out[lo:hi] = uniform_from_uint32(w)
    return out


def _gumbel_from_uniform(u: np.ndarray) -> np.ndarray:
    """:func:`ipc_dpsample.layout.gumbel_noise` from its float64 uniforms (the same ops)."""
    out = np.empty(len(u), np.float32)
    for lo in range(0, len(u), _NOISE_CHUNK):
        part = u[lo : lo + _NOISE_CHUNK]
        out[lo : lo + len(part)] = -det_log(-det_log(part))
    return out


def _noise(stream: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``gumbel_noise(stream, ids)`` of flat pairs, bit for bit, faster."""
    return _gumbel_from_uniform(_uniforms(stream, ids))


# The largest noise value: the uniform is at most float32(2**31 - 1) * scale = 1 - 2**-24
# (uniform_from_uint32 is monotone in the int32 word), and -log(-log(u)) increases with u.
_U_MAX = float(uniform_from_uint32(np.array([0x7FFFFFFF], np.uint32))[0])
_G_MAX = float(-det_log(-det_log(np.array([_U_MAX])))[0])  # 16.6355...
_G_BOUND = np.float32(_G_MAX + 1e-3)
"""Every noise value is below this: ``score = float32(z + g) <= float32(z + _G_BOUND)``
(float32 rounding is monotone), with a margin far above det_log's few-ulp error."""
assert 16.6 < _G_MAX < 16.7
_G_SLACK = 1e-6
"""``|det_log noise - np.log noise|`` is below 1e-12 (both are within a few ulp of the
logarithm in float64); a float64 margin of 1e-6 bounds the float32 noise either side."""


def _desc_keys(xs: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """int64 keys whose ascending order is key order (value descending, ``cols`` ascending;
    ``-0.0 == +0.0``); ``xs`` float32 without NaN, ``cols`` ints below 2**21."""
    b = (xs + np.float32(0)).view(np.int32)  # -0.0 + 0.0 = +0.0
    mono = np.where(b < 0, b ^ np.int32(0x7FFFFFFF), b).astype(np.int64)
    return ((np.int64(0x7FFFFFFF) - mono) << _COL_BITS) | cols


def _first_in_key_order(xs: np.ndarray, n: int) -> np.ndarray:
    """Columns of the first ``n`` columns of each row of ``xs`` (float32, no NaN) in key
    order, ``n <= xs.shape[1]``: the columns at or above the row's ``n``-th largest value
    (ties included), then sorted by their integer keys."""
    m, width = xs.shape
    nth = np.partition(xs, width - n, axis=1)[:, width - n]
    r, c = np.nonzero(xs >= nth[:, None])
    keys = _desc_keys(xs[r, c], c.astype(np.int64))
    count = np.bincount(r, minlength=m)
    pos = np.arange(len(r)) - (np.cumsum(count) - count)[r]
    padded = np.full((m, int(count.max())), _MAX_KEY, np.int64)
    padded[r, pos] = keys
    padded.sort(axis=1)
    return (padded[:, :n] & ((1 << _COL_BITS) - 1)).astype(np.int64)


def _staircases(
    z: np.ndarray,
    xs: np.ndarray,
    mask: np.ndarray,
    first: np.ndarray,
    stream: np.ndarray,
    ids: np.ndarray,
    cap: np.ndarray,
    stair_cap: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The staircases of rows of a chunk: :func:`_staircase` of the columns ``mask[i]``.

    ``first[i]`` is the key-first column of ``mask[i]`` (any column where the row is
    empty); ``cap[i] <= stair_cap`` the row's capacity. The key-first column is the last
    entry of the staircase (no column beats it in key order), so every entry scores at
    least ``floor = score(first)``: columns whose ``float32(z + _G_BOUND)`` is below the
    floor are skipped before their noise is drawn, and columns whose noise from
    ``np.log`` (within ``_G_SLACK``) keeps them below it skip the exact noise.

    Returns the entries' columns ``[m, stair_cap]`` (-1 where unused), scores, counts and
    cut flags."""
    m = len(z)
    rows = np.arange(m)
    z_first = z[rows, first]
    floor = z_first + _noise(stream, ids[first])
    with np.errstate(over="ignore", invalid="ignore"):
        reach = mask & ((z + _G_BOUND) >= floor[:, None])
    r, c = np.nonzero(reach)
    u = _uniforms(stream[r], ids[c])
    zz = z[r, c]
    with np.errstate(divide="ignore", invalid="ignore"):
        ga = -np.log(-np.log(u))
    ub = zz + (ga + _G_SLACK).astype(np.float32)
    keep = ub >= floor[r]
    r, c, u, zz = r[keep], c[keep], u[keep], zz[keep]
    score = zz + _gumbel_from_uniform(u)
    keep = score >= floor[r]
    r, c, score = r[keep], c[keep], score[keep]
    order = np.lexsort((c, -score, r))
    r, c, score = r[order], c[order], score[order]
    count = np.bincount(r, minlength=m)
    starts = np.concatenate([[0], np.cumsum(count)[:-1]])
    pos = np.arange(len(r)) - starts[r]
    width = int(count.max(initial=0))
    out_c = np.full((m, stair_cap), -1, np.int64)
    out_s = np.zeros((m, stair_cap), np.float32)
    n_steps = np.zeros(m, np.int64)
    cut = np.zeros(m, bool)
    if width == 0:
        return out_c, out_s, n_steps, cut, floor
    padded = np.full((m, width), _MAX_KEY, np.int64)
    padded[r, pos] = _desc_keys(xs[r, c], c)
    best = np.minimum.accumulate(padded, axis=1)
    is_step = np.empty((m, width), bool)
    is_step[:, 0] = True
    is_step[:, 1:] = padded[:, 1:] < best[:, :-1]
    is_step &= padded != _MAX_KEY
    steps = is_step[r, pos]
    r, c, score = r[steps], c[steps], score[steps]
    total = np.bincount(r, minlength=m)
    nth = np.arange(len(r)) - np.concatenate([[0], np.cumsum(total)[:-1]])[r]
    fit = nth < cap[r]
    out_c[r[fit], nth[fit]] = c[fit]
    out_s[r[fit], nth[fit]] = score[fit]
    n_steps = np.minimum(total, cap)
    cut = total > cap
    return out_c, out_s, n_steps, cut, floor


def _sampled_records(
    rec: np.ndarray,
    rows: np.ndarray,
    x: np.ndarray,
    has_nan: np.ndarray,
    ids: np.ndarray,
    stream_keys: np.ndarray,
    temp: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
    min_p: np.ndarray,
    lmp: np.ndarray,
    list_cap: int,
    stair_cap: int,
) -> None:
    """The sampled rows ``rows`` of :func:`shard_records` (one chunk), vectorised over
    rows; rows whose shard maximum is not a finite ``z`` take :func:`_records_rows`."""
    n_valid = x.shape[1]
    xs = x[rows]
    if has_nan[rows].any():
        xs = np.where(np.isnan(xs), np.float32(-np.inf), xs)
    with np.errstate(over="ignore", invalid="ignore"):
        z = xs / temp[rows, None]
    k, p, mp = top_k[rows], top_p[rows], min_p[rows]
    top = np.argmax(xs, axis=1)  # the key-first column (xs holds no NaN)
    zmax = z[np.arange(len(rows)), top]
    rare = (k == 0) & ~np.isfinite(zmax)
    if rare.any():
        _records_rows(
            rec,
            rows[rare],
            xs[rare],
            z[rare],
            ids,
            stream_keys,
            k,
            p,
            mp,
            lmp,
            rows,
            rare,
            list_cap,
            stair_cap,
        )
    n_list = np.where(k > 0, np.minimum(k, n_valid), np.where(p < 1, min(list_cap, n_valid), 0))
    n_list[rare] = 0
    width = int(n_list.max(initial=0))
    need_rtop = ~rare & (k == 0) & (p < 1) & (n_valid > n_list)
    take = width + (1 if need_rtop.any() else 0)
    take = min(take, n_valid)
    flags = rec["flags"][rows] | (n_list.astype(np.uint32) << _LIST_SHIFT)
    if take:
        lead = _first_in_key_order(xs, take)
        j = np.arange(width)
        used = j[None, :] < n_list[:, None]
        lv = np.take_along_axis(xs, lead[:, :width], axis=1)
        sel = rows[n_list > 0]
        rec["list_val"][sel, :width] = np.where(used, lv, np.float32(0))[n_list > 0]
        rec["list_id"][sel, :width] = np.where(used, ids[lead[:, :width]], NO_ID)[n_list > 0]
    stair = ~rare & (k == 0)
    if stair.any():
        srows = np.flatnonzero(stair)
        sx, sz = xs[srows], z[srows]
        s_nl = n_list[srows]
        s_top = top[srows]
        s_p, s_mp = p[srows], mp[srows]
        s_rtop = np.where(s_nl > 0, 0, s_top)
        has_rest = s_nl < n_valid
        with_list = np.flatnonzero((s_nl > 0) & has_rest)
        if len(with_list):
            s_rtop[with_list] = lead[srows[with_list], s_nl[with_list]]
        rtop_rows = rows[srows[has_rest]]
        rec["rtop_id"][rtop_rows] = ids[s_rtop[has_rest]]
        rec["rtop_val"][rtop_rows] = sx[has_rest, s_rtop[has_rest]]
        m = len(srows)
        rv = sx[np.arange(m), s_rtop][:, None]  # key ranks >= n_list: at or after rtop
        rest = (sx < rv) | ((sx == rv) & (np.arange(n_valid) >= s_rtop[:, None]))
        rest &= has_rest[:, None]
        band = s_mp > 0
        if band.any():
            thr = (zmax[srows] + lmp[rows[srows]]).astype(np.float32)
            rest &= np.where(band[:, None], sz >= thr[:, None], True)
        cap = np.where((s_p < 1) | band, stair_cap, 1)
        sc, ss, ns, cut, _ = _staircases(
            sz, sx, rest, s_rtop, stream_keys[rows[srows]], ids, cap, stair_cap
        )
        has = sc >= 0
        safe = np.where(has, sc, 0)
        rr = rows[srows]
        rec["stair_score"][rr] = np.where(has, ss, np.float32(0))
        rec["stair_val"][rr] = np.where(has, np.take_along_axis(sx, safe, axis=1), np.float32(0))
        rec["stair_id"][rr] = np.where(has, ids[safe], NO_ID)
        flags[srows] |= (ns.astype(np.uint32) << _STAIR_SHIFT) | np.where(
            cut, np.uint32(FLAG_STAIR_CUT), np.uint32(0)
        )
        mass_rows = np.flatnonzero(s_p < 1)
        if len(mass_rows):
            grp, a = mass_terms(sz[mass_rows])
            topg = grp[np.arange(len(mass_rows)), s_top[mass_rows]]
            with np.errstate(invalid="ignore"):
                d = topg[:, None] - grp
            mr = rows[srows[mass_rows]]
            rec["mass_group"][mr] = topg
            rec["mass"][mr] = np.stack(
                [np.where(d == dd, a, 0).sum(axis=1) for dd in range(MASS_GROUPS)], axis=1
            )
    rec["flags"][rows[~rare]] = flags[~rare]


def _records_rows(
    rec, sel, xs, z, ids, stream_keys, k_all, p_all, mp_all, lmp, rows, rare, list_cap, stair_cap
) -> None:
    """The original per-row reduction, for the rare rows (a non-finite shard maximum)."""
    n_valid = xs.shape[1]
    score = z + gumbel_noise(stream_keys[sel, None], ids[None, :])
    idx = np.flatnonzero(rare)
    for i, row in enumerate(sel):
        ci = idx[i]
        order = _key_order(xs[i])
        rank = np.empty_like(order)
        rank[order] = np.arange(n_valid)
        k, p, mp = int(k_all[ci]), float(p_all[ci]), float(mp_all[ci])
        n_list = min(k, n_valid) if k else (min(list_cap, n_valid) if p < 1 else 0)
        r = rec[row]
        r["list_val"][:n_list] = xs[i, order[:n_list]]
        r["list_id"][:n_list] = ids[order[:n_list]]
        flags = int(r["flags"]) | (n_list << _LIST_SHIFT)
        if k == 0:
            rest = order[n_list:]
            if len(rest):
                r["rtop_id"] = ids[rest[0]]
                r["rtop_val"] = xs[i, rest[0]]
            if mp > 0 and np.isfinite(z[i, order[0]]):
                band_thr = np.float32(z[i, order[0]] + lmp[row])
                rest = rest[z[i, rest] >= band_thr]
            cap = stair_cap if (p < 1 or mp > 0) else 1
            steps, cut = _staircase(rest, score[i], rank, cap)
            r["stair_score"][: len(steps)] = score[i, steps]
            r["stair_val"][: len(steps)] = xs[i, steps]
            r["stair_id"][: len(steps)] = ids[steps]
            flags |= (len(steps) << _STAIR_SHIFT) | (FLAG_STAIR_CUT if cut else 0)
            zmax = z[i, order[0]]
            if p < 1 and np.isfinite(zmax):
                grp, a = mass_terms(z[i])
                top = grp[order[0]]
                r["mass_group"] = top
                with np.errstate(invalid="ignore"):
                    d = top - grp
                r["mass"] = [int(a[d == dd].sum()) for dd in range(MASS_GROUPS)]
        r["flags"] = flags


KEPT, PROBE, UNKNOWN = 0, 1, 2
"""Candidate states: kept by every filter; kept unless top-p drops it (its key is known, a
probe decides); an unseen column below a cut staircase."""
PROBE_CAP = 16
"""Most probes one row sends in the second round."""


@dataclass(frozen=True)
class Pending:
    """A row the records leave open, and what the second round needs to close it.

    Attributes
    ----------
    score : float32 ``[c]``
        The row's candidates in (score desc, id asc) order, up to and including the first
        one that is ``KEPT`` or ``UNKNOWN`` (or all of them).
    ids : int64 ``[c]``
    vals : float32 ``[c]``
        Their raw logits (keys are ``(vals, ids)``).
    state : int8 ``[c]``
        ``KEPT``, ``PROBE`` or ``UNKNOWN``.
    threshold : int
        ``ceil(top_p * W)``: a probe is kept iff its exclusive prefix mass is below it.
    top_group : float
        The row's top exponent group (the probes' masses are aligned to it).
    """

    score: np.ndarray
    ids: np.ndarray
    vals: np.ndarray
    state: np.ndarray
    threshold: int
    top_group: float

    @property
    def probes(self) -> np.ndarray:
        """Indices of the ``PROBE`` candidates the walk may reach (at most ``PROBE_CAP``)."""
        return np.flatnonzero(self.state == PROBE)[:PROBE_CAP]

    def resolve(self, before: np.ndarray | None) -> tuple[int, np.float32] | None:
        """Walk the candidates: the first kept one wins. ``before``: the exclusive prefix
        masses of :attr:`probes` (None in the first round). None: still open."""
        decided = {}
        if before is not None:
            decided = {
                int(j): bool(b < self.threshold) for j, b in zip(self.probes, before, strict=True)
            }
        for j, st in enumerate(self.state):
            if st == KEPT or (st == PROBE and decided.get(j, None)):
                return int(self.ids[j]), np.float32(self.vals[j])
            if st == UNKNOWN or (st == PROBE and j not in decided):
                return None
        return None


@dataclass(frozen=True)
class Combined:
    """What :func:`combine_records` decides for the real rows.

    Attributes
    ----------
    tokens : int32 ``[bs * N]``
        The sampled token (undefined where ``pending``).
    token_val : float32 ``[bs * N]``
        Its raw logit (for the logprob).
    pending : dict of int to Pending
        Rows the records cannot decide (row index among the real rows).
    logit_max : float32 ``[bs * N]``
        The row's maximum raw logit (NaN if the row holds a NaN).
    sumexp : float64 ``[bs * N]``
        ``sum(exp(x - logit_max))`` assembled from the shards' partials.
    """

    tokens: np.ndarray
    token_val: np.ndarray
    pending: dict[int, Pending]
    logit_max: np.ndarray
    sumexp: np.ndarray

    @property
    def unresolved(self) -> np.ndarray:
        """bool ``[bs * N]``: the rows in :attr:`pending`."""
        out = np.zeros(len(self.tokens), bool)
        out[list(self.pending)] = True
        return out

    def logprobs(self, token_val: np.ndarray | None = None) -> np.ndarray:
        """``float32((x_token - max) - log(sumexp))`` (NaN for rows with a NaN or a
        non-finite maximum); ``token_val`` overrides the tokens' logits (fallback rows)."""
        tv = self.token_val if token_val is None else token_val
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            m = self.logit_max.astype(np.float64)
            lp = (tv.astype(np.float64) - m) - np.log(self.sumexp)
        return np.where(np.isfinite(m), lp, np.nan).astype(np.float32)


def _best(vals: np.ndarray, ids: np.ndarray) -> int:
    """Index of the best (value desc, id asc) entry."""
    return int(np.lexsort((ids, -vals))[0])


def combine_records(
    records: Sequence[np.ndarray], params: VerifyParams, *, stair_cap: int = STAIR_CAP
) -> Combined:
    """Combine every shard's record of each row into the row's token.

    Parameters
    ----------
    records : sequence of tp record arrays ``[pad_bs * N]``
        ``records[s]`` from :func:`shard_records` of shard ``s``; every rank holds all of
        them after one all-gather of records, and runs this identically (so every rank
        also derives the same second-round probes, without another message).
    params : VerifyParams
    stair_cap : int
        The records' staircase capacity.

    Returns
    -------
    Combined
    """
    real = params.real_rows
    rec = np.stack([np.asarray(r)[:real] for r in records], axis=1)  # [rows, tp]
    per = params.per_row
    temp = per(params.temperature)[:real]
    top_k = per(params.top_k)[:real]
    top_p = per(params.top_p)[:real]
    min_p = per(params.min_p)[:real]
    lmp = min_p_log(min_p)
    greedy = params.greedy_rows[:real]
    keys = params.stream_keys[:real]

    tokens = np.zeros(real, np.int32)
    token_val = np.zeros(real, np.float32)
    pending: dict[int, Pending] = {}
    logit_max = np.zeros(real, np.float32)
    sumexp = np.zeros(real, np.float64)
    if real == 0:
        return Combined(tokens, token_val, pending, logit_max, sumexp)
    rows = np.arange(real)
    gv, gi = rec["greedy_val"], rec["greedy_id"]  # [rows, tp]
    nan = (rec["flags"] & FLAG_HAS_NAN) != 0
    any_nan = nan.any(axis=1)
    big = np.int64(np.iinfo(np.int64).max)
    gi64 = gi.astype(np.int64)
    nan_tok = np.where(nan, gi64, big).min(axis=1)
    # the best (value desc, id asc) shard maximum: the lowest id among the maxima
    clean = np.where(nan, np.float32(-np.inf), gv)
    top = clean.max(axis=1)
    b = np.argmin(np.where(clean == top[:, None], gi64, big), axis=1)
    val = np.where(any_nan, np.float32(np.nan), gv[rows, b])
    tok = np.where(any_nan, nan_tok, gi64[rows, b])
    logit_max[:] = val
    fin = ~any_nan & np.isfinite(val)
    if fin.any():
        with np.errstate(over="ignore", invalid="ignore"):
            e = rec["sumexp"][fin] * np.exp(gv[fin].astype(np.float64) - val[fin, None])
        sumexp[fin] = np.sum(e, axis=1)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        zmax = np.where(greedy, np.float32(np.nan), val / np.where(greedy, 1, temp))
    zmax = zmax.astype(np.float32)
    done = greedy | any_nan | ~np.isfinite(zmax)
    tokens[done] = tok[done]
    token_val[done] = val[done]
    open_rows = ~done
    kr = np.flatnonzero(open_rows & (top_k > 0))
    slow = np.zeros(real, bool)
    if len(kr):
        slow[kr] = ~_combine_top_k(
            rec[kr], kr, temp, zmax, top_k, top_p, lmp, keys, tokens, token_val
        )
    tr = np.flatnonzero(open_rows & (top_k == 0) & (top_p >= 1) & (min_p <= 0))
    if len(tr):
        slow[tr] = ~_combine_temperature(rec[tr], tr, tokens, token_val)
    slow |= open_rows & (top_k == 0) & ((top_p < 1) | (min_p > 0))
    for row in np.flatnonzero(slow):
        r = rec[row]
        walk = _candidates(
            r,
            temp[row],
            zmax[row],
            int(top_k[row]),
            np.float32(top_p[row]),
            min_p[row],
            lmp[row],
            keys[row],
        )
        win = walk.resolve(None)
        if win is None:
            pending[int(row)] = walk
        else:
            tokens[row], token_val[row] = win
    return Combined(tokens, token_val, pending, logit_max, sumexp)


def _combine_temperature(rec, rows, tokens, token_val) -> np.ndarray:
    """Temperature-only rows: the best (score, id) of the shards' one-entry staircases.
    Returns which rows it decided (the others take :func:`_candidates`)."""
    n_stair = (rec["flags"] >> _STAIR_SHIFT) & 0xFF
    has = n_stair > 0
    ss = np.where(has, rec["stair_score"][:, :, 0], np.float32(-np.inf))
    si = rec["stair_id"][:, :, 0].astype(np.int64)
    best = ss.max(axis=1)
    big = np.int64(np.iinfo(np.int64).max)
    j = np.argmin(np.where(has & (ss == best[:, None]), si, big), axis=1)
    ok = has.any(axis=1)
    sel = np.arange(len(rows))
    tokens[rows[ok]] = si[sel, j][ok]
    token_val[rows[ok]] = rec["stair_val"][sel, j, 0][ok]
    return ok


def _combine_top_k(rec, rows, temp, zmax, top_k, top_p, lmp, keys, tokens, token_val):
    """Top-k rows (with top-p / min-p): the merged lists' first k, filtered, best score.
    Returns which rows it decided (the others take :func:`_candidates`)."""
    m, tp = rec.shape
    n_list = (rec["flags"] >> _LIST_SHIFT) & 0xFF
    cap = rec["list_val"].shape[-1]
    used = np.arange(cap)[None, None, :] < n_list[:, :, None]
    vals = rec["list_val"].reshape(m, tp * cap)
    ids = rec["list_id"].reshape(m, tp * cap).astype(np.int64)
    mk = np.where(used.reshape(m, tp * cap), _desc_keys(vals, ids), _MAX_KEY)
    order = np.argsort(mk, axis=1, kind="stable")
    k = top_k[rows]
    kk = int(k.max())
    order = order[:, :kk]
    valid = (np.take_along_axis(mk, order, axis=1) != _MAX_KEY) & (np.arange(kk) < k[:, None])
    vals = np.take_along_axis(vals, order, axis=1)
    ids = np.take_along_axis(ids, order, axis=1)
    t = temp[rows]
    with np.errstate(over="ignore", invalid="ignore"):
        z = vals / t[:, None]
    z = np.where(valid, z, np.float32(-np.inf))
    r, c = np.nonzero(valid)
    score = np.full((m, kk), -np.inf, np.float32)
    score[r, c] = z[r, c] + _noise(keys[rows][r], ids[r, c])
    mp = lmp[rows]
    thr_z = np.where(mp != 0, (zmax[rows] + mp).astype(np.float32), np.float32(-np.inf))
    with np.errstate(invalid="ignore"):
        kept = valid & (z >= thr_z[:, None])
    p = top_p[rows]
    pr = np.flatnonzero(p < 1)
    if len(pr):
        before = prefix_masses(z[pr], valid[pr])
        threshold = top_p_threshold(p[pr], before[:, -1])
        kept[pr] &= before[:, :-1] < threshold[:, None]
    ms = np.where(kept, score, np.float32(-np.inf))
    best = ms.max(axis=1)
    big = np.int64(np.iinfo(np.int64).max)
    j = np.argmin(np.where(kept & (ms == best[:, None]), ids, big), axis=1)
    ok = kept.any(axis=1) & np.isfinite(best)
    sel = np.arange(m)
    tokens[rows[ok]] = ids[sel, j][ok]
    token_val[rows[ok]] = vals[sel, j][ok]
    return ok


def _candidates(
    r: np.ndarray,
    t: np.float32,
    zmax: np.float32,
    k: int,
    p: np.float32,
    mp: np.float32,
    lmp: np.float32,
    key: np.uint64,
) -> Pending:
    """The candidates of one sampled, non-degenerate row from its ``tp`` records, in the
    order the token is chosen, with what is known about each."""
    n_list = (r["flags"] >> _LIST_SHIFT) & 0xFF
    vals = np.concatenate([r["list_val"][s, :n] for s, n in enumerate(n_list)])
    ids = np.concatenate([r["list_id"][s, :n] for s, n in enumerate(n_list)]).astype(np.int64)
    order = np.lexsort((ids, -vals))
    vals, ids = vals[order], ids[order]
    with np.errstate(over="ignore", invalid="ignore"):
        z = vals / t
    score = z + gumbel_noise(key, ids)
    thr_z = np.float32(zmax + lmp) if mp > 0 else np.float32(-np.inf)
    top = float(mass_terms(np.array([zmax], np.float32))[0][0])
    threshold = 0

    if k:  # the merged lists hold the row's first k columns: everything is exact
        vals, ids, z, score = vals[:k], ids[:k], z[:k], score[:k]
        kept = z >= thr_z
        if p < 1:
            before = _merged_prefix(z)
            threshold = int(top_p_threshold(np.array([p]), before[-1:])[0])
            kept &= before[:-1] < threshold
        state = np.where(kept, KEPT, -1)
        return _walk(score, ids, vals, state, threshold, top)

    has_rtop = r["rtop_id"] != NO_ID
    if has_rtop.any():
        u = _best(r["rtop_val"][has_rtop], r["rtop_id"][has_rtop])
        uv, ui = r["rtop_val"][has_rtop][u], int(r["rtop_id"][has_rtop][u])
        complete = (vals > uv) | ((vals == uv) & (ids < ui))
    else:
        uv, ui = np.float32(-np.inf), -1
        complete = np.ones(len(vals), bool)
    n_cp = int(complete.sum())  # the complete prefix is a prefix of the merged order
    state = np.where(z >= thr_z, KEPT, -1)
    tail_dropped = False  # no column after the complete prefix is in the nucleus
    extra: list[tuple[np.float32, int, np.float32, int]] = []  # (score, id, val, state)
    if p < 1:
        before = _merged_prefix(z)
        threshold = int(top_p_threshold(np.array([p]), np.array([_shard_total(r, zmax)]))[0])
        state[:n_cp] = np.where(before[:n_cp] < threshold, state[:n_cp], -1)
        tail_dropped = bool(before[n_cp] >= threshold)
        state[n_cp:] = np.where(state[n_cp:] == KEPT, -1 if tail_dropped else PROBE, -1)
        if not tail_dropped and ui >= 0 and np.float32(uv / t) >= thr_z:
            # the best unsent column: everything before it is known, so it is in the nucleus
            extra.append((np.float32(np.float32(uv / t) + gumbel_noise(key, ui)), ui, uv, KEPT))

    # each shard's best columns outside its list: its staircase
    n_stair = (r["flags"] >> _STAIR_SHIFT) & 0xFF
    for s in range(len(r)):
        ns = int(n_stair[s])
        if ns == 0 or tail_dropped:
            continue
        sv, ss, si = r["stair_val"][s, :ns], r["stair_score"][s, :ns], r["stair_id"][s, :ns]
        with np.errstate(over="ignore", invalid="ignore"):
            inside = np.flatnonzero((sv / t) >= thr_z)
        with np.errstate(over="ignore", invalid="ignore"):
            unseen = bool(r["flags"][s] & FLAG_STAIR_CUT) and (r["rtop_val"][s] / t) >= thr_z
        if p < 1:  # every entry inside min-p may be the shard's best kept column
            extra += [(ss[j], int(si[j]), sv[j], PROBE) for j in inside if int(si[j]) != ui]
            if unseen:  # unseen columns rank after the last entry
                extra.append((ss[-1], int(si[-1]), np.float32(np.nan), UNKNOWN))
        elif len(inside):  # the first entry inside min-p is the shard's best kept column
            j = int(inside[0])
            extra.append((ss[j], int(si[j]), sv[j], KEPT))
        elif unseen:
            extra.append((ss[-1], int(si[-1]), np.float32(np.nan), UNKNOWN))
    if extra:
        score = np.concatenate([score, np.array([e[0] for e in extra], np.float32)])
        ids = np.concatenate([ids, np.array([e[1] for e in extra], np.int64)])
        vals = np.concatenate([vals, np.array([e[2] for e in extra], np.float32)])
        state = np.concatenate([state, np.array([e[3] for e in extra])])
    return _walk(score, ids, vals, state, threshold, top)


def _walk(
    score: np.ndarray,
    ids: np.ndarray,
    vals: np.ndarray,
    state: np.ndarray,
    threshold: int,
    top: float,
) -> Pending:
    """The live candidates (state >= 0) in (score desc, id asc, state) order, cut after
    the first ``KEPT`` or ``UNKNOWN`` one."""
    live = np.flatnonzero(state >= 0)
    order = live[np.lexsort((state[live], ids[live], -score[live]))]
    st = state[order]
    stop = np.flatnonzero(st != PROBE)
    end = int(stop[0]) + 1 if len(stop) else len(order)
    order = order[:end]
    return Pending(
        score[order], ids[order], vals[order], state[order].astype(np.int8), threshold, top
    )


def _merged_prefix(z: np.ndarray) -> np.ndarray:
    """Exclusive prefix masses (and the total) of merged columns in key order, with the
    exponent groups taken relative to the first column (the row's maximum)."""
    return prefix_masses(z[None, :], np.ones((1, len(z)), bool))[0]


def _shard_total(r: np.ndarray, zmax: np.float32) -> int:
    """The row's total mass ``W`` from the shards' group sums, aligned to the row's top
    group: exact integer addition, then one truncation per group."""
    top = mass_terms(np.array([zmax], np.float32))[0][0]
    sums = np.zeros(MASS_GROUPS, np.int64)
    for s in range(len(r)):
        g = r["mass_group"][s]
        if not np.isfinite(g):
            continue
        shift = int(top - g)
        if shift < MASS_GROUPS:
            sums[shift:] += r["mass"][s, : MASS_GROUPS - shift]
    return int(group_mass(sums))


def probe_dtype(probe_cap: int = PROBE_CAP) -> np.dtype:
    """The second-round record of one row from one shard: ``mass[j, d]`` is the sum of
    the mass mantissas of the shard's columns that precede probe ``j`` in key order and
    lie in exponent group ``top_group - d`` (``probe_cap * 7`` int64: 896 bytes)."""
    return np.dtype([("mass", "<i8", (probe_cap, MASS_GROUPS))])


def probe_records(
    local_logits: np.ndarray,
    *,
    shard: int,
    dtype: str,
    params: VerifyParams,
    pending: dict[int, Pending],
) -> np.ndarray:
    """The second round of one shard: for each pending row, the masses before each probe.

    Parameters
    ----------
    local_logits : ``[pad_bs * N, V / tp]``
        The shard's columns, as for :func:`shard_records`.
    shard : int
    dtype : str
    params : VerifyParams
    pending : dict of int to Pending
        :attr:`Combined.pending` (identical on every rank).

    Returns
    -------
    ``probe_dtype()`` array ``[len(pending)]``, rows in the order of ``sorted(pending)``
    """
    width = int(local_logits.shape[1])
    base = shard * width
    n_valid = max(0, min(width, params.vocab_limit - base))
    rows = sorted(pending)
    out = np.zeros(len(rows), dtype=probe_dtype())
    if n_valid == 0:
        return out
    temp = params.per_row(params.temperature)
    ids = base + np.arange(n_valid)
    for i, row in enumerate(rows):
        walk = pending[row]
        x = as_float32(np.asarray(local_logits)[row : row + 1, :n_valid], dtype)[0]
        x = np.where(np.isnan(x), np.float32(-np.inf), x)
        with np.errstate(over="ignore", invalid="ignore"):
            grp, a = mass_terms(x / temp[row])
            d = walk.top_group - grp
        for j, c in enumerate(walk.probes):
            pv, pid = walk.vals[c], walk.ids[c]
            before = (x > pv) | ((x == pv) & (ids < pid))
            for g in range(MASS_GROUPS):
                out["mass"][i, j, g] = int(a[before & (d == g)].sum())
    return out


def combine_probes(
    pending: dict[int, Pending], probes: Sequence[np.ndarray]
) -> dict[int, tuple[int, np.float32] | None]:
    """Close pending rows with every shard's second-round record.

    Parameters
    ----------
    pending : dict of int to Pending
    probes : sequence of tp arrays from :func:`probe_records`

    Returns
    -------
    dict of row to (token, raw logit), or None for a row that still needs its full logits
    """
    rows = sorted(pending)
    total = np.sum([np.asarray(p)["mass"] for p in probes], axis=0)  # [rows, cap, groups]
    out: dict[int, tuple[int, np.float32] | None] = {}
    for i, row in enumerate(rows):
        walk = pending[row]
        before = group_mass(total[i, : len(walk.probes)])
        out[row] = walk.resolve(before)
    return out


def sharded_tokens(
    inputs: Sequence[np.ndarray],
    *,
    dtype: str,
    params: VerifyParams,
    list_cap: int = LIST_CAP,
    stair_cap: int = STAIR_CAP,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokens of the real rows: records + combine (round 1), probes (round 2, rows left
    open), the row's full logits (the rest).

    Returns
    -------
    tokens : int32 ``[bs * N]``
    logprobs : float32 ``[bs * N]``
    rounds : int8 ``[bs * N]``
        1, 2 or 3: the round that decided the row (3: the full-row fallback).
    """
    tp = len(inputs)
    records = [
        shard_records(
            inputs[s],
            shard=s,
            tp=tp,
            dtype=dtype,
            params=params,
            list_cap=list_cap,
            stair_cap=stair_cap,
        )
        for s in range(tp)
    ]
    comb = combine_records(records, params, stair_cap=stair_cap)
    tokens = comb.tokens.copy()
    token_val = comb.token_val.copy()
    rounds = np.ones(len(tokens), np.int8)
    left: list[int] = []
    if comb.pending:
        answers = combine_probes(
            comb.pending,
            [
                probe_records(inputs[s], shard=s, dtype=dtype, params=params, pending=comb.pending)
                for s in range(tp)
            ],
        )
        for row, win in answers.items():
            if win is None:
                left.append(row)
                rounds[row] = 3
            else:
                tokens[row], token_val[row] = win
                rounds[row] = 2
    if left:  # the exact fallback: these rows' full logits
        rows = np.array(left)
        full = np.concatenate([np.asarray(x)[rows] for x in inputs], axis=1)
        tokens[rows], token_val[rows] = full_row_tokens(full, rows, dtype=dtype, params=params)
    return tokens, comb.logprobs(token_val), rounds


def full_row_tokens(
    full: np.ndarray, rows: np.ndarray, *, dtype: str, params: VerifyParams
) -> tuple[np.ndarray, np.ndarray]:
    """The exact fallback (round 3): rows sampled from their full logits.

    Parameters
    ----------
    full : ``[len(rows), V]`` (bfloat16 as uint16 bits, float16, float32)
        The rows' logits, every shard's columns side by side (at least the first
        ``vocab_limit``).
    rows : int ``[len(rows)]``
        Their row indices ``req * N + d`` (they pick the per-row parameters).
    dtype : str
    params : VerifyParams

    Returns
    -------
    tokens : int32 ``[len(rows)]``
    token_val : float32 ``[len(rows)]``
        The tokens' raw logits (for :meth:`Combined.logprobs`).
    """
    rows = np.asarray(rows, dtype=np.int64)
    x = as_float32(np.asarray(full)[:, : params.vocab_limit], dtype)
    per = params.per_row
    tok = sample_full_rows(
        x,
        temperature=per(params.temperature)[rows],
        top_k=per(params.top_k)[rows],
        top_p=per(params.top_p)[rows],
        min_p=per(params.min_p)[rows],
        greedy=params.greedy_rows[rows],
        stream_key=params.stream_keys[rows],
    )
    return tok, x[np.arange(len(rows)), tok]


def verify_batch_vocab_sharded(
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
    list_cap: int = LIST_CAP,
    stair_cap: int = STAIR_CAP,
) -> tuple[np.ndarray, ...]:
    """``verify_batch_vocab`` computed the sharded way: records, combine, probes, fallback.

    Parameters and returns as :func:`ipc_dpsample.layout.reference_verify_batch_vocab`
    (``list_cap``/``stair_cap``: the record's capacities). Tokens, ``accept_index`` and
    ``accept_length`` equal the reference's bit for bit; logprobs are assembled from the
    shards' (max, sum-exp) partials and agree with the full-row float64 value to within
    one float32 ulp.
    """
    if len(inputs) != tp:
        raise ValueError(f"got {len(inputs)} inputs, expected tp={tp}")
    n = check_candidates(candidates, pad_bs)
    if tp < 1 or pad_bs % tp:
        raise ValueError(f"pad_bs={pad_bs} must be a positive multiple of tp={tp}")
    shard = int(np.asarray(inputs[0]).shape[1]) if np.asarray(inputs[0]).ndim == 2 else -1
    for s, x in enumerate(inputs):
        check_logits(f"inputs[{s}]", np.asarray(x), dtype, (pad_bs * n, shard))
    params = verify_params(
        pad_bs=pad_bs,
        num_tokens_per_req=n,
        vocab_size=tp * shard,
        temperature=temperature,
        seed=seed,
        offset=offset,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        vocab_limit=vocab_limit,
        bs=bs,
    )
    tokens, lps, _ = sharded_tokens(
        inputs, dtype=dtype, params=params, list_cap=list_cap, stair_cap=stair_cap
    )
    return finish_verify(candidates, tokens, params, tp, lps if return_logprobs else None)

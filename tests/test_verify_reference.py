"""The NumPy reference of ``verify_batch_vocab`` (the executable spec): the noise (Philox
against published known answers, Triton's packing), the deterministic float functions,
the sampler's distribution (chi-square over 10**5 draws, with negative controls), the
accept chain, the special rows and the validation errors."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from ipc_dpsample.layout import (
    MASS_GROUPS,
    TOP_K_DISABLED,
    TRITON_UNIFORM_SCALE,
    accept_chain,
    det_exp2_frac,
    det_log,
    group_mass,
    gumbel_noise,
    mass_terms,
    noise_stream_key,
    philox4x32_10,
    reference_argmax_batch_vocab,
    reference_verify_batch_vocab,
    reference_verify_rows,
    sample_full_rows,
    top_p_threshold,
    uniform_from_uint32,
)

M32 = 0xFFFFFFFF
M64 = (1 << 64) - 1
PI32 = ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0))
#: noise_stream_key of (seed, offset) = (42, 1000), (-1, 2**63 - 1), (2**62, -5), and the
#: float32 bits of gumbel_noise of the first at ids 0, 1, 151935
PINNED_KEYS = [0xC7F39578, 0x7B2535F5, 0xC253FEF0]
PINNED_NOISE = [1078318802, 3204739184, 1065334277]


# -- the noise --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("counter", "key", "want"),
    [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((M32,) * 4, (M32,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (*PI32, (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ],
)
def test_philox4x32_10_matches_random123_known_answers(counter, key, want) -> None:
    got = philox4x32_10(counter, key)
    assert tuple(int(w) for w in got) == want
    assert all(w.dtype == np.uint32 for w in got)


def test_philox_is_vectorised_and_counter_sensitive() -> None:
    ids = np.arange(1000, dtype=np.uint64)
    x0 = philox4x32_10((ids, 0, 0, 0), (5, 7))[0]
    assert x0.shape == (1000,)
    assert len(np.unique(x0)) == 1000
    assert int(x0[3]) == int(philox4x32_10((3, 0, 0, 0), (5, 7))[0])


def test_triton_seed_offset_packing() -> None:
    """``tl.randint(seed, offset)`` with int64 scalars runs Philox4x32-10 on counter
    (offset & 0xffffffff, offset >> 32, 0, 0), key (seed & 0xffffffff, seed >> 32) and
    keeps word 0, a 32-bit value; ``tl.rand(key, ids)`` runs Philox4x32-10 on counter
    (id, 0, 0, 0), key (key, 0) (Triton 3.x ``randint4x``; tests/test_triton_parity_gpu.py
    checks it against Triton itself)."""
    seed = np.array([42, -1, 2**62], np.int64)
    off = np.array([1000, 2**63 - 1, -5], np.int64)
    key = noise_stream_key(seed, off)
    assert key.dtype == np.uint64
    for i in range(3):
        o, sd = int(off[i]) & M64, int(seed[i]) & M64
        want = philox4x32_10((o & M32, o >> 32, 0, 0), (sd & M32, sd >> 32))[0]
        assert int(key[i]) == int(want) < 2**32
    # the high counter word counts: offsets 2**32 apart differ
    assert noise_stream_key(seed[:1], off[:1] + 2**32)[0] != key[0]
    ids = np.array([0, 1, 151935])
    g = gumbel_noise(key[0], ids)
    x0 = philox4x32_10((ids.astype(np.uint64), 0, 0, 0), (int(key[0]), 0))[0]
    u = uniform_from_uint32(x0).astype(np.float64)
    np.testing.assert_array_equal(g, (-np.log(-np.log(u))).astype(np.float32))
    # pinned: a change of the stream shows here
    assert [int(k) for k in key] == PINNED_KEYS
    assert g.view(np.uint32).tolist() == PINNED_NOISE


def test_uniform_conversion_matches_triton_uint_to_uniform_float() -> None:
    x = np.array([0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0x40000000], np.uint64)
    u = uniform_from_uint32(x.astype(np.uint32))
    top = np.float32(np.float32(2**31) * TRITON_UNIFORM_SCALE)
    assert u.dtype == np.float32
    assert u.tolist() == [
        np.float32(1e-7),  # 0 * scale, clamped
        np.float32(1e-7),
        top,  # int32 max rounds to 2**31 in float32
        top,  # int32 min -> -x - 1 = int32 max
        np.float32(1e-7),  # -1 -> 0
        np.float32(np.float32(2**30) * TRITON_UNIFORM_SCALE),
    ]
    assert top < 1.0
    rng = np.random.default_rng(0)
    many = uniform_from_uint32(rng.integers(0, 2**32, 10**5).astype(np.uint32))
    assert many.min() >= np.float32(1e-7) and many.max() < 1.0
    assert abs(many.mean() - 0.5) < 0.01


def test_deterministic_log_and_exp2_are_accurate() -> None:
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.uniform(1e-7, 1.0, 10**5), rng.uniform(1.0, 20.0, 10**5), [1.0, 0.5]])
    ulps = np.abs(det_log(x) - np.log(x)) / np.spacing(np.maximum(np.abs(np.log(x)), 1e-300))
    assert np.all(ulps[x != 1.0] <= 3)
    assert det_log(np.array([1.0]))[0] == 0.0
    f = rng.uniform(0.0, 1.0, 10**5)
    assert np.max(np.abs(det_exp2_frac(f) - np.exp2(f)) / np.spacing(np.exp2(f))) <= 4
    # the float32 noise agrees with libm's float64 formula except at rare rounding ties
    u = uniform_from_uint32(rng.integers(0, 2**32, 10**6).astype(np.uint32)).astype(np.float64)
    ours = (-det_log(-det_log(u))).astype(np.float32)
    libm = (-np.log(-np.log(u))).astype(np.float32)
    assert np.count_nonzero(ours != libm) <= 5


def test_gumbel_noise_is_standard_gumbel() -> None:
    g = gumbel_noise(noise_stream_key(np.array([3]), np.array([0])), np.arange(2 * 10**5))
    assert abs(g.mean() - np.euler_gamma) < 0.01
    assert abs(g.std() - math.pi / math.sqrt(6)) < 0.01


def test_mass_terms_are_exp_in_fixed_point() -> None:
    z = np.array([0.0, 1.0, -3.5, 20.25, -60.0, 5.545, -np.inf], np.float32)
    grp, a = mass_terms(z)
    finite = np.isfinite(z)
    approx = a[finite] * np.exp2(8 * grp[finite] - 24)
    np.testing.assert_allclose(approx, np.exp(z[finite].astype(np.float64)), rtol=2**-23)
    assert np.all((a[finite] >= 2**24) & (a[finite] < 2**33))
    assert grp[-1] == -np.inf and a[-1] == 0
    assert grp[0] == 0 and a[0] == 2**24  # exp(0) = 2**24 * 2**(0 - 24)
    sums = np.array([[5, 256, 2**16, 0, 0, 0, 2**48 + 7]], np.int64)
    assert group_mass(sums).tolist() == [5 + 1 + 1 + 1]
    assert MASS_GROUPS == 7


@pytest.mark.parametrize("p", [0.9, 0.95, 0.3, 1.0, 1e-30, 0.5])
def test_top_p_threshold_is_the_exact_ceiling(p: float) -> None:
    p32 = np.float32(p)
    for total in (1, 2**24, 2**53 - 1, 123456789012345):
        want = math.ceil(Fraction(float(p32)) * total)
        assert top_p_threshold(np.array([p32]), np.array([total], np.int64))[0] == want


# -- the sampler's distribution ---------------------------------------------------------
DRAWS = 100_000
LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 3.0, 0.25, -2.0, 1.25, -0.25], np.float32)


def _filtered(
    logits: np.ndarray, t: float, k: int = 0, p: float = 1.0, mp: float = 0.0, strict=True
):
    """The filtered distribution by an independent float64 computation (no fixed point,
    no shared code with the reference); ``strict``: no boundary too close to call."""
    z = logits.astype(np.float64) / t
    order = np.argsort(-logits, kind="stable")
    keep = np.ones(len(z), bool)
    if k:
        keep[order[k:]] = False
    probs = np.exp(z - z.max()) * keep
    probs /= probs.sum()
    if p < 1:
        before = np.cumsum(probs[order]) - probs[order]
        assert not strict or np.all(np.abs(before - p) > 1e-3), "a boundary too close to call"
        keep[order[before >= p]] = False
    if mp > 0:
        ratio = np.exp(z - z.max())
        assert not strict or np.all(np.abs(ratio - mp) > 1e-3)
        keep &= ratio >= mp
    out = np.exp(z - z.max()) * keep
    return out / out.sum()


def _draw(logits: np.ndarray, t: float, k: int = 0, p: float = 1.0, mp: float = 0.0, seed=7):
    keys = noise_stream_key(np.full(DRAWS, seed, np.int64), np.arange(DRAWS, dtype=np.int64))
    tok = sample_full_rows(
        np.tile(logits, (DRAWS, 1)),
        temperature=np.full(DRAWS, t, np.float32),
        top_k=np.full(DRAWS, k),
        top_p=np.full(DRAWS, p, np.float32),
        min_p=np.full(DRAWS, mp, np.float32),
        greedy=np.zeros(DRAWS, bool),
        stream_key=keys,
    )
    return np.bincount(tok, minlength=len(logits))


def _chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """Pearson's statistic and its critical value at significance 1e-6 (Wilson-Hilferty);
    a count where the distribution has no mass makes the statistic infinite."""
    n = counts.sum()
    if np.any(counts[probs == 0] > 0):
        return math.inf, 0.0
    live = probs > 0
    stat = float((((counts[live] - n * probs[live]) ** 2) / (n * probs[live])).sum())
    df = int(live.sum()) - 1
    z = 4.753  # one-sided 1e-6 quantile of the standard normal
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3 if df > 0 else 0.0
    return stat, crit


FILTERS = [
    pytest.param(dict(t=0.7), id="temperature"),
    pytest.param(dict(t=1.3, k=4), id="top_k"),
    pytest.param(dict(t=1.0, k=6, p=0.8), id="top_k+top_p"),
    pytest.param(dict(t=0.7, p=0.7), id="top_p"),
    pytest.param(dict(t=1.0, mp=0.1), id="min_p"),
    pytest.param(dict(t=1.3, p=0.7, mp=0.05), id="top_p+min_p(top_p binds)"),
    pytest.param(dict(t=1.3, p=0.93, mp=0.2), id="top_p+min_p(min_p binds)"),
]


@pytest.mark.parametrize("cfg", FILTERS)
def test_sampled_tokens_follow_the_filtered_softmax(cfg: dict) -> None:
    counts = _draw(LOGITS, **cfg)
    stat, crit = _chi2(counts, _filtered(LOGITS, **cfg))
    assert stat < crit, (stat, crit, counts)
    # negative controls: the same draws against a wrong distribution must be rejected
    wrong = [("temperature", dict(cfg, t=1.0 if cfg["t"] != 1.0 else 0.7))]
    wrong += [
        (f, dict(cfg, **{f: off})) for f, off in (("k", 0), ("p", 1.0), ("mp", 0.0)) if f in cfg
    ]
    checked = 0
    for what, bad in wrong:
        if np.array_equal(_filtered(LOGITS, **bad, strict=False), _filtered(LOGITS, **cfg)):
            continue  # a filter that another one contains changes nothing
        stat_w, crit_w = _chi2(counts, _filtered(LOGITS, **bad, strict=False))
        assert stat_w > crit_w, f"ignoring {what} went unnoticed"
        checked += 1
    assert checked >= min(2, len(wrong))


def test_accept_lengths_follow_the_product_of_target_probabilities() -> None:
    """Sample, then match: draft ``i`` is accepted with the target probability of the
    draft at row ``i - 1``, given the earlier ones were; after a rejection the emitted
    token follows the target distribution without the rejected draft."""
    n, v, reqs = 4, 8, 50_000
    rng = np.random.default_rng(11)
    rows = rng.normal(0, 1.2, (n, v)).astype(np.float32)
    t, k = 1.0, 6
    q = [_filtered(rows[d], t, k=k) for d in range(n)]
    drafts = [int(np.argsort(-q[d])[1]) for d in range(n - 1)]  # each row's second choice
    logits = np.tile(rows, (reqs, 1))
    cand = np.zeros((reqs, n), np.int32)
    cand[:, 1:] = drafts
    pred, acc_idx, acc_len = reference_verify_rows(
        logits,
        cand,
        tp=1,
        dtype="float32",
        temperature=np.full(reqs, t, np.float32),
        seed=np.full(reqs, 99, np.int64),
        offset=np.arange(reqs, dtype=np.int64) * n,  # disjoint streams
        top_k=np.full(reqs, k, np.int32),
    )
    qd = [q[d][drafts[d]] for d in range(n - 1)]
    want = [1 - qd[0], qd[0] * (1 - qd[1]), qd[0] * qd[1] * (1 - qd[2]), qd[0] * qd[1] * qd[2]]
    counts = np.bincount(acc_len, minlength=n + 1)[1:]
    stat, crit = _chi2(counts, np.array(want))
    assert stat < crit, (counts, np.array(want) * reqs)
    uniform = np.full(n, 1 / n)  # negative control
    assert _chi2(counts, uniform)[0] > _chi2(counts, uniform)[1]
    # the token after a rejection at the first draft: q0 without the draft, renormalised
    bonus = np.bincount(pred[acc_len == 1, 0], minlength=v)
    resid = q[0].copy()
    resid[drafts[0]] = 0
    stat, crit = _chi2(bonus, resid / resid.sum())
    assert stat < crit
    assert _chi2(bonus, q[0])[0] > _chi2(bonus, q[0])[1]
    # the accept convention of the accepted prefix
    for r in range(0, reqs, 997):
        a = int(acc_len[r]) - 1
        assert acc_idx[r, : a + 1].tolist() == [r * n + j for j in range(a + 1)]
        assert (acc_idx[r, a + 1 :] == -1).all()
        assert pred[r, :a].tolist() == drafts[:a]


# -- the contract on special rows -------------------------------------------------------
def _verify(x: np.ndarray, **kw):
    rows = x.shape[0]
    kw.setdefault("temperature", np.full(rows, 1.0, np.float32))
    kw.setdefault("seed", np.arange(rows, dtype=np.int64))
    kw.setdefault("offset", np.zeros(rows, np.int64))
    pred, _, _ = reference_verify_rows(
        x, np.zeros((rows, 1), np.int32), tp=1, dtype="float32", **kw
    )
    return pred[:, 0]


def test_greedy_rows_are_argmax_batch_vocabs_token() -> None:
    """Temperature below 1e-6 (float32 compare) or top-k 1: the first maximum."""
    rng = np.random.default_rng(2)
    x = rng.normal(0, 1, (64, 40)).astype(np.float32)
    x[::7, 3] = x[::7].max(axis=1) + 1  # a clear winner
    x[1, [5, 9]] = 50.0  # a tie: the lower index
    want = np.argmax(x, axis=1)
    for temp in (0.0, 9.9e-7):
        got = _verify(x, temperature=np.full(64, temp, np.float32))
        np.testing.assert_array_equal(got, want)
    got = _verify(x, top_k=np.full(64, 1, np.int32), temperature=np.full(64, 1.5, np.float32))
    np.testing.assert_array_equal(got, want)
    sampled = _verify(x, temperature=np.full(64, 1e-6, np.float32) * 2e5)  # not greedy
    assert (sampled != want).any()
    # the same token as the argmax reference of the shards
    ((ids, _),) = reference_argmax_batch_vocab(
        [x], tp=1, num_tokens_per_req=64, pad_bs=1, dtype="float32"
    )
    np.testing.assert_array_equal(_verify(x, temperature=np.zeros(64, np.float32)), ids)


def test_special_rows_follow_the_argmax_rule_when_sampled() -> None:
    inf, nan = np.inf, np.nan
    x = np.array(
        [
            [0, 1, nan, 2, nan],  # a NaN: the first NaN, whatever the mode
            [0, inf, 1, inf, 0],  # +inf: the first +inf
            [-inf] * 5,  # only -inf: column 0
            [3e38, 1e38, 0, 0, 2e38],  # z overflows at temperature 0.5: the argmax
            [-inf, 1, -inf, -inf, 0.5],  # -inf columns never win
        ],
        np.float32,
    )
    for kw in (
        {},
        {"top_k": np.full(5, 3, np.int32)},
        {"top_p": np.full(5, 0.5, np.float32)},
        {"min_p": np.full(5, 0.1, np.float32)},
    ):
        got = _verify(x, temperature=np.full(5, 0.5, np.float32), **kw)
        assert got[:4].tolist() == [2, 1, 0, 0], kw
        assert got[4] in (1, 4)


def test_vocab_limit_columns_never_win_and_never_count() -> None:
    rng = np.random.default_rng(3)
    x = rng.normal(0, 1, (200, 30)).astype(np.float32)
    x[:, 20:] = 30.0
    for kw in ({}, {"top_p": np.full(200, 0.9, np.float32)}, {"top_k": np.full(200, 5, np.int32)}):
        got = _verify(x, vocab_limit=20, **kw)
        assert got.max() < 20
        # identical to the row cut at the limit (the tail's columns count nowhere)
        np.testing.assert_array_equal(got, _verify(np.ascontiguousarray(x[:, :20]), **kw))


def test_accept_chain_numbers_rows_of_the_owning_rank() -> None:
    sampled = np.array([[5, 6, 7], [1, 2, 3], [4, 4, 4], [9, 8, 7]], np.int32)
    cand = np.array([[0, 5, 6], [0, 1, 9], [0, 3, 4], [0, 9, 8]], np.int32)
    pred, idx, length = accept_chain(cand, sampled, reqs_per_rank=2)
    np.testing.assert_array_equal(pred, sampled)
    assert length.tolist() == [3, 2, 1, 3]
    # rank 0 owns requests 0, 1 (rows 0..5), rank 1 requests 2, 3 (its rows 0..5 again)
    assert idx.tolist() == [[0, 1, 2], [3, 4, -1], [0, -1, -1], [3, 4, 5]]
    _, idx1, _ = accept_chain(cand, sampled, reqs_per_rank=4)  # tp = 1: global rows
    assert idx1.tolist() == [[0, 1, 2], [3, 4, -1], [6, -1, -1], [9, 10, 11]]
    # a mismatch stops the chain even if a later draft matches
    cand2 = np.array([[0, 4, 6]], np.int32)
    assert accept_chain(cand2, sampled[:1], 1)[2].tolist() == [1]


def test_logprobs_are_log_softmax_of_the_raw_logits() -> None:
    import torch

    rng = np.random.default_rng(4)
    pad_bs, n, v = 6, 3, 50
    x = (rng.normal(0, 3, (pad_bs * n, v))).astype(np.float32)
    x[2, 7] = np.nan
    x[4] = -np.inf
    cand = rng.integers(0, v, (pad_bs, n)).astype(np.int32)
    pred, _, _, lp = reference_verify_rows(
        x,
        cand,
        tp=2,
        dtype="float32",
        temperature=np.full(pad_bs, 0.6, np.float32),  # logprobs ignore the temperature
        seed=np.arange(pad_bs, dtype=np.int64),
        offset=np.zeros(pad_bs, np.int64),
        top_k=np.full(pad_bs, 7, np.int32),
        return_logprobs=True,
        vocab_limit=45,
    )
    full = torch.log_softmax(torch.from_numpy(x[:, :45]), dim=1)
    want = full.gather(1, torch.from_numpy(pred.reshape(-1, 1).astype(np.int64)))[:, 0].numpy()
    got = lp.reshape(-1)
    assert np.isnan(got[2]) and np.isnan(got[4])
    ok = np.ones(len(got), bool)
    ok[[2, 4]] = False
    np.testing.assert_allclose(got[ok], want[ok], atol=1e-5)


def test_phantom_requests_are_not_computed() -> None:
    rng = np.random.default_rng(5)
    pad_bs, n, v = 4, 2, 16
    x = rng.normal(0, 1, (pad_bs * n, v)).astype(np.float32)
    top_k = np.array([3, 2, 500, -7], np.int32)  # garbage in the phantom request only
    kw = dict(
        tp=2,
        dtype="float32",
        temperature=np.array([1, 0.5, 0, -1], np.float32),
        seed=np.zeros(pad_bs, np.int64),
        offset=np.zeros(pad_bs, np.int64),
        top_k=top_k,
        return_logprobs=True,
    )
    pred, idx, length, lp = reference_verify_rows(x, np.zeros((pad_bs, n), np.int32), bs=3, **kw)
    assert (pred[3] == 0).all() and (idx[3] == -1).all() and length[3] == 0
    assert np.isnan(lp[3]).all()
    assert (length[:3] >= 1).all()
    full, *_ = reference_verify_rows(
        x,
        np.zeros((pad_bs, n), np.int32),
        bs=3,
        **dict(kw, top_k=np.array([3, 2, 500, 1], np.int32)),
    )
    np.testing.assert_array_equal(pred[:3], full[:3])


def test_shards_entry_equals_the_full_row_entry() -> None:
    rng = np.random.default_rng(6)
    tp, pad_bs, n, vs = 4, 8, 2, 13
    full = rng.normal(0, 2, (pad_bs * n, tp * vs)).astype(np.float32)
    bits = (full.view(np.uint32) >> 16).astype(np.uint16)  # bfloat16 as its bits
    shards = [np.ascontiguousarray(bits[:, s * vs : (s + 1) * vs]) for s in range(tp)]
    kw = dict(
        dtype="bfloat16",
        temperature=rng.uniform(0.5, 1.5, pad_bs).astype(np.float32),
        seed=rng.integers(0, 2**40, pad_bs),
        offset=rng.integers(0, 2**20, pad_bs),
        top_p=np.full(pad_bs, 0.9, np.float32),
        vocab_limit=tp * vs - 3,
    )
    cand = rng.integers(0, tp * vs, (pad_bs, n)).astype(np.int32)
    a = reference_verify_batch_vocab(shards, cand, tp=tp, pad_bs=pad_bs, **kw)
    b = reference_verify_rows(bits, cand, tp=tp, **kw)
    for u, w in zip(a, b, strict=True):
        np.testing.assert_array_equal(u, w)


def test_realistic_vocabulary_takes_milliseconds_per_row() -> None:
    import time

    rng = np.random.default_rng(7)
    pad_bs, n, v = 4, 2, 152064
    x = (rng.standard_normal((pad_bs * n, v), np.float32) * 2.5).astype(np.float32)
    t0 = time.perf_counter()
    pred, *_ = reference_verify_rows(
        x,
        np.zeros((pad_bs, n), np.int32),
        tp=1,
        dtype="float32",
        temperature=np.array([0.7, 1.0, 0, 0.8], np.float32),
        seed=np.arange(pad_bs, dtype=np.int64),
        offset=np.zeros(pad_bs, np.int64),
        top_k=np.array([0, 50, 0, 0], np.int32),
        top_p=np.array([0.95, 0.9, 1, 1], np.float32),
        min_p=np.array([0, 0, 0, 0.05], np.float32),
    )
    per_row = (time.perf_counter() - t0) / (pad_bs * n)
    assert per_row < 0.5, f"{per_row:.3f} s per row"
    assert pred.max() < v


# -- validation -------------------------------------------------------------------------
def _kw(pad_bs: int = 2, **over):
    kw = dict(
        tp=1,
        dtype="float32",
        temperature=np.ones(pad_bs, np.float32),
        seed=np.zeros(pad_bs, np.int64),
        offset=np.zeros(pad_bs, np.int64),
    )
    kw.update(over)
    return kw


X = np.zeros((4, 200), np.float32)
C = np.zeros((2, 2), np.int32)


@pytest.mark.parametrize(
    ("over", "exc", "match"),
    [
        (
            dict(top_k=np.array([129, 1], np.int32)),
            ValueError,
            r"top_k\[0\]=129; expected 1\.\.128",
        ),
        (dict(top_k=np.array([1, -1], np.int32)), ValueError, r"top_k\[1\]=-1; expected 1\.\.128"),
        (dict(top_k=np.array([1, 199], np.int32)), ValueError, r"vocab_limit=200"),
        (
            dict(top_p=np.array([0, 1], np.float32)),
            ValueError,
            r"top_p\[0\]=0\.0; expected 0 < top_p <= 1",
        ),
        (dict(top_p=np.array([1, 1.5], np.float32)), ValueError, r"top_p\[1\]=1\.5"),
        (dict(top_p=np.array([np.nan, 1], np.float32)), ValueError, r"top_p\[0\]=nan"),
        (
            dict(min_p=np.array([1, 0], np.float32)),
            ValueError,
            r"min_p\[0\]=1\.0; expected 0 <= min_p < 1",
        ),
        (dict(min_p=np.array([0, -0.1], np.float32)), ValueError, r"min_p\[1\]"),
        (
            dict(temperature=np.array([-1, 1], np.float32)),
            ValueError,
            r"temperature\[0\]=-1\.0; expected a finite value >= 0",
        ),
        (dict(temperature=np.array([1, np.inf], np.float32)), ValueError, r"temperature\[1\]=inf"),
        (
            dict(temperature=np.ones(2, np.float64)),
            TypeError,
            r"temperature dtype float64 != expected float32",
        ),
        (
            dict(temperature=np.ones(3, np.float32)),
            ValueError,
            r"temperature shape \(3,\) != expected \(2,\)",
        ),
        (dict(top_k=np.ones(2, np.int64)), TypeError, r"top_k dtype int64 != expected int32"),
        (dict(seed=np.zeros(2, np.int32)), TypeError, r"seed dtype int32 != expected int64"),
        (
            dict(offset=np.zeros((2, 1), np.int64)),
            ValueError,
            r"offset shape \(2, 1\) != expected \(2,\)",
        ),
        (dict(vocab_limit=201), ValueError, r"vocab_limit=201; expected 1 <= vocab_limit <= V=200"),
        (dict(vocab_limit=0), ValueError, r"vocab_limit=0"),
        (dict(bs=3), ValueError, r"bs=3; expected 0 <= bs <= pad_bs=2"),
        (dict(tp=3), ValueError, r"pad_bs=2 must be a positive multiple of tp=3"),
        (dict(dtype="bfloat16"), TypeError, r"logits dtype float32 != expected uint16 .*bfloat16"),
        (dict(dtype="int8"), ValueError, r"dtype='int8'; expected bfloat16, float16 or float32"),
    ],
)
def test_validation_errors_name_the_expected_value(over: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        reference_verify_rows(X, C, **_kw(**over))


def test_validation_of_candidates_and_shards() -> None:
    with pytest.raises(TypeError, match=r"candidates dtype int64 != expected int32"):
        reference_verify_rows(X, C.astype(np.int64), **_kw())
    with pytest.raises(ValueError, match=r"logits shape \(4, 200\) != expected \(6, 200\)"):
        reference_verify_rows(X, np.zeros((2, 3), np.int32), **_kw())
    kw = _kw()
    del kw["tp"]
    with pytest.raises(ValueError, match=r"got 1 inputs, expected tp=2"):
        reference_verify_batch_vocab([X], C, tp=2, pad_bs=2, **kw)
    with pytest.raises(ValueError, match=r"inputs\[1\] shape \(4, 99\) != expected \(4, 100\)"):
        reference_verify_batch_vocab([X[:, :100], X[:, :99]], C, tp=2, pad_bs=2, **kw)
    with pytest.raises(ValueError, match=r"candidates shape \(3, 2\) != expected \(pad_bs=2"):
        reference_verify_batch_vocab([X], np.zeros((3, 2), np.int32), tp=1, pad_bs=2, **kw)


def test_top_k_off_values_are_all_off() -> None:
    rng = np.random.default_rng(8)
    x = rng.normal(0, 1, (4, 200)).astype(np.float32)
    base = reference_verify_rows(x, C, **_kw())
    for off in (0, 200, 10**6, TOP_K_DISABLED):
        got = reference_verify_rows(x, C, **_kw(top_k=np.full(2, off, np.int32)))
        for u, w in zip(base, got, strict=True):
            np.testing.assert_array_equal(u, w)


def _sample_by_full_sort(x, *, temperature, top_k, top_p, min_p, greedy, stream_key):
    """sample_full_rows written the plain way: every sampled row sorted in key order."""
    from ipc_dpsample.layout import (
        gumbel_noise,
        min_p_log,
        prefix_masses,
        top_p_threshold,
        torch_argmax,
    )

    tok = torch_argmax(x)
    temp = np.where(greedy, np.float32(1), temperature).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        zmax = np.max(np.where(np.isnan(x), np.float32(-np.inf), x), axis=1) / temp
    ids = np.arange(x.shape[1])
    for i in np.flatnonzero(~greedy & ~np.isnan(x).any(axis=1) & np.isfinite(zmax)):
        z = x[i] / temp[i]
        score = z + gumbel_noise(stream_key[i], ids)
        order = np.argsort(-x[i], kind="stable")
        in_set = ids < top_k[i] if top_k[i] else np.ones(len(ids), bool)
        kept_sorted = in_set.copy()
        if top_p[i] < 1:
            before = prefix_masses(z[order][None], in_set[None])[0]
            kept_sorted &= before[:-1] < top_p_threshold(top_p[i : i + 1], before[-1:])[0]
        kept = np.empty(len(ids), bool)
        kept[order] = kept_sorted
        if min_p[i] > 0:
            kept &= z >= zmax[i] + min_p_log(min_p[i : i + 1])[0]
        tok[i] = np.argmax(np.where(kept, score, np.float32(-np.inf)))
    return tok.astype(np.int32)


def test_sample_full_rows_equals_the_plain_full_sort_definition() -> None:
    """The reference selects top-k sets by partition and sorts only what top-p needs;
    it must pick exactly what sorting every row picks (ties, signed zeros, -inf)."""
    from ipc_dpsample.layout import sample_full_rows

    rng = np.random.default_rng(0)
    for trial in range(120):
        rows, v = int(rng.integers(1, 9)), int(rng.integers(2, 260))
        x = (rng.standard_normal((rows, v)) * rng.choice([0.01, 1.0, 5.0])).astype(np.float32)
        if trial % 3 == 0:
            x = np.round(x).astype(np.float32)
            zero = x == 0
            x[zero] = np.where(rng.random(zero.sum()) < 0.5, np.float32(-0.0), np.float32(0.0))
            x[:, rng.integers(0, v, 3)] = -np.inf
        k = rng.choice([0, 1, 2, 5, 50, 128], rows)
        kw = dict(
            temperature=rng.choice([0.5, 1.0, 2.0], rows).astype(np.float32),
            top_k=np.where(k >= v, 0, k),
            top_p=rng.choice([1.0, 0.3, 0.9, 0.99], rows).astype(np.float32),
            min_p=rng.choice([0.0, 0.1], rows).astype(np.float32),
            greedy=k == 1,
            stream_key=rng.integers(0, 2**63, rows, dtype=np.uint64),
        )
        assert np.array_equal(sample_full_rows(x, **kw), _sample_by_full_sort(x, **kw)), trial

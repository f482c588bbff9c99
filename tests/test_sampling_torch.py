"""The torch sampler (``ipc_dpsample.sampling``) against the NumPy reference, bit for bit:
the noise (Philox key and Gumbel values), the float definitions, the masses and the
top-p threshold, ``sample_rows`` for every dtype, filter and special row (fixed cases,
hypothesis, one V=152064 case), ``verify_rows`` per rank against
``reference_verify_rows``, logprobs within 1 float32 ulp; mutation checks that the test
data catches an ignored temperature, a nucleus one token off, a top-k one off and an
ignored min-p; the sync-free path on ``meta`` tensors (no host read possible)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipc_dpsample import layout as L
from ipc_dpsample import sampling as S

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
I64_MIN, I64_MAX = -(2**63), 2**63 - 1


def _rows(x32: np.ndarray, dtype: str) -> tuple[torch.Tensor, np.ndarray]:
    """Logits as a torch tensor of ``dtype`` and the float32 values the reference reads."""
    t = torch.from_numpy(np.ascontiguousarray(x32, dtype=np.float32)).to(DTYPES[dtype])
    return t, t.to(torch.float32).numpy()


def _ref_storage(t: torch.Tensor, dtype: str) -> np.ndarray:
    """What ``reference_verify_rows`` takes: bfloat16 as its uint16 bits."""
    if dtype == "bfloat16":
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _params(rng: np.random.Generator, n: int, mode: str, v: int) -> dict[str, np.ndarray]:
    """Per-row parameters of one filter family, normalised as ``sample_full_rows`` takes
    them (top-k 0 = off and < v)."""
    temp = rng.uniform(0.3, 1.6, n).astype(np.float32)
    k = np.zeros(n, np.int64)
    p = np.ones(n, np.float32)
    mp = np.zeros(n, np.float32)
    greedy = np.zeros(n, bool)
    kmax = min(L.TOP_K_MAX, v - 1)
    if mode == "greedy":
        greedy[:] = True
    elif mode == "top_k":
        k[:] = rng.integers(2, kmax + 1, n) if kmax >= 2 else 0
    elif mode == "top_k_top_p":
        k[:] = rng.integers(2, kmax + 1, n) if kmax >= 2 else 0
        p[:] = rng.uniform(0.3, 0.95, n)
    elif mode == "top_p":
        p[:] = rng.uniform(0.3, 0.95, n)
    elif mode == "min_p":
        mp[:] = rng.uniform(0.01, 0.3, n)
    elif mode == "mixed":
        which = rng.integers(0, 6, n)
        greedy = which == 0
        k = np.where(np.isin(which, (2, 3, 5)), rng.integers(1, kmax + 1, n), 0) if kmax else k
        p = np.where(np.isin(which, (3, 4)), rng.uniform(0.2, 0.99, n), 1).astype(np.float32)
        mp = np.where(which == 5, rng.uniform(0.01, 0.5, n), 0).astype(np.float32)
        greedy |= k == 1
    elif mode != "temperature":
        raise AssertionError(mode)
    seed = rng.integers(I64_MIN, I64_MAX, n, dtype=np.int64, endpoint=True)
    off = rng.integers(I64_MIN, I64_MAX, n, dtype=np.int64, endpoint=True)
    return dict(
        temperature=temp,
        top_k=k,
        top_p=p,
        min_p=mp,
        greedy=greedy,
        stream_key=L.noise_stream_key(seed, off),
    )


def _torch_kw(params: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    kw = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in params.items()}
    kw["stream_key"] = torch.from_numpy(params["stream_key"].view(np.int64))
    return kw


def _sample_all_ways(x: torch.Tensor, params: dict[str, np.ndarray], **kw: object) -> list:
    """``sample_rows`` with the sync (plan None), the tight plan and the all-paths plan."""
    tk = _torch_kw(params)
    tight = S.plan_rows(tk["top_k"], tk["top_p"], tk["greedy"])
    return [
        S.sample_rows(x, **tk, plan=plan, **kw).numpy() for plan in (None, tight, S.SamplePlan())
    ]


def _ref(x32: np.ndarray, params: dict[str, np.ndarray], vocab_limit: int | None = None):
    xs = x32 if vocab_limit is None else x32[:, :vocab_limit]
    return L.sample_full_rows(xs, **params)


# -- the noise and the float definitions ---------------------------------------------------
def test_noise_stream_key_matches_layout_including_extremes() -> None:
    rng = np.random.default_rng(11)
    edge = np.array([0, 1, -1, I64_MIN, I64_MAX, 2**32 - 1, 2**32, -(2**32)], np.int64)
    seed = np.concatenate([edge, rng.integers(I64_MIN, I64_MAX, 300, dtype=np.int64)])
    off = np.concatenate([edge[::-1], rng.integers(I64_MIN, I64_MAX, 300, dtype=np.int64)])
    got = S.noise_stream_key(torch.from_numpy(seed), torch.from_numpy(off)).numpy()
    assert np.array_equal(got, L.noise_stream_key(seed, off).view(np.int64))


def test_row_params_match_verify_params_with_offset_wraparound() -> None:
    rng = np.random.default_rng(12)
    g, n, v = 7, 4, 500
    temp = np.array([0, 5e-7, 1e-6, 0.7, 1.0, 2.0, 0.9], np.float32)
    top_k = np.array([0, 3, 1, 128, L.TOP_K_DISABLED, v, 1], np.int32)
    top_p = rng.uniform(0.1, 1, g).astype(np.float32)
    min_p = rng.uniform(0, 0.9, g).astype(np.float32)
    seed = rng.integers(I64_MIN, I64_MAX, g, dtype=np.int64)
    offset = np.array([I64_MAX, I64_MAX - 2, -1, 2**32 - 2, -(2**32) - 1, 0, 2**40], np.int64)
    ref = L.verify_params(
        pad_bs=g,
        num_tokens_per_req=n,
        vocab_size=v,
        temperature=temp,
        seed=seed,
        offset=offset,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
    )
    got = S.row_params(
        temperature=torch.from_numpy(temp),
        seed=torch.from_numpy(seed),
        offset=torch.from_numpy(offset),
        num_tokens_per_req=n,
        vocab_limit=v,
        top_k=torch.from_numpy(top_k),
        top_p=torch.from_numpy(top_p),
        min_p=torch.from_numpy(min_p),
    )
    assert np.array_equal(got.stream_key.numpy(), ref.stream_keys.view(np.int64))
    assert np.array_equal(got.greedy.numpy(), ref.greedy_rows)
    assert np.array_equal(got.top_k.numpy(), ref.per_row(ref.top_k))
    for name in ("temperature", "top_p", "min_p"):
        assert np.array_equal(getattr(got, name).numpy(), ref.per_row(getattr(ref, name)))
    # bs: only the real requests' rows
    part = S.row_params(
        temperature=torch.from_numpy(temp),
        seed=torch.from_numpy(seed),
        offset=torch.from_numpy(offset),
        num_tokens_per_req=n,
        vocab_limit=v,
        bs=3,
    )
    assert np.array_equal(part.stream_key.numpy(), ref.stream_keys[: 3 * n].view(np.int64))


def test_gumbel_noise_matches_layout_bits() -> None:
    rng = np.random.default_rng(13)
    keys = L.noise_stream_key(rng.integers(I64_MIN, I64_MAX, 16), rng.integers(0, 2**50, 16))
    ids = np.concatenate([np.arange(2000), [2**21 - 1, 2**31, 2**32 - 1]])
    want = L.gumbel_noise(keys[:, None], ids[None, :])
    got = S.gumbel_noise(
        torch.from_numpy(keys.view(np.int64))[:, None], torch.from_numpy(ids)[None]
    )
    assert got.dtype == torch.float32
    assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))


def test_det_log_and_exp2_frac_match_layout_bits() -> None:
    rng = np.random.default_rng(14)
    x = np.concatenate(
        [
            np.exp(rng.uniform(-700, 700, 20000)),
            rng.uniform(1e-7, 1, 20000),
            [1e-7, 1 - 2**-24, 1.0, 0.5, np.sqrt(0.5), np.nextafter(np.sqrt(0.5), 0), 2.0],
        ]
    )
    got = S._det_log(torch.from_numpy(x)).numpy()
    assert np.array_equal(got.view(np.uint64), L.det_log(x).view(np.uint64))
    f = np.concatenate([rng.uniform(0, 1, 20000), [0.0, np.nextafter(1.0, 0)]])
    got = S._det_exp2_frac(torch.from_numpy(f)).numpy()
    assert np.array_equal(got.view(np.uint64), L.det_exp2_frac(f).view(np.uint64))


def test_mass_terms_match_layout() -> None:
    rng = np.random.default_rng(15)
    z = np.concatenate(
        [
            rng.normal(0, 30, 20000),
            rng.uniform(-3e38, 3e38, 200),
            [0.0, -0.0, -np.inf, 1e-30, -1e-30, 88.7, -103.9, 3.4e38, -3.4e38],
        ]
    ).astype(np.float32)
    grp, a = S._mass_terms(torch.from_numpy(z))
    want_grp, want_a = L.mass_terms(z)
    assert np.array_equal(grp.numpy(), want_grp)
    assert np.array_equal(a.numpy(), want_a)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    p=st.floats(0, 1, width=32, exclude_min=True),
    w=st.one_of(st.integers(0, 2**53), st.integers(0, 100), st.just(2**53)),
)
def test_ceil_times_is_exact(p: float, w: int) -> None:
    pt = torch.tensor([p, 1.0], dtype=torch.float32)
    wt = torch.tensor([w, w], dtype=torch.int64)
    want = L.top_p_threshold(pt.numpy(), wt.numpy())
    assert S._ceil_times(pt, wt).tolist() == want.tolist()


# -- sample_rows: fixed cases ------------------------------------------------------------------
MODES = ("greedy", "temperature", "top_k", "top_k_top_p", "top_p", "min_p", "mixed")


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("mode", MODES)
def test_sample_rows_matches_reference_per_filter(dtype: str, mode: str) -> None:
    rng = np.random.default_rng([list(DTYPES).index(dtype), MODES.index(mode)])
    n, v = 24, 1000
    x, x32 = _rows(rng.standard_normal((n, v)) * rng.uniform(0.5, 4, (n, 1)), dtype)
    params = _params(rng, n, mode, v)
    want = _ref(x32, params)
    # chunk_elems: several rows per chunk, chunks that split the rows unevenly
    for got in _sample_all_ways(x, params, chunk_elems=5 * v):
        assert got.dtype == np.int32
        assert np.array_equal(got, want), (mode, dtype)


def _special_rows(rng: np.random.Generator, v: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Degenerate rows and ties: NaN, +inf, only -inf, some -inf, a huge logit at a tiny
    temperature (z_max overflows), integer-valued rows full of ties, +-0.0."""
    rows = []
    base = lambda: rng.standard_normal(v).astype(np.float32)  # noqa: E731
    r = base()
    r[[5, 17]] = np.nan
    rows.append(r)
    r = base()
    r[[9, 3]] = np.inf
    rows.append(r)
    rows.append(np.full(v, -np.inf, np.float32))
    r = base()
    r[rng.random(v) < 0.7] = -np.inf
    rows.append(r)
    r = base()
    r[4] = 3e38
    rows.append(r)
    rows.append(rng.integers(-3, 3, v).astype(np.float32))  # ties everywhere
    r = rng.integers(-1, 1, v).astype(np.float32)
    r[r == 0] = np.where(rng.random(int((r == 0).sum())) < 0.5, -0.0, 0.0)
    rows.append(r)
    r = base()
    r[0] = np.nan
    rows.append(r)
    x = np.stack(rows * 4)  # every special row under each of 4 filter sets
    n = len(x)
    kmax = min(L.TOP_K_MAX, v - 1)
    fam = np.repeat(np.arange(4), len(rows))
    temp = np.where(np.isin(np.arange(n) % len(rows), [4]), 1e-6, 0.8).astype(np.float32)
    params = dict(
        temperature=temp,
        top_k=np.where(fam == 1, min(7, kmax), np.where(fam == 2, kmax, 0)).astype(np.int64),
        top_p=np.where(np.isin(fam, (2, 3)), 0.7, 1).astype(np.float32),
        min_p=np.where(fam == 3, 0.2, 0).astype(np.float32),
        greedy=np.zeros(n, bool),
        stream_key=L.noise_stream_key(rng.integers(0, 2**62, n), rng.integers(0, 2**40, n)),
    )
    return x, params


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_sample_rows_special_rows_and_ties(dtype: str) -> None:
    rng = np.random.default_rng(21)
    x32, params = _special_rows(rng, 300)
    x, x32 = _rows(x32, dtype)
    want = _ref(x32, params)
    for got in _sample_all_ways(x, params):
        assert np.array_equal(got, want)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_sample_rows_vocab_limit(dtype: str) -> None:
    rng = np.random.default_rng(22)
    n, v, limit = 30, 700, 517
    raw = rng.standard_normal((n, v)) * 3
    raw[:, limit:] += 20  # columns beyond the limit would win everything
    raw[3, limit + 1] = np.nan  # a NaN beyond the limit does not count
    x, x32 = _rows(raw, dtype)
    params = _params(rng, n, "mixed", limit)
    want = _ref(x32, params, vocab_limit=limit)
    for got in _sample_all_ways(x, params, vocab_limit=limit, chunk_elems=3 * v):
        assert np.array_equal(got, want)
    # a non-contiguous view of wider rows
    wide = torch.cat([x, x[:, :50]], dim=1)
    for got in _sample_all_ways(wide, params, vocab_limit=limit):
        assert np.array_equal(got, want)


def test_sample_rows_realistic_vocabulary() -> None:
    """V = 152064 (Qwen), bf16, one row per filter family plus a greedy row."""
    rng = np.random.default_rng(23)
    v = 152064
    n = 6
    raw = rng.normal(0, 2, (n, v))
    head = rng.choice(v, (n, 30), replace=False)
    np.put_along_axis(raw, head, 8 + rng.uniform(4, 14, (n, 30)), axis=1)  # an LLM-like head
    x, x32 = _rows(raw, "bfloat16")
    params = dict(
        temperature=np.array([0.7, 1.0, 0.7, 1.0, 0.8, 0], np.float32),
        top_k=np.array([0, 50, 50, 0, 0, 0], np.int64),
        top_p=np.array([1, 1, 0.9, 0.95, 1, 1], np.float32),
        min_p=np.array([0, 0, 0, 0, 0.05, 0], np.float32),
        greedy=np.array([0, 0, 0, 0, 0, 1], bool),
        stream_key=L.noise_stream_key(rng.integers(0, 2**62, n), rng.integers(0, 2**40, n)),
    )
    want = _ref(x32, params)
    tk = _torch_kw(params)
    for plan in (None, S.SamplePlan()):
        assert np.array_equal(S.sample_rows(x, **tk, plan=plan).numpy(), want)


# -- sample_rows: hypothesis -----------------------------------------------------------------
@st.composite
def _cases(draw: st.DrawFn) -> tuple:
    n = draw(st.integers(1, 6))
    v = draw(st.integers(1, 260))
    limit = draw(st.integers(1, v))
    dtype = draw(st.sampled_from(list(DTYPES)))
    seed = draw(st.integers(0, 2**32 - 1))
    kind = draw(st.sampled_from(["normal", "ties", "wide", "special"]))
    chunk = draw(st.sampled_from([S.CHUNK_ELEMS, 1, 2 * limit + 1]))
    return n, v, limit, dtype, seed, kind, chunk


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(_cases())
def test_sample_rows_hypothesis(case: tuple) -> None:
    n, v, limit, dtype, seed, kind, chunk = case
    rng = np.random.default_rng(seed)
    if kind == "normal":
        raw = rng.standard_normal((n, v)) * rng.uniform(0.1, 5)
    elif kind == "ties":
        raw = rng.integers(-2, 3, (n, v)).astype(np.float64)
    elif kind == "wide":
        raw = rng.standard_normal((n, v)) * 1e4
    else:
        raw = rng.standard_normal((n, v))
        special = rng.random((n, v)) < 0.05
        raw[special] = rng.choice([np.nan, np.inf, -np.inf, -np.inf], int(special.sum()))
    x, x32 = _rows(raw, dtype)
    params = _params(rng, n, "mixed", limit)
    # tiny temperatures (z may overflow), tiny and near-1 top-p, near-1 min-p
    params["temperature"][rng.random(n) < 0.2] = np.float32(1e-6)
    params["top_p"][rng.random(n) < 0.1] = np.float32(1e-30)
    params["top_p"][rng.random(n) < 0.1] = np.nextafter(np.float32(1), np.float32(0))
    params["min_p"][rng.random(n) < 0.1] = np.nextafter(np.float32(1), np.float32(0))
    want = _ref(x32, params, vocab_limit=limit)
    for got in _sample_all_ways(x, params, vocab_limit=limit, chunk_elems=chunk):
        assert np.array_equal(got, want)


# -- the test data can fail: mutations the comparisons above would catch ---------------------------
def _peaked_case() -> tuple[torch.Tensor, np.ndarray, dict[str, np.ndarray]]:
    """Rows with small nuclei (a head of a few tokens), so the boundary token of top-p and
    the k-th token of top-k often win, plus flat rows for min-p."""
    rng = np.random.default_rng(31)
    n, v = 200, 400
    raw = rng.standard_normal((n, v))
    head = rng.integers(0, v, (n, 6))
    np.put_along_axis(raw, head, 3 + rng.uniform(0, 2, (n, 6)), axis=1)
    x, x32 = _rows(raw, "float32")
    fam = np.arange(n) % 4  # 0 top-p only, 1 top-k only, 2 top-k + top-p, 3 min-p only
    params = dict(
        temperature=rng.uniform(0.5, 1.5, n).astype(np.float32),
        top_k=np.where(np.isin(fam, (1, 2)), rng.integers(2, 6, n), 0).astype(np.int64),
        top_p=np.where(np.isin(fam, (0, 2)), rng.uniform(0.3, 0.9, n), 1).astype(np.float32),
        min_p=np.where(fam == 3, rng.uniform(0.05, 0.5, n), 0).astype(np.float32),
        greedy=np.zeros(n, bool),
        stream_key=L.noise_stream_key(rng.integers(0, 2**62, n), rng.integers(0, 2**40, n)),
    )
    return x, x32, params


def test_peaked_case_matches_reference() -> None:
    x, x32, params = _peaked_case()
    want = _ref(x32, params)
    for got in _sample_all_ways(x, params):
        assert np.array_equal(got, want)


def _changed(x: torch.Tensor, params: dict[str, np.ndarray], want: np.ndarray) -> int:
    return int((S.sample_rows(x, **_torch_kw(params)).numpy() != want).sum())


def _one_longer(kept: torch.Tensor) -> torch.Tensor:
    """A key-order prefix mask extended by one column."""
    return torch.nn.functional.pad(kept, (1, 0), value=True)[:, :-1]


def _one_shorter(kept: torch.Tensor) -> torch.Tensor:
    """A key-order prefix mask cut by one column (the first column stays)."""
    cut = torch.nn.functional.pad(kept, (0, 1), value=False)[:, 1:]
    cut[:, 0] = True
    return cut


def test_mutations_change_tokens_on_the_test_data(monkeypatch: pytest.MonkeyPatch) -> None:
    x, x32, params = _peaked_case()
    want = _ref(x32, params)
    # temperature ignored
    assert _changed(x, params | {"temperature": np.ones_like(params["temperature"])}, want) > 5
    # top-k one too many
    k_plus = np.where(params["top_k"] > 0, params["top_k"] + 1, 0)
    assert _changed(x, params | {"top_k": k_plus}, want) > 5
    # the nucleus one token longer and one token shorter
    real = S._top_p_kept
    for mutate in (_one_longer, _one_shorter):
        with monkeypatch.context() as m:
            m.setattr(S, "_top_p_kept", lambda b, t, mutate=mutate: mutate(real(b, t)))
            assert _changed(x, params, want) > 5, mutate.__name__
    # min-p ignored
    with monkeypatch.context() as m:
        m.setattr(S, "_min_p_kept", lambda z, zmax, mp: torch.ones_like(z, dtype=torch.bool))
        assert _changed(x, params, want) > 5


# -- sync-free and device-agnostic ------------------------------------------------------------
def test_planned_path_runs_on_meta_tensors_without_any_host_read() -> None:
    """``meta`` tensors hold no data: any ``.item()``, ``.cpu()``, ``nonzero`` or ``if
    tensor`` raises. The planned path with ``check=False`` runs on them end to end (so it
    makes no host sync and is capturable); ``plan=None`` does need its one sync."""
    g, n, v = 3, 2, 300
    d = "meta"
    kw = dict(
        temperature=torch.ones(g, device=d),
        seed=torch.zeros(g, dtype=torch.int64, device=d),
        offset=torch.zeros(g, dtype=torch.int64, device=d),
        top_k=torch.zeros(g, dtype=torch.int32, device=d),
        top_p=torch.ones(g, device=d),
        min_p=torch.zeros(g, device=d),
    )
    x = torch.empty(g * n, v, dtype=torch.bfloat16, device=d)
    cand = torch.zeros(g, n, dtype=torch.int32, device=d)
    out = S.verify_rows(x, cand, **kw, plan=S.SamplePlan(), check=False, return_logprobs=True, bs=2)
    assert [tuple(t.shape) for t in out] == [(g, n), (g, n), (g,), (g, n)]
    assert all(t.device.type == "meta" for t in out)
    with pytest.raises((NotImplementedError, RuntimeError)):
        S.verify_rows(x, cand, **kw, check=False)


# -- verify_rows against reference_verify_rows, per rank -------------------------------------
@pytest.mark.parametrize(
    ("dtype", "tp", "pad_bs", "n", "bs", "mode"),
    [
        ("float32", 1, 5, 4, None, "mixed"),
        ("bfloat16", 2, 8, 4, 5, "mixed"),
        ("float16", 4, 8, 3, 3, "top_k_top_p"),
        ("float32", 3, 6, 1, None, "temperature"),
        ("bfloat16", 2, 4, 5, 4, "greedy"),
    ],
)
def test_verify_rows_matches_reference_per_rank(dtype, tp, pad_bs, n, bs, mode) -> None:
    rng = np.random.default_rng(41 + tp * 10 + n)
    v, limit = 640, 600
    raw = rng.standard_normal((pad_bs * n, v)) * 1.5
    # a peaked head so that drafts equal to the sampled tokens get accepted
    np.put_along_axis(raw, rng.integers(0, limit, (pad_bs * n, 2)), 9.0, axis=1)
    x, _ = _rows(raw, dtype)
    per_req = _params(rng, pad_bs, mode, limit)
    temperature = per_req["temperature"].copy()
    temperature[per_req["greedy"]] = 0
    top_k = per_req["top_k"].astype(np.int32)
    top_k[rng.random(pad_bs) < 0.2] = L.TOP_K_DISABLED
    seed = rng.integers(I64_MIN, I64_MAX, pad_bs, dtype=np.int64)
    offset = rng.integers(0, 2**40, pad_bs, dtype=np.int64)
    args = dict(
        temperature=temperature,
        seed=seed,
        offset=offset,
        top_k=top_k,
        top_p=per_req["top_p"],
        min_p=per_req["min_p"],
        vocab_limit=limit,
    )
    # candidates: the tokens the rows sample, with random breaks, so chains of every length
    sampled = L.reference_verify_rows(
        _ref_storage(x, dtype), np.zeros((pad_bs, n), np.int32), tp=tp, dtype=dtype, **args
    )[0]
    cand = np.zeros((pad_bs, n), np.int32)
    cand[:, 1:] = sampled[:, :-1]
    cand[:, 0] = rng.integers(0, limit, pad_bs)
    broken = rng.random((pad_bs, n)) < 0.25
    broken[:, 0] = False
    broken[0, 1:2] = True  # request 0 rejects its first draft, request 1 accepts all
    broken[1] = False
    cand[broken] = (cand[broken] + 1) % limit
    want = L.reference_verify_rows(
        _ref_storage(x, dtype), cand, tp=tp, dtype=dtype, bs=bs, return_logprobs=True, **args
    )
    assert n == 1 or (want[2][0] == 1 and want[2][1] == n)  # chains of different lengths
    r = pad_bs // tp
    t_args = {k: torch.from_numpy(val) for k, val in args.items() if k != "vocab_limit"}
    for rank in range(tp):
        real = L.real_reqs(r, bs, rank)
        reqs = slice(rank * r, (rank + 1) * r)
        mine = {k: val[reqs] for k, val in t_args.items()}
        # the host-planned path with its default chunks and with one row per chunk
        # (chunk_elems passes through to sample_rows), the graph-safe plan
        for plan, chunk in ((None, S.CHUNK_ELEMS), (None, 1), (S.SamplePlan(), S.CHUNK_ELEMS)):
            got = S.verify_rows(
                x[rank * r * n : (rank + 1) * r * n],
                torch.from_numpy(cand[reqs]),
                **mine,
                reqs_per_rank=r,
                vocab_limit=limit,
                bs=real,
                return_logprobs=True,
                plan=plan,
                check=plan is None,
                chunk_elems=chunk,
            )
            for name, a, b in zip(
                ("predict", "accept_index", "accept_length"), got[:3], want[:3], strict=True
            ):
                assert a.dtype == torch.int32
                assert np.array_equal(a.numpy(), b[reqs]), (name, rank)
            _assert_within_one_ulp(got[3].numpy(), want[3][reqs])


def _assert_within_one_ulp(got: np.ndarray, want: np.ndarray) -> None:
    """Logprobs: NaN exactly where the reference has NaN, else within 1 float32 ulp of
    the reference's (both from float64 values a few float64 ulps apart)."""
    assert got.dtype == np.float32
    assert np.array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    ulp = np.spacing(np.abs(want[ok]).astype(np.float32))
    assert np.all(np.abs(got[ok] - want[ok]) <= ulp)


def test_log_softmax_at_within_one_ulp_and_nan_rows() -> None:
    rng = np.random.default_rng(51)
    x32 = (rng.standard_normal((64, 3000)) * rng.uniform(0.1, 30, (64, 1))).astype(np.float32)
    x32[0, 3] = np.nan
    x32[1, 7] = np.inf
    x32[2] = -np.inf
    x32[3, ::2] = -np.inf
    tok = rng.integers(0, 3000, 64)
    tok[3] = 1
    want = L.log_softmax_at(x32, tok)
    got = S.log_softmax_at(torch.from_numpy(x32), torch.from_numpy(tok), chunk_elems=7000)
    _assert_within_one_ulp(got.numpy(), want)
    assert np.isnan(want[:3]).all() and not np.isnan(want[3:]).any()
    assert (got.numpy()[3:] == want[3:]).mean() > 0.9  # mostly bit-equal


def test_accept_chain_matches_layout() -> None:
    rng = np.random.default_rng(52)
    for g, n, r in ((8, 4, 4), (6, 1, 2), (5, 6, 5)):
        sampled = rng.integers(0, 3, (g, n)).astype(np.int32)
        cand = rng.integers(0, 3, (g, n)).astype(np.int32)
        want = L.accept_chain(cand, sampled, r)
        got = S.accept_chain(torch.from_numpy(cand), torch.from_numpy(sampled), r)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == torch.int32 and np.array_equal(a.numpy(), b)


# -- validation --------------------------------------------------------------------------------
def _req(g: int = 2) -> dict[str, torch.Tensor]:
    return dict(
        temperature=torch.full((g,), 0.7),
        seed=torch.arange(g, dtype=torch.int64),
        offset=torch.arange(g, dtype=torch.int64),
    )


@pytest.mark.parametrize(
    ("extra", "exc", "match"),
    [
        ({"temperature": torch.tensor([0.5, float("nan")])}, ValueError, r"temperature\[1\]=nan"),
        ({"temperature": torch.tensor([-1.0, 1.0])}, ValueError, r"temperature\[0\]=-1.0"),
        (
            {"top_k": torch.tensor([5, 129], dtype=torch.int32)},
            ValueError,
            r"top_k\[1\]=129.*1\.\.128",
        ),
        ({"top_p": torch.tensor([0.0, 0.5])}, ValueError, r"top_p\[0\]=0.0.*0 < top_p <= 1"),
        ({"min_p": torch.tensor([0.5, 1.0])}, ValueError, r"min_p\[1\]=1.0.*0 <= min_p < 1"),
        (
            {"seed": torch.arange(2, dtype=torch.int32)},
            TypeError,
            "seed dtype torch.int32 != expected torch.int64",
        ),
        ({"top_p": torch.ones(3)}, ValueError, r"top_p shape \(3,\) != expected \(2,\)"),
    ],
)
def test_row_params_errors_name_the_value_and_range(extra, exc, match) -> None:
    with pytest.raises(exc, match=match):
        S.row_params(**(_req() | extra), num_tokens_per_req=2, vocab_limit=1000)


def test_row_params_top_k_off_values_and_phantom_requests_unchecked() -> None:
    kw = _req(3) | {"temperature": torch.tensor([0.7, 0.7, float("nan")])}
    p = S.row_params(
        **kw,
        top_k=torch.tensor([1000, L.TOP_K_DISABLED, 7], dtype=torch.int32),
        num_tokens_per_req=1,
        vocab_limit=1000,
        bs=2,  # request 2 (NaN temperature) is phantom
    )
    assert p.top_k.tolist() == [0, 0]


def test_sample_rows_and_verify_rows_input_errors() -> None:
    rp = S.row_params(**_req(), num_tokens_per_req=2, vocab_limit=10)
    kw = rp._asdict()
    x = torch.randn(4, 10)
    with pytest.raises(TypeError, match=r"rows dtype torch\.int64"):
        S.sample_rows(torch.zeros(4, 10, dtype=torch.int64), **kw)
    with pytest.raises(ValueError, match=r"greedy shape \(3,\) != expected \(4,\)"):
        S.sample_rows(x, **(kw | {"greedy": torch.zeros(3, dtype=torch.bool)}))
    with pytest.raises(TypeError, match=r"stream_key dtype torch\.int32"):
        S.sample_rows(x, **(kw | {"stream_key": torch.zeros(4, dtype=torch.int32)}))
    with pytest.raises(ValueError, match="vocab_limit=11; expected 1 <= vocab_limit <= V=10"):
        S.sample_rows(x, **kw, vocab_limit=11)
    cand = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"rows shape \(3, 10\) != expected \(4, V\)"):
        S.verify_rows(x[:3], cand, **_req())
    with pytest.raises(ValueError, match="reqs_per_rank=3 must be positive and divide G=2"):
        S.verify_rows(x, cand, **_req(), reqs_per_rank=3)
    with pytest.raises(TypeError, match="candidates must be an int32 or int64"):
        S.verify_rows(x, cand.float(), **_req())


def test_verify_rows_passes_its_chunk_size_to_the_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    real = S.sample_rows

    def spy(*a: Any, **k: Any) -> torch.Tensor:
        seen.append(k["chunk_elems"])
        return real(*a, **k)

    monkeypatch.setattr(S, "sample_rows", spy)
    x, cand = torch.randn(4, 10), torch.zeros(2, 2, dtype=torch.int32)
    S.verify_rows(x, cand, **_req())
    S.verify_rows(x, cand, **_req(), chunk_elems=30)
    assert seen == [S.CHUNK_ELEMS, 30]
    with pytest.raises(ValueError, match="chunk_elems=0; expected >= 1"):
        S.verify_rows(x, cand, **_req(), chunk_elems=0)

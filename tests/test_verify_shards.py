"""The sharded algorithm of ``verify_batch_vocab`` (per-shard records + combine + the
full-row fallback) against the full-row reference: bit for bit for tokens, accept_index
and accept_length, within one float32 ulp for logprobs, for tp in {1, 2, 3, 4, 8}, every
dtype, every filter, mixed rows, ties, special rows, bs < pad_bs, vocab_limit cutting a
shard (or whole shards) and V/tp not a multiple of 4."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipc_dpsample.layout import (
    TOP_K_DISABLED,
    reference_verify_batch_vocab,
    verify_params,
)
from ipc_dpsample.verify_shards import (
    LIST_CAP,
    NO_ID,
    combine_records,
    record_dtype,
    record_words,
    shard_records,
    sharded_tokens,
    verify_batch_vocab_sharded,
)

DTYPES = ("float32", "bfloat16", "float16")


def _encode(full: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> the storage of ``dtype`` (bfloat16: the uint16 bits, truncated)."""
    if dtype == "bfloat16":
        return (np.ascontiguousarray(full, np.float32).view(np.uint32) >> 16).astype(np.uint16)
    with np.errstate(over="ignore"):
        return full.astype(dtype)


def _batch(
    seed: int,
    tp: int,
    reqs_per_rank: int,
    n: int,
    shard: int,
    *,
    ties: bool = False,
    specials: bool = True,
    k_max: int = LIST_CAP,
    scale: float = 2.0,
):
    """Random logits of a padded batch, full rows ``[pad_bs * N, V]`` (float32 values), and
    per-request parameters mixing every mode."""
    rng = np.random.default_rng(seed)
    pad_bs = tp * reqs_per_rank
    v = tp * shard
    x = rng.normal(0, scale, (pad_bs * n, v)).astype(np.float32)
    if ties:
        x = np.round(x)  # many exact ties, across shard boundaries too
    rows = pad_bs * n
    if specials and rows >= 6:
        x[0] = -np.inf  # only -inf
        x[1, rng.integers(v)] = np.nan
        x[2, rng.integers(v)] = np.inf
        x[3, : v // 2] = -np.inf  # -inf columns in a sampled row
        x[4] *= 1e37  # z overflows for temperatures < 1
        x[5, :] = 1.5  # every column ties
    params = dict(
        temperature=rng.choice([0, 5e-7, 0.5, 0.7, 1.0, 1.3], pad_bs).astype(np.float32),
        seed=rng.integers(-(2**62), 2**62, pad_bs),
        offset=rng.integers(0, 2**40, pad_bs),
        top_k=rng.choice([0, 0, 0, 1, 2, k_max, TOP_K_DISABLED], pad_bs).astype(np.int32),
        top_p=rng.choice([1, 1, 0.3, 0.9, 0.99], pad_bs).astype(np.float32),
        min_p=rng.choice([0, 0, 0.05, 0.3, 0.6], pad_bs).astype(np.float32),
    )
    cand = rng.integers(0, v, (pad_bs, n)).astype(np.int32)
    return x, cand, params


def _shards(full: np.ndarray, tp: int, dtype: str) -> list[np.ndarray]:
    enc = _encode(full, dtype)
    w = full.shape[1] // tp
    return [np.ascontiguousarray(enc[:, s * w : (s + 1) * w]) for s in range(tp)]


def _check(shards, cand, *, tp, dtype, list_cap=LIST_CAP, stair_cap=16, **kw) -> None:
    pad_bs = cand.shape[0]
    want = reference_verify_batch_vocab(
        shards, cand, tp=tp, pad_bs=pad_bs, dtype=dtype, return_logprobs=True, **kw
    )
    got = verify_batch_vocab_sharded(
        shards,
        cand,
        tp=tp,
        pad_bs=pad_bs,
        dtype=dtype,
        return_logprobs=True,
        list_cap=list_cap,
        stair_cap=stair_cap,
        **kw,
    )
    for name, w, g in zip(("predict", "accept_index", "accept_length"), want, got, strict=False):
        np.testing.assert_array_equal(g, w, err_msg=name)
    lw, lg = want[3], got[3]
    both_nan = np.isnan(lw) & np.isnan(lg)
    ulps = np.abs(lw.view(np.int32).astype(np.int64) - lg.view(np.int32).astype(np.int64))
    assert np.all(both_nan | (ulps <= 1)), (lw, lg)


def _rounds(shards, cand, *, dtype, list_cap=LIST_CAP, stair_cap=16, **kw) -> np.ndarray:
    """The round that decides each real row: 1 records, 2 probes, 3 full logits."""
    pad_bs, n = cand.shape
    params = verify_params(
        pad_bs=pad_bs,
        num_tokens_per_req=n,
        vocab_size=sum(s.shape[1] for s in shards),
        **kw,
    )
    return sharded_tokens(
        shards, dtype=dtype, params=params, list_cap=list_cap, stair_cap=stair_cap
    )[2]


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sharded_equals_reference_on_mixed_batches(tp: int, dtype: str) -> None:
    shard = 37  # V/tp not a multiple of 4
    for seed, limit, ties in ((1, None, False), (2, tp * shard - 21, True), (3, shard + 5, False)):
        limit = min(limit, tp * shard) if limit else None
        x, cand, params = _batch(seed + 10 * tp, tp, 2, 3, shard, ties=ties)
        _check(_shards(x, tp, dtype), cand, tp=tp, dtype=dtype, vocab_limit=limit, **params)
        bs = tp * 2 - 1  # a phantom request at the end
        _check(_shards(x, tp, dtype), cand, tp=tp, dtype=dtype, bs=bs, **params)


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
def test_small_records_leave_rows_open_and_the_later_rounds_keep_them_exact(tp: int) -> None:
    """With lists of 3 and staircases of 2 the records cannot decide many top-p and min-p
    rows: those go through the probes or the full-row fallback; all exact."""
    flagged = decided = 0
    stages: set[int] = set()
    for seed in range(6):
        x, cand, params = _batch(100 + seed, tp, 3, 2, 11, k_max=3, ties=seed % 2 == 0)
        shards = _shards(x, tp, "float32")
        _check(shards, cand, tp=tp, dtype="float32", list_cap=3, stair_cap=2, **params)
        rounds = _rounds(shards, cand, dtype="float32", list_cap=3, stair_cap=2, **params)
        flagged += int((rounds > 1).sum())
        decided += int((rounds == 1).sum())
        stages.update(rounds.tolist())
    assert decided > flagged
    if tp > 1:
        assert {1, 2} <= stages  # the records and the probes both decided rows


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_min_p_rows_read_each_shards_staircase(tp: int) -> None:
    """Min-p without top-k: the row's threshold is known only at the combine; each shard's
    best kept column is the first entry of its staircase inside the threshold."""
    shard, reqs = 40, 8
    rng = np.random.default_rng(tp)
    pad_bs = tp * reqs
    x = rng.normal(0, 1.0, (pad_bs, tp * shard)).astype(np.float32)
    x[:, rng.integers(tp * shard, size=pad_bs)] += 2.0  # a leader on some shard
    cand = np.zeros((pad_bs, 1), np.int32)
    params = dict(
        temperature=rng.uniform(0.5, 1.5, pad_bs).astype(np.float32),
        seed=rng.integers(0, 2**40, pad_bs),
        offset=rng.integers(0, 2**40, pad_bs),
        min_p=rng.choice([0.1, 0.3, 0.6, 0.9], pad_bs).astype(np.float32),
        top_p=rng.choice([1, 1, 0.95], pad_bs).astype(np.float32),
    )
    shards = _shards(x, tp, "float32")
    for caps in ((LIST_CAP, 16), (4, 2)):
        _check(shards, cand, tp=tp, dtype="float32", list_cap=caps[0], stair_cap=caps[1], **params)
    rounds = _rounds(shards, cand, dtype="float32", **dict(params, top_p=None))
    assert (rounds == 1).all()  # min-p alone: the staircases decide every row


@pytest.mark.parametrize("tp", [2, 4])
def test_flat_top_p_rows_are_closed_by_probes(tp: int) -> None:
    """Flat rows with short lists: the nucleus runs past every shard's list, so the
    records leave the row open; the probes (masses before each candidate) decide which of
    the shards' staircase entries are in the nucleus, rejecting some on the way."""
    shard, rows = 200, 120
    rng = np.random.default_rng(tp + 40)
    x = rng.normal(0, 1.0, (rows, tp * shard)).astype(np.float32)
    cand = np.zeros((rows, 1), np.int32)
    params = dict(
        temperature=np.ones(rows, np.float32),
        seed=rng.integers(0, 2**40, rows),
        offset=np.arange(rows, dtype=np.int64),
        top_p=rng.choice([0.3, 0.5, 0.8], rows).astype(np.float32),
        min_p=rng.choice([0, 0, 0.2], rows).astype(np.float32),
    )
    shards = _shards(x, tp, "float32")
    _check(shards, cand, tp=tp, dtype="float32", list_cap=8, **params)
    rounds = _rounds(shards, cand, dtype="float32", list_cap=8, **params)
    assert (rounds == 2).mean() > 0.5 and (rounds == 3).mean() < 0.05


def test_a_cut_staircase_sends_the_row_to_the_full_row_fallback() -> None:
    """Shard 1 holds a flat band around the min-p threshold, set by shard 0's maximum: its
    two-entry staircase often ends below the threshold while columns above it remain."""
    tp, shard, rows = 2, 64, 300
    rng = np.random.default_rng(0)
    x = np.full((rows, tp * shard), -20.0, np.float32)
    x[:, 0] = 10.0  # the row's maximum, on shard 0
    x[:, shard:] = rng.uniform(7.0, 9.5, (rows, shard))
    cand = np.zeros((rows, 1), np.int32)
    params = dict(
        temperature=np.ones(rows, np.float32),
        seed=rng.integers(0, 2**40, rows),
        offset=np.arange(rows, dtype=np.int64),
        min_p=np.full(rows, np.exp(-1.5), np.float32),
    )
    shards = _shards(x, tp, "float32")
    _check(shards, cand, tp=tp, dtype="float32", list_cap=4, stair_cap=2, **params)
    rounds = _rounds(shards, cand, dtype="float32", list_cap=4, stair_cap=2, **params)
    assert 0 < (rounds == 3).sum() < rows // 10
    assert (_rounds(shards, cand, dtype="float32", **params) == 1).all()  # 16 steps suffice


def test_shard_masses_align_to_the_rows_top_group() -> None:
    from ipc_dpsample.verify_shards import _shard_total

    r = np.zeros(3, dtype=record_dtype())
    r["mass_group"] = [10, 4, -np.inf]  # shard 1 is 6 groups down, shard 2 has no mass
    r["mass"][0] = [2**32, 0, 0, 0, 0, 0, 0]
    r["mass"][1] = [2**52, 2**52, 0, 0, 0, 0, 0]
    zmax = np.float32(10 * 8 * np.log(2) + 0.01)  # in group 10
    assert _shard_total(r, zmax) == 2**32 + (2**52 >> 48)  # group 4 = d 6; group 3 drops


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    tp=st.sampled_from([1, 2, 3, 4, 8]),
    reqs=st.integers(1, 3),
    n=st.integers(1, 3),
    shard=st.integers(1, 13),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31),
    limit_frac=st.floats(0.05, 1.0),
    bs_drop=st.integers(0, 2),
    caps=st.sampled_from([(2, 2), (3, 2), (4, 4), (LIST_CAP, 16)]),
    ties=st.booleans(),
    scale=st.sampled_from([0.5, 2.0, 8.0]),
)
def test_sharded_equals_reference_property(
    tp, reqs, n, shard, dtype, seed, limit_frac, bs_drop, caps, ties, scale
) -> None:
    list_cap, stair_cap = caps
    x, cand, params = _batch(
        seed, tp, reqs, n, shard, ties=ties, k_max=min(list_cap, 5), scale=scale
    )
    v = tp * shard
    limit = max(1, min(v, round(limit_frac * v)))
    bs = max(0, tp * reqs - bs_drop)
    _check(
        _shards(x, tp, dtype),
        cand,
        tp=tp,
        dtype=dtype,
        vocab_limit=limit,
        bs=bs,
        list_cap=list_cap,
        stair_cap=stair_cap,
        **params,
    )


@pytest.mark.parametrize("tp", [2, 8])
def test_edge_parameters(tp: int) -> None:
    """top_k = 1 everywhere, top_p = 1, all -inf and NaN rows, shards beyond the limit."""
    shard = 9
    x, cand, params = _batch(7, tp, 2, 2, shard)
    pad_bs = cand.shape[0]
    shards = _shards(x, tp, "float32")
    for over in (
        dict(top_k=np.ones(pad_bs, np.int32)),
        dict(top_p=np.ones(pad_bs, np.float32), top_k=None, min_p=None),
        dict(top_p=np.full(pad_bs, 1e-6, np.float32), top_k=None),
        dict(min_p=np.full(pad_bs, 0.999, np.float32)),
        dict(temperature=np.full(pad_bs, 1e4, np.float32)),
    ):
        _check(shards, cand, tp=tp, dtype="float32", **dict(params, **over))
    _check(shards, cand, tp=tp, dtype="float32", vocab_limit=1, **params)
    _check(shards, cand, tp=tp, dtype="float32", vocab_limit=shard, **params)  # shard 0 only
    bad = x.copy()
    bad[:] = -np.inf
    bad[1::2, 3] = np.nan
    _check(_shards(bad, tp, "float32"), cand, tp=tp, dtype="float32", **params)


def _llm_rows(rng: np.random.Generator, rows: int, v: int) -> np.ndarray:
    """LLM-like rows: a Gaussian background and a peaked head of 1..40 tokens."""
    x = (rng.standard_normal((rows, v), np.float32) * 2.0).astype(np.float32)
    for r in range(rows):
        h = int(rng.integers(1, 40))
        ids = rng.choice(v, h, replace=False)
        x[r, ids] = 8.0 + rng.uniform(4, 14) - 1.2 * np.log(np.arange(1, h + 1))
    return x


def test_realistic_vocabulary_tp8_is_exact_and_mostly_decided_by_the_records() -> None:
    tp, n, v = 8, 2, 152064
    pad_bs = 8
    rng = np.random.default_rng(2024)
    x = _llm_rows(rng, pad_bs * n, v)
    x[-n:] = rng.standard_normal((n, v), np.float32)  # a flat last request (nucleus ~ V/2)
    params = dict(
        temperature=np.array([0.7, 1.0, 0, 0.8, 1.0, 0.6, 1.0, 1.0], np.float32),
        seed=rng.integers(0, 2**40, pad_bs),
        offset=rng.integers(0, 2**20, pad_bs),
        top_k=np.array([0, 50, 0, 0, 0, 128, 20, 0], np.int32),
        top_p=np.array([0.95, 0.9, 1, 1, 0.9, 1, 0.8, 0.95], np.float32),
        min_p=np.array([0, 0, 0, 0.05, 0, 0, 0.1, 0], np.float32),
    )
    cand = rng.integers(0, v, (pad_bs, n)).astype(np.int32)
    shards = _shards(x, tp, "bfloat16")
    _check(shards, cand, tp=tp, dtype="bfloat16", vocab_limit=v - 100, **params)
    rounds = _rounds(shards, cand, dtype="bfloat16", vocab_limit=v - 100, **params)
    assert (rounds[:-n] == 1).all()  # the peaked rows: the records alone decide
    # the flat top-p rows: the records decide some (the noise's winner is clearly in
    # or out of the nucleus), the others take one round of probes, never more
    assert rounds[-n:].max() == 2 and (rounds[-n:] >= 1).all()


def test_record_layout_is_the_documented_wire_format() -> None:
    dt = record_dtype()
    assert dt.itemsize == 1312 and record_words() == 328
    words = {name: dt.fields[name][1] // 4 for name in dt.names}
    assert words == {
        "flags": 0,
        "greedy_id": 1,
        "greedy_val": 2,
        "rtop_id": 3,
        "rtop_val": 4,
        "reserved": 5,
        "sumexp": 6,
        "mass_group": 8,
        "mass": 10,
        "stair_score": 24,
        "stair_val": 40,
        "stair_id": 56,
        "list_val": 72,
        "list_id": 200,
    }
    for name in ("sumexp", "mass_group", "mass"):
        assert dt.fields[name][1] % 8 == 0
    assert record_words(list_cap=50, stair_cap=4) == 24 + 12 + 100
    with pytest.raises(ValueError, match=r"list_cap=0; expected 1\.\.255"):
        record_dtype(list_cap=0)
    with pytest.raises(ValueError, match=r"stair_cap=3 must be even"):
        record_dtype(stair_cap=3)


def test_records_hold_what_the_docstring_says() -> None:
    tp, shard = 2, 6
    x = np.array(
        [
            [1, 5, 2, 5, 0, -1, 9, 0, 9, 3, 4, 1],
            [0, 0, np.nan, 1, 2, 3, 0, 0, 0, 0, 0, 0],
        ],
        np.float32,
    )
    common = dict(
        pad_bs=1,
        num_tokens_per_req=2,
        vocab_size=tp * shard,
        temperature=np.ones(1, np.float32),
        seed=np.zeros(1, np.int64),
        offset=np.zeros(1, np.int64),
    )
    p = verify_params(**common, top_k=np.array([3], np.int32))
    r0, r1 = (
        shard_records(
            np.ascontiguousarray(x[:, s * shard : (s + 1) * shard]),
            shard=s,
            tp=tp,
            dtype="float32",
            params=p,
        )
        for s in range(tp)
    )
    assert (r0["greedy_id"][0], r0["greedy_val"][0]) == (1, 5)  # first of the tied maxima
    assert (r1["greedy_id"][0], r1["greedy_val"][0]) == (6, 9)
    assert r0["list_id"][0, :3].tolist() == [1, 3, 2]  # key order: value desc, id asc
    assert r1["list_id"][0, :3].tolist() == [6, 8, 10]
    assert (int(r0["flags"][0]) >> 16) & 0xFF == 3
    assert r0["greedy_id"][1] == 2 and np.isnan(r0["greedy_val"][1])  # the first NaN
    assert int(r0["flags"][1]) & 1 == 1 and int(r1["flags"][1]) & 1 == 0
    assert r0["rtop_id"][0] == NO_ID  # top-k rows carry no rtop / staircase
    np.testing.assert_allclose(
        r0["sumexp"][0], np.exp(x[0, :shard].astype(np.float64) - 5).sum(), rtol=1e-15
    )
    comb = combine_records([r0, r1], p)
    assert comb.tokens[1] == 2 and not comb.unresolved.any()
    # a top-p row fills the list, the masses and rtop
    q = verify_params(**common, top_p=np.array([0.9], np.float32))
    r0 = shard_records(
        np.ascontiguousarray(x[:, :shard]), shard=0, tp=tp, dtype="float32", params=q, list_cap=2
    )
    assert r0["list_id"][0, :2].tolist() == [1, 3]
    assert (r0["rtop_id"][0], r0["rtop_val"][0]) == (2, 2)
    assert r0["mass_group"][0] == 0  # exp(5) = 2**7.2: binade 7, group 0
    assert r0["mass"][0, 0] > 0


def test_shard_records_reject_a_top_k_above_the_list_capacity() -> None:
    p = verify_params(
        pad_bs=1,
        num_tokens_per_req=1,
        vocab_size=40,
        temperature=np.ones(1, np.float32),
        seed=np.zeros(1, np.int64),
        offset=np.zeros(1, np.int64),
        top_k=np.array([9], np.int32),
    )
    with pytest.raises(ValueError, match=r"top_k=9 exceeds list_cap=8"):
        shard_records(
            np.zeros((1, 20), np.float32), shard=0, tp=2, dtype="float32", params=p, list_cap=8
        )
    with pytest.raises(TypeError, match=r"local_logits dtype float64 != expected float32"):
        shard_records(np.zeros((1, 20)), shard=0, tp=2, dtype="float32", params=p)


def test_sharded_entry_validates_like_the_reference() -> None:
    kw = dict(
        pad_bs=2,
        dtype="float32",
        temperature=np.ones(2, np.float32),
        seed=np.zeros(2, np.int64),
        offset=np.zeros(2, np.int64),
    )
    x = [np.zeros((2, 8), np.float32)] * 2
    cand = np.zeros((2, 1), np.int32)
    with pytest.raises(ValueError, match=r"got 2 inputs, expected tp=4"):
        verify_batch_vocab_sharded(x, cand, tp=4, **kw)
    with pytest.raises(ValueError, match=r"pad_bs=2 must be a positive multiple of tp=3"):
        verify_batch_vocab_sharded([x[0]] * 3, cand, tp=3, **kw)
    with pytest.raises(TypeError, match=r"inputs\[1\] dtype float16 != expected float32"):
        verify_batch_vocab_sharded([x[0], x[1].astype(np.float16)], cand, tp=2, **kw)
    with pytest.raises(ValueError, match=r"top_p\[1\]=2\.0"):
        verify_batch_vocab_sharded(x, cand, tp=2, top_p=np.array([1, 2], np.float32), **kw)

"""Rank bodies of ``tests/test_verify_torch.py``: ``verify_batch_vocab`` on the torch
backend over gloo, against :func:`ipc_dpsample.layout.reference_verify_batch_vocab`.

Every rank derives the whole batch (every shard's logits, the parameters, the
candidates) from one shared seed, computes the reference itself and checks its own
results, which cover the whole batch. Logits are fresh random values (never zero);
outputs are poisoned after each check, so an output a later call does not write shows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from ipc_dpsample import DpSampleError, DpSamplingComm
from ipc_dpsample.layout import (
    TOP_K_DISABLED,
    gumbel_noise,
    reference_verify_batch_vocab,
    reference_verify_rows,
    verify_params,
)

DTYPES = ("float32", "bfloat16", "float16")
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: ``V / tp`` of most cases: above the record's 128-entry list (so top-p rows can need
#: the probe round), not a multiple of 4.
VS = 250
#: The vocabulary of the cross-tp case (every tp in {1, 2, 3, 4, 8} divides it).
CROSS_V = 840
CROSS_PAD_BS = 24
MODES = ("greedy", "temperature", "top_k", "top_k_top_p", "min_p", "top_p", "mixed")
_POISON_INT = 0x7E7E7E7E


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([abs(int(k)) for k in key])


# -- data ----------------------------------------------------------------------------
def logits(key: tuple[int, ...], rows: int, v: int, *, scale: float, specials: bool) -> np.ndarray:
    """float32 ``[rows, v]``: N(0, scale^2), never zero; with ``specials`` the first
    rows are only -inf, a NaN, a +inf, a huge value and all-equal (ties)."""
    g = _rng(*key)
    x = (g.standard_normal((rows, v)) * scale).astype(np.float32)
    x[np.abs(x) < 1e-3] = 0.75
    if specials and rows >= 6:
        x[0] = -np.inf
        x[1, int(g.integers(v))] = np.nan
        x[2, int(g.integers(v))] = np.inf
        x[3, : v // 2] = -np.inf  # -inf columns in a sampled row
        x[4, int(g.integers(v))] = 6.0e4  # overflows z at small temperatures (fp16 max)
        x[5] = 1.5  # every column ties
    return x


def params(key: tuple[int, ...], pad_bs: int, mode: str) -> dict[str, np.ndarray]:
    """Per-request parameters of ``mode`` (top_k/top_p/min_p None when the mode has
    none of them)."""
    g = _rng(*key)

    def pick(values: tuple[Any, ...], dtype: Any) -> np.ndarray:
        return np.asarray(g.choice(np.asarray(values), pad_bs)).astype(dtype)

    temps = (0.5, 0.7, 1.0, 1.3)
    out: dict[str, Any] = {
        "temperature": pick(temps, np.float32),
        "seed": g.integers(-(2**62), 2**62, pad_bs, dtype=np.int64),
        "offset": g.integers(0, 2**40, pad_bs, dtype=np.int64),
        "top_k": None,
        "top_p": None,
        "min_p": None,
    }
    if mode == "greedy":
        out["temperature"] = pick((0.0, 5e-7), np.float32)
    elif mode == "top_k":
        out["top_k"] = pick((1, 2, 5, 50, 128, 0, TOP_K_DISABLED), np.int32)
    elif mode == "top_k_top_p":
        out["top_k"] = pick((5, 50, 128), np.int32)
        out["top_p"] = pick((0.3, 0.9, 0.99), np.float32)
    elif mode == "min_p":
        out["min_p"] = pick((0.05, 0.3), np.float32)
    elif mode == "top_p":  # flat rows at T = 1: the nucleus outgrows the lists
        out["temperature"] = np.ones(pad_bs, np.float32)
        out["top_p"] = pick((0.9, 0.95), np.float32)
    elif mode == "mixed":
        out["temperature"] = pick((0.0, 0.7, 1.0), np.float32)
        out["top_k"] = pick((0, 0, 1, 3, 50, TOP_K_DISABLED), np.int32)
        out["top_p"] = pick((1.0, 1.0, 0.5, 0.95), np.float32)
        out["min_p"] = pick((0.0, 0.0, 0.1), np.float32)
    return out


def accepting_candidates(key: tuple[int, ...], predict: np.ndarray, v: int) -> np.ndarray:
    """Candidates whose drafts follow the sampled tokens for a random number of
    positions, then differ: accept lengths of every value (sampling does not read the
    candidates, so the reference's own tokens make them)."""
    g = _rng(*key)
    pad_bs, n = predict.shape
    cand = g.integers(0, v, (pad_bs, n)).astype(np.int32)
    for req in range(pad_bs):
        keep = int(g.integers(0, n))  # drafts 1..keep match
        cand[req, 1 : keep + 1] = predict[req, :keep]
        if keep + 1 < n:
            cand[req, keep + 1] = (predict[req, keep] + 1) % v
    return cand


def encode(x: np.ndarray, dtype: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)).to(TORCH[dtype])


def storage(t: torch.Tensor) -> np.ndarray:
    """What the NumPy reference takes: bfloat16 as its uint16 bits."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.int32 if a.itemsize == 4 else np.int16)


def _host(a: Any) -> np.ndarray:
    return a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


def poison(outs: tuple[Any, ...]) -> None:
    for o in outs:
        if isinstance(o, torch.Tensor):
            o.fill_(float("nan") if o.dtype.is_floating_point else _POISON_INT)
        else:
            o.fill(np.nan if o.dtype.kind == "f" else _POISON_INT)


def assert_logprobs(what: str, got: np.ndarray, want: np.ndarray) -> None:
    """Within 1 float32 ulp of the reference, NaN exactly where it is NaN."""
    nan_w, nan_g = np.isnan(want), np.isnan(got)
    assert np.array_equal(nan_w, nan_g), f"{what}: NaN pattern {nan_g} != {nan_w}"
    ok = ~nan_w
    ulps = np.abs(got[ok].view(np.int32).astype(np.int64) - want[ok].view(np.int32))
    assert not ulps.size or ulps.max() <= 1, f"{what}: logprobs differ by {ulps.max()} ulp"


# -- one case ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    mode: str
    pad_bs: int
    bs: Any = None  # None, an int, or "tensor:<k>" (an int32 CPU tensor holding k)
    vocab_limit: int | None = None
    return_logprobs: bool = True
    kind: str = "torch"  # the array type of logits / candidates (outputs follow logits)
    params_kind: str = "numpy"  # NumPy arrays or CPU torch tensors
    scale: float = 2.0
    specials: bool = False
    probes: bool = False  # rows must need the probe round


def run_case(comm: DpSamplingComm, rank: int, tp: int, key: tuple[int, ...], case: Case) -> Any:
    """One verify_batch_vocab call checked against the reference on every real row.
    Returns the call's outputs (already checked, then poisoned)."""
    cfg = comm.config
    n, v, dtype = cfg.num_tokens_per_req, cfg.vocab_size, comm.logits_dtype
    assert dtype is not None
    vs, pad_bs = v // tp, case.pad_bs
    full = encode(logits(key, pad_bs * n, v, scale=case.scale, specials=case.specials), dtype)
    shards = [full[:, s * vs : (s + 1) * vs].contiguous() for s in range(tp)]
    prm = params((*key, 1), pad_bs, case.mode)
    bs_value = case.bs
    if isinstance(case.bs, str):
        bs_value = int(case.bs.split(":")[1])
    ref_kw = dict(
        tp=tp,
        pad_bs=pad_bs,
        dtype=dtype,
        vocab_limit=case.vocab_limit,
        bs=bs_value,
        return_logprobs=case.return_logprobs,
        **prm,
    )
    inputs = [storage(s) for s in shards]
    first = reference_verify_batch_vocab(inputs, np.zeros((pad_bs, n), np.int32), **ref_kw)
    cand = accepting_candidates((*key, 2), first[0], v)
    want = reference_verify_batch_vocab(inputs, cand, **ref_kw)

    def arg(a: Any) -> Any:
        if a is None or case.params_kind == "numpy":
            return a
        return torch.from_numpy(a)

    bs_arg: Any = case.bs
    if isinstance(case.bs, str):
        bs_arg = torch.tensor(bs_value, dtype=torch.int32)
    x = shards[rank] if case.kind == "torch" else shards[rank].numpy()
    c = torch.from_numpy(cand) if case.kind == "torch" else cand
    before = _bits(storage(shards[rank])).copy()
    outs = comm.verify_batch_vocab(
        x,
        c,
        pad_bs=pad_bs,
        vocab_limit=case.vocab_limit,
        bs=bs_arg,
        return_logprobs=case.return_logprobs,
        **{k: arg(a) for k, a in prm.items()},
    )
    what = f"{case} {dtype} tp={tp} N={n} V={v}"
    assert np.array_equal(_bits(storage(shards[rank])), before), f"{what}: the input changed"
    assert len(outs) == (4 if case.return_logprobs else 3), what
    expected_type = torch.Tensor if case.kind == "torch" else np.ndarray
    real = pad_bs if bs_value is None else bs_value
    names = ("predict", "accept_index", "accept_length", "logprobs")
    for name, got, w in zip(names[: len(outs)], outs, want, strict=True):
        assert isinstance(got, expected_type), f"{what}: {name} is a {type(got)}"
        g = _host(got)
        assert g.shape == w.shape and g.dtype == w.dtype, (what, name, g.shape, g.dtype)
        if name == "logprobs":
            assert_logprobs(f"{what}: {name}", g[:real], w[:real])
        else:
            bad = np.argwhere(g[:real] != w[:real])
            assert not len(bad), f"{what}: {name} differs at {bad[:4].tolist()}: {g} vs {w}"
    poison(outs)
    return outs


def _comm(rank: int, tp: int, group: Any, **kw: Any) -> DpSamplingComm:
    return DpSamplingComm(tp_size=tp, rank=rank, group=group, device="cpu", **kw)


def _rounds(comm: DpSamplingComm) -> Any:
    rounds = comm._backend.last_verify_rounds  # type: ignore[union-attr]
    assert rounds is not None
    return rounds


# -- the matrix ------------------------------------------------------------------------
def cases_for(tp: int, dtype: str, small: bool) -> list[Case]:
    """The cases of one dtype: every mode, specials, bs, vocab_limit, array types."""
    p2, p4 = 2 * tp, 4 * tp
    kind = "numpy" if dtype != "bfloat16" else "torch"
    if small:  # tp = 8: a mixed batch and a top-p batch
        return [
            Case("mixed", p2, specials=True, vocab_limit=VS * tp - 11),
            Case("top_p", tp, scale=0.1, bs=tp - 1, probes=True),
        ]
    return [
        Case("greedy", p2, specials=True),
        Case("temperature", p4, kind=kind, params_kind="torch"),
        Case("top_k", p2, bs=p2 - 1, vocab_limit=VS * tp - 7),
        Case("top_k_top_p", p4, params_kind="torch", return_logprobs=False),
        Case("min_p", p2, specials=True, bs=f"tensor:{max(1, p2 - 3)}"),
        Case("top_p", p4, scale=0.1, probes=True),
        # tp > 2: whole shards past vocab_limit
        Case("mixed", p4, specials=True, vocab_limit=min(VS + 5, VS * tp - 1), kind=kind),
        Case("mixed", p2, bs=0),
    ]


def verify_matrix(rank: int, tp: int, group: Any, seed: int, small: bool = False) -> dict:
    """Every dtype x the cases of :func:`cases_for` on one communicator per dtype, then
    N = 1, temperature 0 against argmax_batch_vocab, the full-row fallback and the
    cross-tp case. Returns counts, the rounds seen and the cross-tp tokens."""
    out: dict[str, Any] = {"cases": 0, "round2": 0, "round3": 0}
    n, max_pad_bs = 3, 4 * tp
    for d, dtype in enumerate(DTYPES if not small else ("float32", "bfloat16")):
        with _comm(
            rank, tp, group, max_pad_bs=max_pad_bs, num_tokens_per_req=n, vocab_size=VS * tp,
            logits_dtype=dtype,
        ) as comm:  # fmt: skip
            seen: dict[int, int] = {}
            for i, case in enumerate(cases_for(tp, dtype, small)):
                outs = run_case(comm, rank, tp, (seed, d, i), case)
                ptr = outs[0].data_ptr() if isinstance(outs[0], torch.Tensor) else None
                if ptr is not None:  # a view of the same persistent buffer every call
                    assert seen.setdefault(case.pad_bs, ptr) == ptr, case
                rounds = _rounds(comm)
                out["round2"] += rounds.round2
                out["round3"] += rounds.round3
                if case.probes:
                    assert rounds.round2 > 0, f"{case}: no row needed the probe round"
                out["cases"] += 1
            if dtype == "float32":
                out["cases"] += greedy_is_argmax(comm, rank, tp, (seed, 99))
    out["cross"] = cross_tp(rank, tp, group, seed)
    if small:
        return out
    # N = 1: plain sampling, no drafts
    with _comm(
        rank, tp, group, max_pad_bs=2 * tp, num_tokens_per_req=1, vocab_size=VS * tp,
        logits_dtype="float16",
    ) as comm:  # fmt: skip
        for i, mode in enumerate(("mixed", "top_p", "greedy")):
            run_case(comm, rank, tp, (seed, 50, i), Case(mode, 2 * tp, specials=i == 0))
            out["cases"] += 1
    out["round3"] += full_row_fallback(rank, tp, group, seed)
    out["cases"] += 1
    return out


def greedy_is_argmax(comm: DpSamplingComm, rank: int, tp: int, key: tuple[int, ...]) -> int:
    """Temperature 0 everywhere: predict is argmax_batch_vocab's token of every row."""
    cfg = comm.config
    n, v, vs, pad_bs = cfg.num_tokens_per_req, cfg.vocab_size, cfg.vocab_size // tp, 2 * tp
    full = encode(logits(key, pad_bs * n, v, scale=2.0, specials=True), "float32")
    mine = full[:, rank * vs : (rank + 1) * vs].contiguous()
    prm = params(key, pad_bs, "greedy")
    prm["temperature"][:] = 0
    cand = _rng(*key).integers(0, v, (pad_bs, n)).astype(np.int32)
    limit = v - 3
    predict = comm.verify_batch_vocab(
        mine, torch.from_numpy(cand), pad_bs=pad_bs, vocab_limit=limit, **prm
    )[0].clone()
    ids, _ = comm.argmax_batch_vocab(mine, pad_bs=pad_bs, vocab_limit=limit)
    r = pad_bs // tp
    assert torch.equal(predict[rank * r : (rank + 1) * r].reshape(-1), ids), (predict, ids)
    return 1


def fallback_row(key: np.uint64, v: int) -> np.ndarray:
    """A row whose record, probes included, cannot decide top-p 0.95 at T = 1: nearly
    flat, and its key order is the reverse of its score order (logit = -noise/100), so
    every unsent column is a staircase step and more than 16 of the best-scoring
    candidates lie outside the nucleus."""
    return (-gumbel_noise(key, np.arange(v)) * np.float32(0.01)).astype(np.float32)


def full_row_fallback(rank: int, tp: int, group: Any, seed: int) -> int:
    """A batch with rows that only the full-row round decides (V/tp = 402). Returns the
    rows round 3 decided."""
    n, vs, pad_bs = 2, 402, tp
    v = vs * tp
    key = (seed, 77)
    prm = params(key, pad_bs, "top_p")
    prm["top_p"][:] = np.float32(0.95)
    vp = verify_params(
        pad_bs=pad_bs,
        num_tokens_per_req=n,
        vocab_size=v,
        temperature=prm["temperature"],
        seed=prm["seed"],
        offset=prm["offset"],
    )
    x = logits(key, pad_bs * n, v, scale=1.0, specials=False)
    for row in (0, pad_bs * n - 1):
        x[row] = fallback_row(vp.stream_keys[row], v)
    full = encode(x, "float32")
    shards = [full[:, s * vs : (s + 1) * vs].contiguous() for s in range(tp)]
    cand = _rng(*key).integers(0, v, (pad_bs, n)).astype(np.int32)
    want = reference_verify_batch_vocab(
        [s.numpy() for s in shards], cand, tp=tp, pad_bs=pad_bs, dtype="float32",
        return_logprobs=True, **prm,
    )  # fmt: skip
    with _comm(
        rank, tp, group, max_pad_bs=pad_bs, num_tokens_per_req=n, vocab_size=v,
        logits_dtype="float32",
    ) as comm:  # fmt: skip
        outs = comm.verify_batch_vocab(
            shards[rank], torch.from_numpy(cand), pad_bs=pad_bs, return_logprobs=True, **prm
        )
        for name, got, w in zip(("predict", "index", "length"), outs, want, strict=False):
            assert np.array_equal(got.numpy(), w), (name, got, w)
        assert_logprobs("fallback logprobs", outs[3].numpy(), want[3])
        rounds = _rounds(comm)
    assert rounds.round3 >= 1, f"no row took the full-row round: {rounds}"
    return rounds.round3


def cross_tp_inputs(seed: int) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """The cross-tp batch: float32 full rows ``[CROSS_PAD_BS * 2, CROSS_V]``, candidates
    and mixed parameters, independent of tp."""
    x = logits((seed, 88), CROSS_PAD_BS * 2, CROSS_V, scale=2.0, specials=True)
    prm = params((seed, 88), CROSS_PAD_BS, "mixed")
    cand = _rng(seed, 89).integers(0, CROSS_V, (CROSS_PAD_BS, 2)).astype(np.int32)
    return x, cand, prm


def cross_tp(rank: int, tp: int, group: Any, seed: int) -> list[list[int]]:
    """The same batch split over tp ranks: returns predict and accept_length (the test
    compares them across tp and with the tp = 1 reference)."""
    x, cand, prm = cross_tp_inputs(seed)
    vs = CROSS_V // tp
    with _comm(
        rank, tp, group, max_pad_bs=CROSS_PAD_BS, num_tokens_per_req=2, vocab_size=CROSS_V,
        logits_dtype="float32",
    ) as comm:  # fmt: skip
        mine = torch.from_numpy(np.ascontiguousarray(x[:, rank * vs : (rank + 1) * vs]))
        predict, _, length = comm.verify_batch_vocab(
            mine, torch.from_numpy(cand), pad_bs=CROSS_PAD_BS, **prm
        )
        return [predict.reshape(-1).tolist(), length.tolist()]


def cross_tp_expected(seed: int) -> list[list[int]]:
    """What :func:`cross_tp` must return, from the full rows (no split)."""
    x, cand, prm = cross_tp_inputs(seed)
    predict, _, length = reference_verify_rows(x, cand, tp=1, dtype="float32", **prm)
    return [predict.reshape(-1).tolist(), length.tolist()]


# -- divergence -----------------------------------------------------------------------
#: What the last rank changes, and a word its error message must hold.
MISMATCHES = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "seed": "seed",
    "offset": "offset",
    "candidates": "candidates",
    "vocab_limit": "vocab_limit",
    "return_logprobs": "return_logprobs",
    "two_fields": "temperature, seed",
    "pad_bs": "pad_bs=",
    "bs": "bs=",
    "op": "argmax_batch_vocab",
    "dtype": "float16",
}


def verify_mismatch(rank: int, tp: int, group: Any) -> dict[str, str]:
    """The last rank passes one different argument (each of :data:`MISMATCHES` on a
    fresh communicator): every rank raises DpSampleError naming it, and again on the
    next call (the communicator is poisoned). A difference in phantom requests only is
    no mismatch; invalid input raises locally before anything is exchanged (a valid
    call right after works). Returns the messages."""
    last = rank == tp - 1
    n, vs, pad_bs = 2, VS, 2 * tp
    v = vs * tp
    messages: dict[str, str] = {}
    key = (5, 6)
    x = logits((*key, rank), pad_bs * n, vs, scale=1.0, specials=False)
    base = params(key, pad_bs, "mixed")
    base["top_k"] = np.full(pad_bs, 5, np.int32)
    base["top_p"] = np.full(pad_bs, 0.9, np.float32)
    base["min_p"] = np.full(pad_bs, 0.1, np.float32)
    cand = _rng(*key).integers(0, v, (pad_bs, n)).astype(np.int32)
    for what, word in MISMATCHES.items():
        prm = {k: a.copy() for k, a in base.items()}
        kw: dict[str, Any] = {"pad_bs": pad_bs, "return_logprobs": False}
        c = cand.copy()
        dtype = "float32"
        op = "verify"
        if last:
            if what in ("temperature", "top_p", "min_p"):
                prm[what][0] += np.float32(0.01)
            elif what in ("top_k", "seed", "offset"):
                prm[what][-1] += 1
            elif what == "candidates":
                c[1, 1] += 1
            elif what == "vocab_limit":
                kw["vocab_limit"] = v - 1
            elif what == "return_logprobs":
                kw["return_logprobs"] = True
            elif what == "two_fields":
                prm["temperature"][1] = np.float32(0.25)
                prm["seed"][0] ^= 1
            elif what == "pad_bs":
                kw["pad_bs"] = tp
            elif what == "bs":
                kw["bs"] = pad_bs - 1
            elif what == "op":
                op = "argmax"
            elif what == "dtype":
                dtype = "float16"
        with _comm(
            rank, tp, group, max_pad_bs=pad_bs, num_tokens_per_req=n, vocab_size=v,
            logits_dtype=None if what == "dtype" else "float32", timeout_s=10,
        ) as comm:  # fmt: skip
            rows = kw["pad_bs"] * n
            mine = encode(x[:rows], dtype)
            prm_kw = {k: a[: kw["pad_bs"]] for k, a in prm.items()}

            def call(
                comm: DpSamplingComm = comm, mine: Any = mine, c: Any = c, kw: Any = kw,
                prm_kw: Any = prm_kw, op: str = op,
            ) -> Any:  # fmt: skip
                if op == "argmax":
                    return comm.argmax_batch_vocab(mine, pad_bs=kw["pad_bs"])
                cands = torch.from_numpy(np.ascontiguousarray(c[: kw["pad_bs"]]))
                return comm.verify_batch_vocab(mine, cands, **kw, **prm_kw)

            msg = _expect(rank, what, call)
            assert "call sequences diverged" in msg and "every later call raises" in msg, msg
            assert word in msg, (what, msg)
            if what in ("temperature", "two_fields", "candidates", "vocab_limit"):
                assert "with different" in msg, msg
            assert _expect(rank, what + " again", call) == msg  # poisoned
            messages[what] = msg
    phantom_and_invalid(rank, tp, group)
    return messages


def _expect(rank: int, what: str, call: Any) -> str:
    try:
        call()
    except DpSampleError as exc:
        return str(exc)
    raise AssertionError(f"rank {rank}: {what}: no DpSampleError (results may be wrong)")


def phantom_and_invalid(rank: int, tp: int, group: Any) -> None:
    """Different values in phantom requests are no mismatch; an invalid argument (the
    same on every rank) raises ValueError before anything is exchanged, and the next
    valid call works."""
    with _comm(
        rank, tp, group, max_pad_bs=2 * tp, num_tokens_per_req=2, vocab_size=VS * tp,
        logits_dtype="float32", timeout_s=10,
    ) as comm:  # fmt: skip
        pad_bs, n, v = 2 * tp, 2, VS * tp
        key = (7, 8)
        full = encode(logits(key, pad_bs * n, v, scale=2.0, specials=False), "float32")
        mine = full[:, rank * VS : (rank + 1) * VS].contiguous()
        prm = params(key, pad_bs, "mixed")
        cand = _rng(*key).integers(0, v, (pad_bs, n)).astype(np.int32)
        bad = {k: (None if a is None else a.copy()) for k, a in prm.items()}
        bad["temperature"][-1] = -1.0
        for _ in range(2):  # twice: the rejected call advanced nothing
            try:
                comm.verify_batch_vocab(mine, torch.from_numpy(cand), pad_bs=pad_bs, **bad)
            except ValueError as exc:
                assert "temperature[" in str(exc) and ">= 0" in str(exc), exc
            else:
                raise AssertionError("a negative temperature was accepted")
        # the phantom request's values differ between ranks: no mismatch
        bad["temperature"][-1] = np.float32(-1.0 - rank)
        bad["seed"][-1] = rank
        bs = pad_bs - 1
        got = comm.verify_batch_vocab(mine, torch.from_numpy(cand), pad_bs=pad_bs, bs=bs, **bad)
        want = reference_verify_batch_vocab(
            [storage(full[:, s * VS : (s + 1) * VS].contiguous()) for s in range(tp)],
            cand, tp=tp, pad_bs=pad_bs, dtype="float32", bs=bs, **prm,
        )  # fmt: skip
        for g, w in zip(got, want, strict=True):
            assert np.array_equal(g.numpy()[:bs], w[:bs]), (g, w)


class CountingCollectives:
    """TokenSpeed's ``CommBackend`` shape over torch.distributed, counting its calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def all_gather_into_tensor(self, output: Any, input: Any, group: Any) -> None:
        import torch.distributed as dist

        self.calls.append("all_gather_into_tensor")
        dist.all_gather_into_tensor(output, input, group=group)

    def all_to_all_single(self, output: Any, input: Any, group: Any) -> None:
        import torch.distributed as dist

        self.calls.append("all_to_all_single")
        dist.all_to_all_single(output, input, group=group)


def fallback_verify(rank: int, tp: int, group: Any, seed: int) -> dict[str, Any]:
    """verify_batch_vocab through ``fallback_comm_backend``: every mode against the
    reference, each round one ``all_gather_into_tensor``, and ranks whose parameters
    differ raise on every rank."""
    coll = CountingCollectives()
    n, cases = 3, 0
    with _comm(
        rank, tp, group, max_pad_bs=4 * tp, num_tokens_per_req=n, vocab_size=VS * tp,
        logits_dtype="bfloat16", fallback_comm_backend=coll, timeout_s=20.0,
    ) as comm:  # fmt: skip
        assert "fallback_comm_backend" in comm.explain()
        for i, case in enumerate(
            [
                Case("mixed", 2 * tp, specials=True, vocab_limit=VS * tp - 9),
                Case("top_k_top_p", 4 * tp, bs=4 * tp - 1),
                Case("top_p", 4 * tp, scale=0.1, probes=True, return_logprobs=True),
            ]
        ):
            run_case(comm, rank, tp, (seed, 70, i), case)
            cases += 1
        assert set(coll.calls) == {"all_gather_into_tensor"}, coll.calls
        before = len(coll.calls)
        x = encode(logits((seed, 80), 2 * tp * n, VS * tp, scale=1.0, specials=False), "bfloat16")
        shard = x[:, rank * VS : (rank + 1) * VS].contiguous()
        prm = params((seed, 81), 2 * tp, "temperature")
        if rank == tp - 1:
            prm["temperature"] = prm["temperature"] + np.float32(0.25)
        with pytest.raises(DpSampleError, match="temperature") as info:
            comm.verify_batch_vocab(
                shard,
                torch.zeros(2 * tp, n, dtype=torch.int32),
                pad_bs=2 * tp,
                **{k: None if a is None else torch.from_numpy(a) for k, a in prm.items()},
            )
        diverged = str(info.value)
        mismatch_calls = len(coll.calls) - before
    return {
        "cases": cases,
        "calls": len(coll.calls),
        "mismatch_calls": mismatch_calls,
        "message": diverged,
    }

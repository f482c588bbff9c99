#!/usr/bin/env python3
"""Host time of the sharded ``verify_batch_vocab`` pipeline (``ipc_dpsample.verify_shards``).

Builds LLM-like logits (a peaked head of 1..40 tokens at ``8 + U(4, 14) - 1.2 ln(rank)`` on
an N(0, 2^2) background, as ``docs/verify_contract.md``'s ``llm`` family), runs the
per-rank pipeline (every shard's :func:`shard_records`, :func:`combine_records`, the probe
round when rows are pending, the full-row fallback, :func:`finish_verify`) and prints the
median milliseconds of each stage for these sampling mixes:

greedy, temp (T 0.8), topk (k 50), topk_topp (k 50 + p 0.9), minp (min-p 0.05),
topp (p 0.9 alone), mixed (the above, request by request).

* ``small``: 32 rows (8 requests x 4), V = 32760, tp = 2, bfloat16; the tokens are checked
  against :func:`ipc_dpsample.layout.reference_verify_batch_vocab`.
* ``large``: 1024 rows, V = 152064, tp = 8 (V/tp = 19008): one shard's ``shard_records``
  and one rank's combine (plus probes) are timed.

``per-rank`` is what one rank spends: its own records + combine + probes + fallback +
finish. ``--against FILE`` also loads another copy of ``verify_shards.py`` (e.g. the
original, from ``git show REV:ipc_dpsample/verify_shards.py``) and checks that its records,
probes and tokens are byte-identical to the current module's.

Usage::

    python scripts/profile_verify_shards.py [--case small|large|both] [--reps 7]
        [--modes greedy,temp,...] [--profile MODE] [--against /tmp/orig.py]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ipc_dpsample import verify_shards as vs
from ipc_dpsample.layout import (
    finish_verify,
    reference_verify_batch_vocab,
    verify_params,
)

MODES = ("greedy", "temp", "topk", "topk_topp", "minp", "topp", "mixed")
_MODE_PARAMS = {  # (temperature, top_k, top_p, min_p)
    "greedy": (0.0, 0, 1.0, 0.0),
    "temp": (0.8, 0, 1.0, 0.0),
    "topk": (0.8, 50, 1.0, 0.0),
    "topk_topp": (0.8, 50, 0.9, 0.0),
    "minp": (0.8, 0, 1.0, 0.05),
    "topp": (0.8, 0, 0.9, 0.0),
}


def _bf16(x: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def llm_shards(rng: np.random.Generator, rows: int, v: int, tp: int) -> list[np.ndarray]:
    """bfloat16 shards of LLM-like rows, built shard by shard (no full-row copy)."""
    w = v // tp
    heads = []
    for _ in range(rows):
        h = int(rng.integers(1, 40))
        ids = rng.choice(v, h, replace=False)
        heads.append((ids, 8.0 + rng.uniform(4, 14) - 1.2 * np.log(np.arange(1, h + 1))))
    out = []
    for s in range(tp):
        x = (rng.standard_normal((rows, w), np.float32) * 2.0).astype(np.float32)
        for r, (ids, vals) in enumerate(heads):
            m = (ids >= s * w) & (ids < (s + 1) * w)
            x[r, ids[m] - s * w] = vals[m]
        out.append(_bf16(x))
    return out


def mode_params(mode: str, pad_bs: int, rng: np.random.Generator) -> dict:
    names = list(_MODE_PARAMS) if mode == "mixed" else [mode]
    cols = np.array([_MODE_PARAMS[names[i % len(names)]] for i in range(pad_bs)])
    return dict(
        temperature=cols[:, 0].astype(np.float32),
        top_k=cols[:, 1].astype(np.int32),
        top_p=cols[:, 2].astype(np.float32),
        min_p=cols[:, 3].astype(np.float32),
        seed=rng.integers(0, 2**40, pad_bs),
        offset=rng.integers(0, 2**20, pad_bs),
    )


def _timed(fn, times: dict, name: str):
    t0 = time.perf_counter()
    out = fn()
    times.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)
    return out


def pipeline(mod, shards, cand, params, kw, times: dict, *, time_shards=None):
    """One call: every shard's records (shard 0 timed; all of them when ``time_shards`` is
    None), one rank's combine, probes, fallback and finish. Returns (outputs, records,
    probes, rounds)."""
    tp = len(shards)
    caps = mod.record_caps(params)
    recs = []
    for s in range(tp):

        def f(s=s):
            return mod.shard_records(
                shards[s],
                shard=s,
                tp=tp,
                dtype="bfloat16",
                params=params,
                list_cap=caps[0],
                stair_cap=caps[1],
            )

        timed = time_shards is None or s in time_shards
        recs.append(_timed(f, times, "records/shard") if timed else f())
    comb = _timed(lambda: mod.combine_records(recs, params, stair_cap=caps[1]), times, "combine")
    tokens, token_val = comb.tokens.copy(), comb.token_val.copy()
    probes = []
    left = []
    n2 = 0
    if comb.pending:
        for s in range(tp):

            def f(s=s):
                return mod.probe_records(
                    shards[s], shard=s, dtype="bfloat16", params=params, pending=comb.pending
                )

            timed = time_shards is None or s in time_shards
            probes.append(_timed(f, times, "probes/shard") if timed else f())
        got = _timed(lambda: mod.combine_probes(comb.pending, probes), times, "comb_probes")
        for row, win in got.items():
            if win is None:
                left.append(row)
            else:
                tokens[row], token_val[row] = win
                n2 += 1
    if left:
        rows = np.array(left)

        def full():
            x = np.concatenate([sh[rows] for sh in shards], axis=1)
            return mod.full_row_tokens(x, rows, dtype="bfloat16", params=params)

        tokens[rows], token_val[rows] = _timed(full, times, "full_rows")
    lps = comb.logprobs(token_val)
    out = _timed(lambda: finish_verify(cand, tokens, params, tp, lps), times, "finish")
    rounds = (params.real_rows - n2 - len(left), n2, len(left))
    return out, recs, probes, rounds


STAGES = ("records/shard", "combine", "probes/shard", "comb_probes", "full_rows", "finish")


def run_case(case: str, modes, reps: int, against, seed: int) -> None:
    if case == "small":
        rows_req, n, v, tp = 8, 4, 32760, 2
    else:
        rows_req, n, v, tp = 256, 4, 152064, 8
    pad_bs = rows_req
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    shards = llm_shards(rng, pad_bs * n, v, tp)
    cand = rng.integers(0, v, (pad_bs, n)).astype(np.int32)
    print(
        f"\n== {case}: {pad_bs * n} rows, V={v}, tp={tp}, V/tp={v // tp}, bfloat16 "
        f"(inputs built in {time.perf_counter() - t0:.1f} s), median of {reps} ms"
    )
    hdr = f"{'mode':10s} " + " ".join(f"{s:>13s}" for s in STAGES) + f" {'per-rank':>9s}  rounds"
    print(hdr)
    time_shards = None if case == "small" else {0}
    for mode in modes:
        kw = mode_params(mode, pad_bs, np.random.default_rng(seed + 1))
        if mode == "mixed":
            kw["temperature"][::7] = 0  # some greedy requests too
        params = verify_params(pad_bs=pad_bs, num_tokens_per_req=n, vocab_size=v, **kw)
        times: dict = {}
        for _ in range(reps):
            out, recs, probes, rounds = pipeline(
                vs, shards, cand, params, kw, times, time_shards=time_shards
            )
        if case == "small":
            want = reference_verify_batch_vocab(
                shards, cand, tp=tp, pad_bs=pad_bs, dtype="bfloat16", **kw
            )
            for name, w, g in zip(
                ("predict", "accept_index", "accept_length"), want, out, strict=False
            ):
                if not np.array_equal(w, g):
                    raise SystemExit(f"{case}/{mode}: {name} differs from the reference")
        if against is not None:
            o_out, o_recs, o_probes, o_rounds = pipeline(
                against, shards, cand, params, kw, {}, time_shards=time_shards
            )
            for a, b in zip(recs, o_recs, strict=True):
                if a.tobytes() != b.tobytes():
                    raise SystemExit(f"{case}/{mode}: records differ from --against")
            for a, b in zip(probes, o_probes, strict=True):
                if a.tobytes() != b.tobytes():
                    raise SystemExit(f"{case}/{mode}: probes differ from --against")
            for w, g in zip(o_out, out, strict=True):
                if w.tobytes() != g.tobytes():
                    raise SystemExit(f"{case}/{mode}: outputs differ from --against")
            if o_rounds != rounds:
                raise SystemExit(f"{case}/{mode}: rounds differ from --against")
        med = {k: statistics.median(t) for k, t in times.items()}
        per_rank = sum(med.get(s, 0.0) for s in STAGES)
        cells = " ".join(f"{med[s]:13.2f}" if s in med else f"{'-':>13s}" for s in STAGES)
        print(f"{mode:10s} {cells} {per_rank:9.2f}  {rounds}", flush=True)


def profile(mode: str, case: str, seed: int) -> None:
    rows_req, n, v, tp = (8, 4, 32760, 2) if case == "small" else (256, 4, 152064, 8)
    rng = np.random.default_rng(seed)
    shards = llm_shards(rng, rows_req * n, v, tp)
    cand = rng.integers(0, v, (rows_req, n)).astype(np.int32)
    kw = mode_params(mode, rows_req, np.random.default_rng(seed + 1))
    params = verify_params(pad_bs=rows_req, num_tokens_per_req=n, vocab_size=v, **kw)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(3 if case == "small" else 1):
        pipeline(vs, shards, cand, params, kw, {}, time_shards={0})
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    print(s.getvalue())


def _load(path: str):
    spec = importlib.util.spec_from_file_location("ipc_dpsample._against_verify_shards", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", choices=("small", "large", "both"), default="both")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--large-reps", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--profile", default=None, help="cProfile one mode instead")
    ap.add_argument("--against", default=None, help="another verify_shards.py to compare")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m}; expected some of {MODES}")
    if args.profile:
        profile(args.profile, "small" if args.case == "both" else args.case, args.seed)
        return
    against = _load(args.against) if args.against else None
    if args.case in ("small", "both"):
        run_case("small", modes, args.reps, against, args.seed)
    if args.case in ("large", "both"):
        run_case("large", modes, args.large_reps, against, args.seed)


if __name__ == "__main__":
    main()

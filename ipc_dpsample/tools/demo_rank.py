"""The rank body of ``ipc-dpsample demo`` (:func:`demo_rank`, reused by ``doctor``
for its self-tests): verify every op against the NumPy reference of
:mod:`ipc_dpsample.layout` over several rounds of fresh data, once with a real
batch ``bs < pad_bs`` (real rows only), time the ops (behind the start gate when
rank threads share a GPU), and verify again.

``verify_batch_vocab`` runs on the demo's mix (:data:`~.verify_case.DEMO_MIX`) with
candidates that accept some drafts and reject others (:mod:`.verify_case`). A backend
without the op (:class:`~ipc_dpsample.errors.BackendUnavailableError`, raised before
anything moves) is recorded as not available and its row is neither checked nor timed;
the reference of that op is then not computed.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import BackendUnavailableError
from ..layout import real_reqs
from .common import (
    ARGMAX,
    OPS,
    VERIFY,
    DemoPlan,
    Gate,
    RankData,
    bits_equal,
    logprobs_close,
    make_round,
    rank_device,
    round_logits,
    stream_scope,
    time_gated,
    to_numpy,
    to_torch,
)
from .verify_case import DEMO_MIX, VerifyCase, make_verify_case, mix_params

__all__ = ["demo_rank", "not_available_text", "verify_case"]


@dataclass
class _OpRecord:
    times_s: list[float] = field(default_factory=list)
    checks: int = 0  # outputs compared with the reference
    bs_checks: int = 0  # of them, outputs of the bs < pad_bs pass (real rows only)
    mismatches: list[str] = field(default_factory=list)
    #: Non-empty when the backend lacks the op: "not available on <backend> ...".
    unavailable: str = ""


def not_available_text(backend: str) -> str:
    """What the demo (and the doctor) say for an op the backend lacks."""
    return f"not available on {backend} in this version"


_CASES: dict[tuple[DemoPlan, int], VerifyCase] = {}
_CASES_LOCK = threading.Lock()
#: Verify cases kept per process (a demo run uses ``plan.rounds``).
_CASES_KEPT = 8


def verify_case(plan: DemoPlan, round_: int) -> VerifyCase:
    """``verify_batch_vocab``'s case of one round: every rank's logits of the round
    (:func:`~.common.round_logits`), the demo's mix, the reference's outputs. Built
    once per process (rank threads share it; the first one builds it)."""
    key = (plan, round_)
    with _CASES_LOCK:
        case = _CASES.get(key)
        if case is None:
            if len(_CASES) >= _CASES_KEPT:
                _CASES.clear()
            case = _CASES[key] = make_verify_case(
                round_logits(plan, round_),
                tp=plan.world,
                pad_bs=plan.pad_bs,
                dtype=plan.dtype,
                mix=DEMO_MIX,
                rng=np.random.default_rng([plan.seed, round_, 4]),
            )
        return case


def _timer(cuda: bool, stream: Any, issued: Any = None) -> Any:
    """A callable that times ``fn`` ``n`` times and returns seconds per call."""
    if not cuda:

        def time_cpu(fn: Any, n: int) -> list[float]:
            out = []
            for _ in range(n):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
            return out

        return time_cpu
    import torch

    def time_cuda(fn: Any, n: int) -> list[float]:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for i in range(n):
            starts[i].record(stream)
            fn()
            ends[i].record(stream)
        if issued is not None:
            issued()
        ends[-1].synchronize()
        return [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends, strict=True)]

    return time_cuda


def _gated_timer(group: Any, rank: int, gate: Gate, stream: Any, timeout_s: float) -> Any:
    """A timer like :func:`_timer`'s whose every call starts behind ``gate`` on every
    rank thread at once (:func:`~ipc_dpsample.tools.common.time_gated`)."""

    def time_gated_calls(fn: Any, n: int) -> list[float]:
        return time_gated(group, rank, gate, stream, fn, iters=n, timeout_s=timeout_s)

    return time_gated_calls


def demo_rank(
    rank: int,
    world: int,
    group: Any,
    plan: DemoPlan,
    shared: list[list[RankData]] | None = None,
    gate: Gate | None = None,
) -> dict[str, Any]:
    """Body of one demo rank (for ``run_ranks`` / ``run_threads``).

    Verifies ``plan.rounds`` rounds of fresh data, then round 0 once more with
    ``bs=plan.bs`` (every op; the real rows only), times ``plan.iters`` calls of
    every op, then verifies round 0 again (the buffers were reused in between).

    Parameters
    ----------
    rank, world : int
    group : None (the torch.distributed world) or ThreadGroup
    plan : DemoPlan
    shared : list of rounds of per-rank data, or None
        Prebuilt data (threads share one copy); None builds it here.
    gate : Gate or None
        The gate every rank thread times its calls behind (``plan.gated``); None
        times each call as issued.

    Returns
    -------
    dict
        ``rank``, ``backend``, ``explain``, ``device`` and ``ops``: per op
        ``times_s``, ``checks`` (outputs compared), ``bs_checks`` (of them, with
        ``bs=plan.bs``) and ``mismatches``.
    """
    from ..comm import DpSamplingComm

    cuda = plan.device == "cuda"
    device, stream = rank_device(plan.device, plan.launch, world)
    records = {op: _OpRecord() for op in OPS}

    mine: dict[int, RankData] = {}

    def data(round_: int) -> RankData:
        if shared is not None:
            return shared[round_][rank]
        if round_ not in mine:
            mine[round_] = make_round(plan, round_, [rank])[0]
        return mine[round_]

    with stream_scope(stream):
        comm = DpSamplingComm(
            tp_size=world, rank=rank, group=group, device=device, **plan.comm_options()
        )
        issued = _issued(group, cuda, plan.timeout_s)
        try:
            records[VERIFY].unavailable = _verify_unavailable(comm, plan, data(0), device)
            issued()

            def case(round_: int) -> VerifyCase | None:
                return None if records[VERIFY].unavailable else verify_case(plan, round_)

            for round_ in range(plan.rounds):
                _verify_round(comm, plan, data(round_), case(round_), device, records, issued)
            _verify_round(comm, plan, data(0), case(0), device, records, issued, bs=plan.bs)
            if gate is not None:
                timer = _gated_timer(group, rank, gate, stream, plan.timeout_s)
            else:
                timer = _timer(cuda, stream, issued)
            last = plan.rounds - 1
            _time_ops(comm, plan, data(last), case(last), device, records, timer)
            # reused buffers
            _verify_round(comm, plan, data(0), case(0), device, records, issued)
        finally:
            comm.close()
    return {
        "rank": rank,
        "backend": comm.backend,
        "explain": comm.explain(),
        "device": comm.device,
        "ops": {op: vars(rec) for op, rec in records.items()},
    }


def _tensors(d: RankData, plan: DemoPlan, device: Any) -> dict[str, Any]:
    return {
        "logits": to_torch(d.logits, plan.dtype, device),
        "predict": to_torch(d.predict, "int32", device),
        "accept_index": to_torch(d.accept_index, "int32", device),
        "accept_length": to_torch(d.accept_length, "int32", device),
        "logprobs": to_torch(d.logprobs, "float32", device),
    }


def _issued(group: Any, cuda: bool, timeout_s: float) -> Any:
    """Rank threads sharing a GPU agree that every rank has issued an op before any
    of them blocks on it (see ipc_dpsample.testing.run_threads); a no-op otherwise."""
    if not cuda or group is None:
        return lambda: None
    return lambda: group.barrier(timeout_s=timeout_s, what="op issued")


def _verify_args(
    candidates: np.ndarray, params: dict[str, np.ndarray | None], device: Any
) -> tuple[Any, dict[str, Any]]:
    """``verify_batch_vocab``'s candidates and parameter keywords as torch tensors on
    ``device`` (None stays None: off for every request)."""
    kw = {
        name: None if value is None else to_torch(value, str(value.dtype), device)
        for name, value in params.items()
    }
    return to_torch(candidates, "int32", device), kw


def _verify_unavailable(comm: Any, plan: DemoPlan, d: RankData, device: Any) -> str:
    """``""`` when ``comm`` runs ``verify_batch_vocab``, else :func:`not_available_text`.

    Every rank calls the op once with the round's logits and placeholder candidates (no
    reference needed): a backend without it raises before anything moves, the others
    run one real call."""
    params = mix_params(DEMO_MIX, plan.pad_bs, np.random.default_rng([plan.seed, 1 << 20]))
    placeholder = np.zeros((plan.pad_bs, plan.num_tokens), np.int32)
    cand, kw = _verify_args(placeholder, params, device)
    x = to_torch(d.logits, plan.dtype, device)
    try:
        comm.verify_batch_vocab(x, cand, pad_bs=plan.pad_bs, **kw)
    except BackendUnavailableError:
        return not_available_text(comm.backend)
    return ""


def _verify_round(
    comm: Any,
    plan: DemoPlan,
    d: RankData,
    case: VerifyCase | None,
    device: Any,
    records: dict[str, _OpRecord],
    issued: Any,
    bs: int | None = None,
) -> None:
    """Run every op once on ``d`` (``verify_batch_vocab`` on ``case``, skipped when
    None) and compare with the reference; with ``bs``, pass it to every op and compare
    the real rows only."""
    t = _tensors(d, plan, device)
    pad_bs, n = plan.pad_bs, plan.num_tokens
    kw = {} if bs is None else {"bs": bs}
    real = real_reqs(plan.reqs_per_rank, bs, comm.config.rank) * n  # swap/argmax rows
    rows = pad_bs if bs is None else bs  # gathered rows

    def check(op: str, name: str, got: np.ndarray, exp: np.ndarray, close: bool = False) -> None:
        rec = records[op]
        rec.checks += 1
        rec.bs_checks += bs is not None
        diff = logprobs_close(got, exp, plan.vocab) if close else bits_equal(got, exp)
        if diff:
            rec.mismatches.append(f"{name}{'' if bs is None else f' (bs={bs})'}: {diff}")

    # Each output is copied to the host before the next op is issued (the contract).
    out = comm.swap_batch_vocab(t["logits"], pad_bs=pad_bs, **kw)
    issued()
    check("swap_batch_vocab", "swapped logits", to_numpy(out)[:real], d.expect_swap[:real])
    outs = comm.gather_verify_outputs(
        t["predict"], t["accept_index"], t["accept_length"], pad_bs=pad_bs, **kw
    )
    issued()
    for name, out, exp in zip(
        ("predict", "accept_index", "accept_length"), outs, d.expect_outputs, strict=True
    ):
        check("gather_verify_outputs", name, to_numpy(out)[:rows], exp[:rows])
    lp = comm.gather_verify_logprobs(t["logprobs"], pad_bs=pad_bs, **kw)
    issued()
    check("gather_verify_logprobs", "logprobs", to_numpy(lp)[:rows], d.expect_logprobs[:rows])
    ids, lps = comm.argmax_batch_vocab(t["logits"], pad_bs=pad_bs, **kw)
    issued()
    ids, lps = to_numpy(ids)[:real], to_numpy(lps)[:real]
    check(ARGMAX, "token ids", ids, d.expect_argmax[0][:real])
    check(ARGMAX, "argmax logprobs", lps, d.expect_argmax[1][:real], close=True)
    if case is None:
        return
    cand, params = _verify_args(case.candidates, case.params, device)
    outs = comm.verify_batch_vocab(t["logits"], cand, pad_bs=pad_bs, **params, **kw)
    issued()
    names = ("predict", "accept_index", "accept_length")
    for name, out, exp in zip(names, outs, case.expected, strict=True):
        check(VERIFY, name, to_numpy(out)[:rows], exp[:rows])  # the whole batch's rows


def _time_ops(
    comm: Any,
    plan: DemoPlan,
    d: RankData,
    case: VerifyCase | None,
    device: Any,
    records: dict[str, _OpRecord],
    timer: Any,
) -> None:
    """``plan.iters`` timed calls of every op (``timer(fn, n)``: seconds per call);
    ``verify_batch_vocab`` only with a ``case``."""
    t = _tensors(d, plan, device)
    pad_bs = plan.pad_bs
    calls: dict[str, Any] = {
        "swap_batch_vocab": lambda: comm.swap_batch_vocab(t["logits"], pad_bs=pad_bs),
        "gather_verify_outputs": lambda: comm.gather_verify_outputs(
            t["predict"], t["accept_index"], t["accept_length"], pad_bs=pad_bs
        ),
        "gather_verify_logprobs": lambda: comm.gather_verify_logprobs(t["logprobs"], pad_bs=pad_bs),
        ARGMAX: lambda: comm.argmax_batch_vocab(t["logits"], pad_bs=pad_bs),
    }
    if case is not None:
        cand, params = _verify_args(case.candidates, case.params, device)
        calls[VERIFY] = lambda: comm.verify_batch_vocab(t["logits"], cand, pad_bs=pad_bs, **params)
    for op, fn in calls.items():
        fn()  # one untimed call per op (first-call costs)
        records[op].times_s = timer(fn, plan.iters)

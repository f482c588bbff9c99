"""``ipc-dpsample demo``: run the three collectives on this machine and prove them.

The demo starts as many ranks as the machine supports, feeds every op random
data (never zeros), compares every result bit for bit with the NumPy reference of
:mod:`ipc_dpsample.layout`, times the ops and prints one short table. It exits
with 1 when any rank fails or any output differs from the reference.

How ranks are laid out (:func:`plan_demo`):

* two or more CUDA GPUs: one process per GPU (``run_ranks``);
* exactly one GPU: ``K`` ranks as threads of this process on that GPU
  (``run_threads``, default 4) when the one-sided backend imports, else one rank;
* no GPU (or ``--cpu``): 4 processes over gloo on the CPU.

Shared pieces (machine detection, the plan, seeded data, spawning ranks) live in
:mod:`ipc_dpsample.tools.common`; the rank body :func:`demo_rank` is reused by
``ipc-dpsample doctor`` for its self-tests.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..arrays import normalize_dtype
from ..config import BACKENDS
from .common import (
    CPU_SHAPE,
    GPU_SHAPE,
    OPS,
    DemoPlan,
    Machine,
    RankData,
    bits_equal,
    detect_machine,
    failure_summary,
    make_round,
    rank_device,
    spawn,
    stream_scope,
    to_numpy,
    to_torch,
)

__all__ = [
    "add_arguments",
    "demo_rank",
    "format_report",
    "mismatches",
    "plan_demo",
    "run",
    "run_demo",
    "slowest_rank_times",
]

#: Ranks on a CPU-only machine and as threads on a single GPU.
DEFAULT_CPU_RANKS = 4
DEFAULT_THREAD_RANKS = 4


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def plan_demo(
    machine: Machine,
    *,
    world_size: int | None = None,
    backend: str = "auto",
    iters: int = 20,
    cpu: bool = False,
) -> DemoPlan:
    """Choose ranks and shapes for this machine (pure: no probing, no devices).

    Parameters
    ----------
    machine : Machine
    world_size : int or None
        Ranks; None for the machine's default (GPUs, 4 threads on one GPU, 4 CPU
        processes).
    backend : {"auto", "onesided", "nccl", "torch"}
    iters : int
        Timed calls of each op.
    cpu : bool
        Use the CPU path even where GPUs exist.

    Raises
    ------
    ValueError
        ``world_size`` exceeds what the machine can place (the message says why).
    """
    if world_size is not None and world_size < 1:
        raise ValueError(f"--world-size {world_size} must be >= 1")
    gpus = 0 if cpu else machine.gpus
    if gpus == 0:
        world = world_size or DEFAULT_CPU_RANKS
        why = "--cpu given" if cpu else "no CUDA GPU found"
        return _sized(
            world=world,
            launch="processes",
            device="cpu",
            backend=backend,
            iters=iters,
            note=f"{world} processes over gloo on the CPU ({why})",
            shape=CPU_SHAPE,
        )
    if gpus >= 2:
        world = world_size or gpus
        if world > gpus:
            raise ValueError(
                f"--world-size {world} > {gpus} GPUs: the demo runs one process per GPU "
                f"(use --world-size <= {gpus}, or --cpu for more CPU ranks)"
            )
        return _sized(
            world=world,
            launch="processes",
            device="cuda",
            backend=backend,
            iters=iters,
            note=f"{world} processes, one per GPU",
            shape=GPU_SHAPE,
        )
    threads_ok = backend in ("auto", "onesided") and machine.onesided and machine.cupy_gpus > 0
    if threads_ok:
        world = world_size or DEFAULT_THREAD_RANKS
        return _sized(
            world=world,
            launch="threads",
            device="cuda",
            backend=backend,
            iters=iters,
            note=f"{world} ranks as threads of one process on the one GPU",
            shape=GPU_SHAPE,
        )
    if backend in ("auto", "onesided") and not machine.onesided:
        why = f"the one-sided backend does not import ({machine.onesided_error})"
    elif backend in ("auto", "onesided"):
        why = "CuPy cannot drive the GPU"
    else:
        why = f"backend={backend} needs one GPU per rank"
    if world_size not in (None, 1):
        raise ValueError(
            f"--world-size {world_size} on one GPU needs in-process ranks, which need the "
            f"one-sided backend, but {why}; use --world-size 1 or --cpu"
        )
    return _sized(
        world=1,
        launch="processes",
        device="cuda",
        backend=backend,
        iters=iters,
        note=f"1 rank on the one GPU ({why})",
        shape=GPU_SHAPE,
    )


def _sized(*, shape: dict[str, Any], **fields: Any) -> DemoPlan:
    """A plan with ``shape``, ``pad_bs`` and ``V`` rounded up to multiples of the world."""
    world = int(fields["world"])
    return DemoPlan(
        pad_bs=_round_up(int(shape["pad_bs"]), world),
        num_tokens=int(shape["num_tokens"]),
        vocab=_round_up(int(shape["vocab"]), world),
        dtype=str(shape["dtype"]),
        **fields,
    )


# -- rank body ----------------------------------------------------------------------
@dataclass
class _OpRecord:
    times_s: list[float] = field(default_factory=list)
    checks: int = 0
    mismatches: list[str] = field(default_factory=list)


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


def demo_rank(
    rank: int,
    world: int,
    group: Any,
    plan: DemoPlan,
    shared: list[list[RankData]] | None = None,
) -> dict[str, Any]:
    """Body of one demo rank (for ``run_ranks`` / ``run_threads``).

    Verifies ``plan.rounds`` rounds of fresh data, times ``plan.iters`` calls of
    every op, then verifies round 0 again (the buffers were reused in between).

    Parameters
    ----------
    rank, world : int
    group : None (the torch.distributed world) or ThreadGroup
    plan : DemoPlan
    shared : list of rounds of per-rank data, or None
        Prebuilt data (threads share one copy); None builds it here.

    Returns
    -------
    dict
        ``rank``, ``backend``, ``explain``, ``device`` and ``ops``: per op
        ``times_s``, ``checks`` (outputs compared) and ``mismatches``.
    """
    from ..comm import DpSamplingComm

    cuda = plan.device == "cuda"
    device, stream = rank_device(plan.device, plan.launch, world)
    records = {op: _OpRecord() for op in OPS}

    def data(round_: int) -> RankData:
        if shared is not None:
            return shared[round_][rank]
        return make_round(plan, round_, [rank])[0]

    with stream_scope(stream):
        comm = DpSamplingComm(
            tp_size=world,
            rank=rank,
            group=group,
            max_pad_bs=plan.pad_bs,
            num_tokens_per_req=plan.num_tokens,
            vocab_size=plan.vocab,
            logits_dtype=plan.dtype,
            backend=plan.backend,
            device=device,
            timeout_s=plan.timeout_s,
        )
        issued = _issued(group, cuda, plan.timeout_s)
        try:
            for round_ in range(plan.rounds):
                _verify_round(comm, plan, data(round_), device, records, issued)
            _time_ops(comm, plan, data(plan.rounds - 1), device, records, stream, issued)
            _verify_round(comm, plan, data(0), device, records, issued)  # reused buffers
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


def _verify_round(
    comm: Any,
    plan: DemoPlan,
    d: RankData,
    device: Any,
    records: dict[str, _OpRecord],
    issued: Any,
) -> None:
    t = _tensors(d, plan, device)
    pad_bs = plan.pad_bs
    # Each output is copied to the host before the next op is issued (the contract).
    out = comm.swap_batch_vocab(t["logits"], pad_bs=pad_bs)
    issued()
    got = to_numpy(out)
    _check(records["swap_batch_vocab"], "swapped logits", got, d.expect_swap)
    outs = comm.gather_verify_outputs(
        t["predict"], t["accept_index"], t["accept_length"], pad_bs=pad_bs
    )
    issued()
    rec = records["gather_verify_outputs"]
    for name, out, exp in zip(
        ("predict", "accept_index", "accept_length"), outs, d.expect_outputs, strict=True
    ):
        _check(rec, name, to_numpy(out), exp)
    lp = comm.gather_verify_logprobs(t["logprobs"], pad_bs=pad_bs)
    issued()
    got = to_numpy(lp)
    _check(records["gather_verify_logprobs"], "logprobs", got, d.expect_logprobs)


def _check(rec: _OpRecord, name: str, got: np.ndarray, expected: np.ndarray) -> None:
    rec.checks += 1
    diff = bits_equal(got, expected)
    if diff:
        rec.mismatches.append(f"{name}: {diff}")


def _time_ops(
    comm: Any,
    plan: DemoPlan,
    d: RankData,
    device: Any,
    records: dict[str, _OpRecord],
    stream: Any,
    issued: Any = None,
) -> None:
    t = _tensors(d, plan, device)
    pad_bs = plan.pad_bs
    timer = _timer(plan.device == "cuda", stream, issued)
    calls = {
        "swap_batch_vocab": lambda: comm.swap_batch_vocab(t["logits"], pad_bs=pad_bs),
        "gather_verify_outputs": lambda: comm.gather_verify_outputs(
            t["predict"], t["accept_index"], t["accept_length"], pad_bs=pad_bs
        ),
        "gather_verify_logprobs": lambda: comm.gather_verify_logprobs(t["logprobs"], pad_bs=pad_bs),
    }
    for op, fn in calls.items():
        fn()  # one untimed call per op (first-call costs)
        records[op].times_s = timer(fn, plan.iters)


# -- run and report -----------------------------------------------------------------
def run_demo(plan: DemoPlan, *, timeout_s: float = 240.0) -> list[dict[str, Any]]:
    """Start the ranks of ``plan`` and return every rank's :func:`demo_rank` result.

    Raises
    ------
    ipc_dpsample.testing.RankFailure
        A rank raised or did not finish within ``timeout_s`` (tracebacks included).
    """
    shared = None
    if plan.launch == "threads":  # threads share one copy of the data
        shared = [make_round(plan, k) for k in range(plan.rounds)]
    return spawn(plan.launch, plan.device, plan.world, demo_rank, plan, shared, timeout_s=timeout_s)


def mismatches(results: Sequence[dict[str, Any]]) -> list[str]:
    """Every mismatch any rank reported, as ``rank r op: detail``."""
    return [
        f"rank {res['rank']} {op}: {m}"
        for res in results
        for op, rec in res["ops"].items()
        for m in rec["mismatches"]
    ]


def slowest_rank_times(results: Sequence[dict[str, Any]], op: str) -> list[float]:
    """Per-call time of ``op`` on the slowest rank (the op is done when all are)."""
    per_rank = [res["ops"][op]["times_s"] for res in results]
    return [max(ts) for ts in zip(*per_rank, strict=True)]


def _fmt_time(s: float) -> str:
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def format_report(plan: DemoPlan, results: Sequence[dict[str, Any]]) -> str:
    """The demo's table: backend, shapes, bytes, median and p90 time, verification."""
    backends = sorted({res["backend"] for res in results})
    explain = results[0]["explain"] if results else ""
    lines = [
        f"ipc-dpsample demo: {plan.note}",
        f"backend: {', '.join(backends)} ({explain})",
        f"shapes: pad_bs={plan.pad_bs}, N={plan.num_tokens}, V={plan.vocab}, "
        f"{plan.dtype}, tp={plan.world}; {plan.rounds + 1} verified rounds, "
        f"{plan.iters} timed calls per op",
        "",
    ]
    header = ("op", "input/rank", "output/rank", "dtype", "bytes/rank", "median", "p90", "verified")
    rows = [header]
    for op in OPS:
        times = slowest_rank_times(results, op)
        median = statistics.median(times)
        p90 = float(np.percentile(times, 90))
        bad = sum(len(res["ops"][op]["mismatches"]) for res in results)
        checks = sum(res["ops"][op]["checks"] for res in results)
        ok = "yes" if bad == 0 and checks > 0 else f"NO ({bad}/{checks} wrong)"
        rows.append(
            (
                op,
                *plan.op_shapes(op),
                _fmt_bytes(plan.op_bytes(op)),
                _fmt_time(median),
                _fmt_time(p90),
                f"{ok} ({checks} outputs)" if ok == "yes" else ok,
            )
        )
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
    for r in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return "\n".join(lines)


# -- command line -------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``ipc-dpsample demo``."""
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        metavar="K",
        help="ranks (default: one per GPU; 4 threads on a single GPU; 4 CPU processes)",
    )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="backend to request (IPC_DPSAMPLE_BACKEND overrides it; default: auto)",
    )
    p.add_argument("--iters", type=int, default=20, help="timed calls per op (default: 20)")
    p.add_argument("--cpu", action="store_true", help="use the CPU path even where GPUs exist")
    p.add_argument(
        "--dtype",
        default=None,
        help="logits dtype (bf16, fp16, fp32; default: bf16 on GPUs, fp32 on the CPU)",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="when ranks fail, print every rank's traceback (default: one line, and the "
        "tracebacks go to a log file)",
    )


def run(ns: argparse.Namespace) -> int:
    """Run ``ipc-dpsample demo``; 0 when every output matched the reference."""
    from dataclasses import replace

    from ..testing import RankFailure

    if ns.iters < 1:
        print(f"ipc-dpsample demo: --iters {ns.iters} must be >= 1", file=sys.stderr)
        return 2
    try:
        plan = plan_demo(
            detect_machine(),
            world_size=ns.world_size,
            backend=ns.backend,
            iters=ns.iters,
            cpu=ns.cpu,
        )
        if ns.dtype is not None:
            plan = replace(plan, dtype=normalize_dtype(ns.dtype))
    except (TypeError, ValueError) as exc:
        print(f"ipc-dpsample demo: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        results = run_demo(plan)
    except RankFailure as exc:
        print(_failure_text(plan, str(exc), verbose=ns.verbose), file=sys.stderr)
        return 1
    print(format_report(plan, results))
    bad = mismatches(results)
    elapsed = time.perf_counter() - t0
    if bad:
        print(f"\nFAILED: {len(bad)} outputs differ from the NumPy reference:")
        for line in bad[:20]:
            print(f"  {line}")
        return 1
    print(f"\nOK: every output is bit-identical to the NumPy reference ({elapsed:.1f} s)")
    return 0


def _failure_text(plan: DemoPlan, tracebacks: str, *, verbose: bool) -> str:
    """What the demo prints when ranks fail: one line naming the failing ranks and
    the first error, then where the full tracebacks are (all of them with
    ``verbose``)."""
    line = f"ipc-dpsample demo: FAILED ({plan.note}): {failure_summary(tracebacks)}"
    if verbose:
        return f"{line}\n{tracebacks}"
    log = _write_log(tracebacks)
    where = f"tracebacks in {log}" if log is not None else "rerun with --verbose"
    return f"{line} [{where}; --verbose prints them]"


def _write_log(text: str) -> Path | None:
    """Write ``text`` to a fresh log file in the temp folder; None when it cannot."""
    import tempfile

    try:
        fd, name = tempfile.mkstemp(prefix="ipc-dpsample-demo-", suffix=".log")
        with open(fd, "w") as f:
            f.write(text)
    except OSError:
        return None
    return Path(name)

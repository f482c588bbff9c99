"""``ipc-dpsample demo``: run the three collectives, ``argmax_batch_vocab`` and
``verify_batch_vocab`` on this machine and prove them.

The demo starts as many ranks as the machine supports, feeds every op random
data (never zeros), compares every result with the NumPy reference of
:mod:`ipc_dpsample.layout` (bit for bit; the argmax's logprobs within
:func:`~ipc_dpsample.tools.common.logprob_atol` of the float64 reference), once
also with a real batch ``bs < pad_bs`` (real rows only), times the ops and prints
one short table whose header says what was timed (:func:`timing_text`). It exits
with 1 when any rank fails or any output differs from the reference.

``verify_batch_vocab`` samples a serving mix (half greedy, half temperature 0.8 with
top-k 50 and top-p 0.9, :data:`~.verify_case.DEMO_MIX`) with candidates that accept
some drafts and reject others; every backend runs it (onesided and nccl in their
kernels, torch by its host algorithm). A backend that refuses it with
``BackendUnavailableError`` would get the row "not available on <backend> in this
version", which is not a failure (:func:`verify_note` is the row's footnote: the
record bytes).

How ranks are laid out (:func:`plan_demo`):

* two or more CUDA GPUs: one process per GPU (``run_ranks``);
* exactly one GPU: ``K`` ranks as threads of this process on that GPU
  (``run_threads``, default 4) when the one-sided backend imports, else one rank;
* no GPU (or ``--cpu``): 4 processes over gloo on the CPU.

Rank threads sharing the GPU time every call behind a
:class:`~ipc_dpsample.tools.common.Gate` (``DemoPlan.gated``): the device time of
the op with every rank released at once. Ungated (``--ungated``), the time of a
small op is the threads' turns at the GIL (260 us for a gather that takes a few
us on the device, seen on an H200 with four rank threads).

Shared pieces (machine detection, the plan, seeded data, spawning ranks) live in
:mod:`ipc_dpsample.tools.common`; the rank body :func:`demo_rank`
(:mod:`ipc_dpsample.tools.demo_rank`) is reused by ``ipc-dpsample doctor`` for
its self-tests.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..arrays import normalize_dtype
from ..config import BACKENDS
from .common import (
    CPU_SHAPE,
    GPU_SHAPE,
    OPS,
    VERIFY,
    DemoPlan,
    DeviceKind,
    Gate,
    Launch,
    Machine,
    detect_machine,
    failure_summary,
    make_round,
    ranks_share_gpu,
    spawn,
)
from .demo_rank import demo_rank
from .verify_case import DEMO_MIX, mix_text, onesided_broadcasts, record_bytes

__all__ = [
    "DESCRIPTION",
    "add_arguments",
    "demo_rank",
    "format_report",
    "mismatches",
    "plan_demo",
    "run",
    "run_demo",
    "slowest_rank_times",
    "timing_text",
    "unavailable",
    "verify_note",
]

#: ``ipc-dpsample demo --help``: plain text (argparse prints it as is).
DESCRIPTION = """\
Run the three collectives, argmax_batch_vocab and verify_batch_vocab on this
machine and prove them. Every op gets random data, and every output is
compared with the NumPy reference: bit for bit, the argmax's logprobs within
a float32 tolerance of a float64 reference, once also with a real batch
bs < pad_bs (real rows only). Then every op is timed and one short table is
printed.

verify_batch_vocab samples a serving mix (half greedy, half temperature 0.8
with top-k 50 and top-p 0.9) with drafts that are accepted and rejected, on
every backend (onesided, nccl, torch).

Ranks: one process per GPU with two or more GPUs; 4 rank threads sharing the
GPU with one GPU (when the one-sided backend imports, else one rank); 4 CPU
processes over gloo without a GPU or with --cpu.

Timing: rank threads sharing a GPU are released together for every timed call
(each rank's stream waits at one CUDA event until all have issued it), so the
table shows device time; --ungated shows the host path instead. The header of
the table says what was measured.

Exit status: 0 when every output matched the reference, 1 when a rank failed
or an output differed, 2 on a usage error."""

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
    ungated: bool = False,
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
    ungated : bool
        Time rank threads sharing a GPU as their calls are issued (the host path)
        instead of behind the gate (:attr:`DemoPlan.gated`, the default there).

    Raises
    ------
    ValueError
        ``world_size`` exceeds what the machine can place (the message says why).
    """
    if world_size is not None and world_size < 1:
        raise ValueError(f"--world-size {world_size} must be >= 1")
    gpus = 0 if cpu else machine.gpus
    world, launch, device, note = _placement(machine, gpus, world_size, backend, cpu)
    return _sized(
        world=world,
        launch=launch,
        device=device,
        backend=backend,
        iters=iters,
        note=note,
        shape=GPU_SHAPE if device == "cuda" else CPU_SHAPE,
        gated=ranks_share_gpu(launch, device) and not ungated,
    )


def _placement(
    machine: Machine, gpus: int, world_size: int | None, backend: str, cpu: bool
) -> tuple[int, Launch, DeviceKind, str]:
    """``(world, launch, device, note)`` of :func:`plan_demo` (same errors)."""
    if gpus == 0:
        world = world_size or DEFAULT_CPU_RANKS
        why = "--cpu given" if cpu else "no CUDA GPU found"
        return world, "processes", "cpu", f"{world} processes over gloo on the CPU ({why})"
    if gpus >= 2:
        world = world_size or gpus
        if world > gpus:
            raise ValueError(
                f"--world-size {world} > {gpus} GPUs: the demo runs one process per GPU "
                f"(use --world-size <= {gpus}, or --cpu for more CPU ranks)"
            )
        return world, "processes", "cuda", f"{world} processes, one per GPU"
    threads_ok = backend in ("auto", "onesided") and machine.onesided and machine.cupy_gpus > 0
    if threads_ok:
        world = world_size or DEFAULT_THREAD_RANKS
        return world, "threads", "cuda", f"{world} ranks as threads of one process on the one GPU"
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
    return 1, "processes", "cuda", f"1 rank on the one GPU ({why})"


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
    gate = Gate() if plan.gated else None  # one object for every rank thread
    return spawn(
        plan.launch, plan.device, plan.world, demo_rank, plan, shared, gate, timeout_s=timeout_s
    )


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


def timing_text(plan: DemoPlan) -> tuple[str, str]:
    """What the demo's times are: a short label for the time columns and one line
    for the table's header."""
    w = plan.world
    if plan.device == "cpu":
        return "wall clock", (
            f"timing: host wall clock (perf_counter) of each call, the slowest of the {w} CPU "
            "rank processes per call"
        )
    if plan.gated:
        return "gated", (
            f"timing: gated device time: the {w} rank threads sharing the GPU are released "
            "together for every call (each rank's stream waits at one CUDA event until all "
            "have issued it); CUDA events, the slowest rank per call"
        )
    if plan.launch == "threads":
        return "host path", (
            f"timing: host path, ungated (--ungated): the {w} rank threads sharing the GPU "
            "issue each call in their turn at the GIL, so its time includes that launch "
            "skew; CUDA events, the slowest rank per call"
        )
    return "events", (
        f"timing: CUDA events around each call on each rank's stream, {w} process"
        f"{'es' if w > 1 else ''}, one per GPU (not gated: no GPU is shared); the slowest "
        "rank per call"
    )


def format_report(plan: DemoPlan, results: Sequence[dict[str, Any]]) -> str:
    """The demo's table: backend, shapes, bytes, median and p90 time (what was timed
    in the header: :func:`timing_text`), verification."""
    backends = sorted({res["backend"] for res in results})
    explain = results[0]["explain"] if results else ""
    lines = [
        f"ipc-dpsample demo: {plan.note}",
        f"backend: {', '.join(backends)} ({explain})",
        f"shapes: pad_bs={plan.pad_bs}, N={plan.num_tokens}, V={plan.vocab}, "
        f"{plan.dtype}, tp={plan.world}; {plan.rounds + 1} verified rounds and one with "
        f"bs={plan.bs} real requests (real rows checked), {plan.iters} timed calls per op",
    ]
    label, timing = timing_text(plan)
    lines += [timing, ""]
    header = ("op", "input/rank", "output/rank", "dtype", "bytes/rank")
    header += (f"median ({label})", f"p90 ({label})", "verified")
    rows = [header]
    for op in OPS:
        missing = unavailable(results, op)
        if missing:
            rows.append((op, *plan.op_shapes(op), _fmt_bytes(plan.op_bytes(op)), "-", "-", missing))
            continue
        times = slowest_rank_times(results, op)
        median = statistics.median(times)
        p90 = float(np.percentile(times, 90))
        bad = sum(len(res["ops"][op]["mismatches"]) for res in results)
        checks = sum(res["ops"][op]["checks"] for res in results)
        with_bs = sum(res["ops"][op].get("bs_checks", 0) for res in results)
        ok = "yes" if bad == 0 and checks > 0 else f"NO ({bad}/{checks} wrong)"
        rows.append(
            (
                op,
                *plan.op_shapes(op),
                _fmt_bytes(plan.op_bytes(op)),
                _fmt_time(median),
                _fmt_time(p90),
                f"{ok} ({checks} outputs, {with_bs} with bs={plan.bs})" if ok == "yes" else ok,
            )
        )
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
    for r in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    lines.append(verify_note(plan, backends[0] if len(backends) == 1 else "torch"))
    return "\n".join(lines)


def unavailable(results: Sequence[dict[str, Any]], op: str) -> str:
    """``"not available on <backend> in this version"`` when a rank's backend lacks
    ``op`` (it was neither checked nor timed), else ``""``."""
    return next(
        (
            res["ops"][op].get("unavailable", "")
            for res in results
            if res["ops"][op].get("unavailable")
        ),
        "",
    )


def verify_note(plan: DemoPlan, backend: str = "torch") -> str:
    """The footnote of the table's ``verify_batch_vocab`` row: its mix, and the bytes its
    records move against the swap's (the torch backend all-gathers every row's records;
    the GPU kernels send each record to the row's owner only, except that the one-sided
    kernels broadcast the records of small batches: ``verify_plan.verify_broadcast``)."""
    rec = record_bytes(DEMO_MIX, plan.pad_bs, plan.num_tokens, plan.vocab, backend=backend)
    peers = plan.world - 1
    rows = plan.pad_bs // plan.world if backend in ("onesided", "nccl") else plan.pad_bs
    if backend == "onesided" and onesided_broadcasts(
        DEMO_MIX, plan.pad_bs, plan.num_tokens, plan.vocab, plan.world
    ):
        rows = plan.pad_bs
    moved = peers * rows * plan.num_tokens * rec
    return (
        f"note: {VERIFY}'s mix: {mix_text(DEMO_MIX)}; 0 to N-1 drafts accepted per "
        f"request; a {rec} B record per row per shard, {_fmt_bytes(moved)} received per "
        f"rank from its {peers} "
        f"peer{'s' if peers != 1 else ''} (swap_batch_vocab: "
        f"{_fmt_bytes(plan.op_bytes('swap_batch_vocab'))})"
    )


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
        "--ungated",
        action="store_true",
        help="rank threads sharing a GPU: time each call as issued (the host path, which "
        "includes their turns at the GIL) instead of behind the gate (the default there: "
        "every rank's stream waits at one CUDA event until all ranks have issued the call, "
        "so the time is device time); one process per GPU and the CPU are never gated",
    )
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
            ungated=ns.ungated,
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
    missing = unavailable(results, VERIFY)
    print(
        "\nOK: every output matches the NumPy reference: bit for bit, argmax logprobs within "
        f"the float32 tolerance of the float64 reference ({elapsed:.1f} s)"
        + (f"; {VERIFY} {missing}" if missing else "")
    )
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

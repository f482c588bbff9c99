"""The rank body of ``ipc-dpsample bench``: for every impl and point, set up,
verify, warm up, build (eager call or CUDA graph) and time, with every rank
agreeing on each step's outcome (ok, skipped or failed) so that all take the same
branch.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from ..common import GATE_CYCLES, Gate, rank_device, stream_scope, time_gated
from .config import BenchConfig, LaunchPlan, points
from .runners import CAPTURE_LOCK, PointSkipped, Prepared, RankCtx, Runner, make_runner

__all__ = ["GATE_CYCLES", "Gate", "bench_point", "bench_rank"]


def _build(ctx: RankCtx, prep: Prepared, mode: str) -> tuple[Callable[[], Any], int, Any]:
    """What one timed sample runs, how many calls it holds, and the output of its
    last call: ``prep.fn`` itself (eager; no output kept), or the replay of a CUDA
    graph that captured ``cfg.graph_ops`` calls (graph). A graph is reused by the
    next points of the same ``prep.graph_key`` (their ``bs`` is a device value the
    runner wrote). Purely local: capturing launches nothing; the caller quiesces
    every rank before anyone replays."""
    if mode != "graph":
        return prep.fn, 1, None
    import torch

    if prep.graph_key is not None and ctx.keep is not None and ctx.keep[0] == prep.graph_key:
        _, graph, last = ctx.keep
        return graph.replay, ctx.cfg.graph_ops, last
    ctx.keep = None  # free the previous graph first
    graph = torch.cuda.CUDAGraph()
    # torch.cuda.graph synchronises the device and empties the cache on entry: rank
    # threads sharing a GPU capture one at a time (capturing launches nothing).
    with (
        CAPTURE_LOCK,
        torch.cuda.graph(graph, stream=ctx.stream, capture_error_mode="thread_local"),
    ):
        for _ in range(ctx.cfg.graph_ops):
            last = prep.fn()
    ctx.keep = (prep.graph_key, graph, last)  # replays need it alive
    return graph.replay, ctx.cfg.graph_ops, last


def _verify(ctx: RankCtx, prep: Prepared, call: Callable[[], Any], out: Any = None) -> str:
    """Run ``call`` once on every rank, wait for all, and check ``out`` (or what
    ``call`` returned): ``""`` when right."""
    got = call()
    ctx.sync_all()
    assert prep.check is not None
    return prep.check(got if out is None else out)


def _time(ctx: RankCtx, body: Callable[[], Any], calls: int) -> list[float]:
    """Seconds per call: ``cfg.iters`` samples of ``body`` (holding ``calls`` calls)
    after a host barrier; CUDA events on the rank's stream, or ``perf_counter``."""
    cfg = ctx.cfg
    if ctx.stream is None:
        ctx.host.barrier(timeout_s=cfg.timeout_s, what="bench point")
        out = []
        for _ in range(cfg.iters):
            t0 = time.perf_counter()
            body()
            out.append((time.perf_counter() - t0) / calls)
        return out
    import torch

    if ctx.gate is not None:
        return _time_gated(ctx, body, calls)
    if calls > 1:
        body()  # the first replay uploads the graph
        ctx.sync_all()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(cfg.iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(cfg.iters)]
    ctx.host.barrier(timeout_s=cfg.timeout_s, what="bench point")
    for i in range(cfg.iters):
        starts[i].record(ctx.stream)
        body()
        ends[i].record(ctx.stream)
    ctx.sync_all()
    return [s.elapsed_time(e) / 1e3 / calls for s, e in zip(starts, ends, strict=True)]


def _time_gated(ctx: RankCtx, body: Callable[[], Any], calls: int) -> list[float]:
    """Like :func:`_time`, but each sample starts behind the shared
    :class:`~ipc_dpsample.tools.common.Gate` (:func:`~ipc_dpsample.tools.common.time_gated`):
    an eager sample issues ``cfg.graph_ops`` calls back to back, a graph sample one
    replay (of ``calls`` calls)."""
    cfg = ctx.cfg
    if calls > 1:
        body()  # the first replay uploads the graph
        ctx.sync_all()
    return time_gated(
        ctx.host,
        ctx.rank,
        ctx.gate,
        ctx.stream,
        body,
        iters=cfg.iters,
        timeout_s=cfg.timeout_s,
        repeat=cfg.graph_ops if calls == 1 else 1,
        calls=calls,
    )


def point_summary(status: str, note: str, verified: bool | None, times: list[float]) -> str:
    """One point's outcome for the progress line, printed as soon as it is measured
    (a run stopped later still shows it): this rank's median and 10th-90th percentile
    of the samples in microseconds, and whether the result was checked."""
    if status != "ok" or not times:
        return f"{status}{f' ({note})' if note else ''}"
    import numpy as np

    us = np.asarray(times, dtype=np.float64) * 1e6
    p10, med, p90 = np.percentile(us, [10, 50, 90])
    check = {True: "checked", False: "WRONG", None: "not checked"}[verified]
    return f"median {med:.1f} us [p10 {p10:.1f}, p90 {p90:.1f}], n={len(us)}, {check}"


def _progress(total: int, desc: str) -> Any:
    """tqdm on a terminal when it imports, else :class:`_SimpleBar`."""
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm

            return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)
        except ImportError:
            pass
    return _SimpleBar(total, desc, tty=sys.stderr.isatty())


class _SimpleBar:
    """Progress on stderr: a redrawn bar on a terminal; in a log, a line per
    point with what it was and the seconds since the start (a stalled run shows
    where it stands)."""

    def __init__(self, total: int, desc: str, *, tty: bool) -> None:
        self.total, self.desc, self.n, self.tty = max(1, total), desc, 0, tty
        self.what = ""
        self.t0 = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.tty:
            done = int(30 * self.n / self.total)
            bar = "#" * done + " " * (30 - done)
            sys.stderr.write(f"\r{self.desc} [{bar}] {self.n}/{self.total}")
        else:
            took = time.monotonic() - self.t0
            sys.stderr.write(f"{self.desc}: {self.n}/{self.total} {self.what} ({took:.1f} s)\n")
        sys.stderr.flush()

    def set_postfix_str(self, text: str) -> None:
        self.what = text

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


def bench_rank(
    rank: int, world: int, group: Any, lp: LaunchPlan, cfg: BenchConfig, gate: Any = None
) -> dict[str, Any]:
    """Body of one benchmark rank (for ``run_ranks`` / ``run_threads``).

    Returns
    -------
    dict
        ``samples``: ``{(impl, op, dtype, pad_bs, bs, mode, mix): [seconds]}``; ``info``:
        per key ``status`` (``ok``, ``failed`` or ``skipped``), ``note``,
        ``verified`` (True/False, None for baselines), ``resolved`` (the backend
        that ran) and ``bs_arg`` (``host``, ``device`` or ``none``).
    """
    from ...group import TorchStoreGroup

    device, stream = rank_device(lp.device, lp.launch, world)  # type: ignore[arg-type]
    host = group if group is not None else TorchStoreGroup(None)
    ctx = RankCtx(rank, group, host, device, stream, cfg, lp, gate=gate)
    samples: dict[tuple[Any, ...], list[float]] = {}
    info: dict[tuple[Any, ...], dict[str, Any]] = {}
    total = sum(len(points(cfg, lp, impl)) for impl in lp.impls)
    bar = _progress(total, f"tp={lp.tp} {lp.launch} {lp.device}") if rank == 0 else None
    try:
        with stream_scope(stream):
            for impl in lp.impls:
                _bench_impl(ctx, impl, samples, info, bar)
    finally:
        if bar is not None:
            bar.close()
    mine = gate is not None and rank == 0
    return {
        "samples": samples,
        "info": info,
        "gate_early": gate.early if mine else 0,
        "gate_skewed": gate.skewed if mine else 0,
        "gate_cycles": gate.cycles if mine else 0,
    }


def _bench_impl(
    ctx: RankCtx,
    impl: str,
    samples: dict[tuple[Any, ...], list[float]],
    info: dict[tuple[Any, ...], dict[str, Any]],
    bar: Any,
) -> None:
    cfg, lp = ctx.cfg, ctx.lp
    pts = points(cfg, lp, impl)
    runner: Runner | None = None
    note = ""
    try:
        runner = make_runner(ctx, impl)
    except Exception as exc:
        note = f"{type(exc).__name__}: {exc}".splitlines()[0]
    if not ctx.agree(runner is not None, f"start {impl}"):
        note = note or "another rank could not start it"
        for pt in pts:
            info[(impl, *pt)] = _info("skipped", note, None, None)
        if runner is not None:
            runner.close()
        if bar is not None:
            bar.update(len(pts))
        return
    assert runner is not None
    broken_modes: dict[str, str] = {}
    try:
        for op, dtype, pad_bs, bs, mode, mix in pts:
            key = (impl, op, dtype, pad_bs, bs, mode, mix)
            what = f"{impl} {op}{f' [{mix}]' if mix else ''} {dtype} pad_bs={pad_bs} bs={bs}"
            if bar is not None:
                bar.set_postfix_str(f"{what} {mode}")
            if mode in broken_modes:
                info[key] = _info("failed", broken_modes[mode], None, runner.resolved)
                if bar is not None:
                    bar.update()
                continue
            status, note, verified, step, bs_arg = bench_point(ctx, runner, key, samples)
            if status == "failed" and step == "graph":
                broken_modes["graph"] = f"graph capture failed earlier: {note}"
            info[key] = _info(status, note, verified, runner.resolved, bs_arg)
            samples.setdefault(key, [])
            if bar is not None:
                bar.set_postfix_str(
                    f"{what} {mode}: {point_summary(status, note, verified, samples[key])}"
                )
                bar.update()
    finally:
        ctx.keep = None
        ctx.sync()
        runner.close()


def bench_point(
    ctx: RankCtx,
    runner: Runner,
    key: tuple[Any, ...],
    samples: dict[tuple[Any, ...], list[float]],
) -> tuple[str, str, bool | None, str, str]:
    """Measure one point: set up (prepare, check an eager call, warm up), build
    (eager call or captured graph, whose replay is checked too), time. Each step
    ends with an agreement of all ranks, so every rank takes the same branch even
    when one fails. A runner's :class:`~.runners.PointSkipped` (raised by ``prepare``)
    skips the point on every rank, unless a rank failed.

    Returns
    -------
    (status, note, verified, failed step, bs_arg)
        ``status`` is ``ok``, ``skipped`` or ``failed``; ``verified`` None when not
        checked.
    """
    _impl, op, dtype, pad_bs, bs, mode, mix = key
    cfg = ctx.cfg
    verified: bool | None = None
    note = ""
    prep = Prepared(_noop)
    body: Callable[[], Any] = _noop
    calls = 1
    for step in ("setup", mode, "timing"):
        error = skip = ""
        try:
            if step == "setup":
                prep = runner.prepare(op, dtype, pad_bs, bs, mode, mix)
                ctx.quiesce("inputs prepared")
                if prep.check is not None and cfg.verify:
                    diff = _verify(ctx, prep, prep.fn)
                    verified = not diff
                    note = f"WRONG RESULT: {diff}" if diff else ""
                ctx.quiesce("checked")  # the check may allocate and load kernels
                for _ in range(cfg.warmup):
                    prep.fn()
                ctx.sync_all()
            elif step == "timing":
                samples[key] = _time(ctx, body, calls)
            else:
                body, calls, last = _build(ctx, prep, mode)
                # torch.cuda.graph synchronises the device on entry: no rank replays
                # while a peer still captures (its sync would wait for the replay's
                # spinning kernels, which wait for that peer)
                ctx.quiesce("captured")
                if calls > 1 and prep.check is not None and cfg.verify:
                    diff = _verify(ctx, prep, body, last)  # the replay, at this bs
                    verified = bool(verified) and not diff
                    note = note or (f"WRONG RESULT after graph replay: {diff}" if diff else "")
        except PointSkipped as exc:
            skip = str(exc).splitlines()[0]
            ctx.keep = None
        except Exception as exc:
            error = f"{step}: {type(exc).__name__}: {exc}".splitlines()[0]
            ctx.keep = None
            _recover(ctx)
        outcome = ctx.outcome(2 if error else 1 if skip else 0, f"{key} {step}")
        if outcome == 2:
            ctx.keep = None
            return "failed", error or f"{step} failed on another rank", verified, step, prep.bs_arg
        if outcome == 1:
            return "skipped", skip or "skipped on another rank", None, step, prep.bs_arg
    return "ok", note, verified, "", prep.bs_arg


def _noop() -> None:
    return None


def _recover(ctx: RankCtx) -> None:
    try:
        ctx.sync()
    except Exception:
        pass


def _info(
    status: str, note: str, verified: bool | None, resolved: str | None, bs_arg: str = ""
) -> dict[str, Any]:
    return {
        "status": status,
        "note": note,
        "verified": verified,
        "resolved": resolved,
        "bs_arg": bs_arg,
    }

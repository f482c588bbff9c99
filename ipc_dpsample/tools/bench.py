"""``ipc-dpsample bench``: sweep the collectives against their baselines.

For every tensor-parallel size ``tp`` the sweep starts one set of ranks:

* ``tp <= GPUs``: one process per GPU (``run_ranks``; NCCL and torch.distributed
  run there too);
* ``tp > GPUs`` (e.g. one GPU): ``tp`` threads of one process on GPU 0
  (``run_threads``; only the one-sided backend can run so);
* ``--cpu`` or no GPU: ``tp`` processes over gloo on the CPU.

Each rank measures, for every point ``(op, dtype, pad_bs, mode)``, every
requested backend of :class:`~ipc_dpsample.DpSamplingComm` (verified bit for bit
once before timing) and, in the same run, the baselines:

``copy``
    The copy limit: each rank copies the op's bytes per rank with one
    ``copy_`` (device-to-device on one GPU, to the next GPU peer-to-peer with
    one GPU per rank, ``memcpy`` on the CPU).
``nccl_cupy``
    Raw NCCL through ``cupy.cuda.nccl``: grouped send/recv all-to-all for the swap,
    ``allGather`` for the gathers (no layout permutation; one GPU per rank).
``torch_dist``
    Raw ``torch.distributed.all_to_all_single`` / ``all_gather_into_tensor``.

Timing: ranks meet at a host barrier before each point; every call (eager) or
every replay of a CUDA graph holding ``--graph-ops`` calls (graph; divided by
that count) is timed with CUDA events (``perf_counter`` on the CPU). A sample is
the slowest rank's time for that call. Reported: median, p10, p90, bytes per
rank, algorithmic and bus bandwidth, and ``vs_<baseline>`` = baseline median /
median (above 1: faster than the baseline; against ``copy``: the fraction of the
copy limit reached).

``--out`` receives ``bench.csv``, ``bench.json`` and ``bench.png``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..arrays import ITEMSIZE, LOGITS_DTYPES, normalize_dtype
from .common import OPS, Machine, detect_machine

__all__ = [
    "BACKEND_CHOICES",
    "BASELINES",
    "COLUMNS",
    "BenchConfig",
    "LaunchPlan",
    "bench_rank",
    "config_from_args",
    "make_rows",
    "plan_launches",
    "points",
    "summarize",
    "write_csv",
    "write_json",
    "write_plot",
]

BACKEND_CHOICES: tuple[str, ...] = ("auto", "onesided", "nccl", "torch")
BASELINES: tuple[str, ...] = ("copy", "nccl_cupy", "torch_dist")
MODES: tuple[str, ...] = ("eager", "graph")
#: Sweep defaults where GPUs exist (the spec's shapes: Qwen-class vocab, 3 drafts + 1).
GPU_DEFAULTS: dict[str, Any] = {
    "pad_bs": (8, 64, 256),
    "vocab": 152064,
    "dtypes": ("bfloat16", "float32"),
    "tp": (2, 4, 8),
}
#: Sweep defaults on the CPU path (gloo moves the bytes; sized for a small box).
CPU_DEFAULTS: dict[str, Any] = {
    "pad_bs": (8, 64),
    "vocab": 32000,
    "dtypes": ("float32",),
    "tp": (2, 4),
}
#: Columns of ``bench.csv`` (and keys of every row in ``bench.json``).
COLUMNS: tuple[str, ...] = (
    "tp",
    "launch",
    "device",
    "op",
    "dtype",
    "pad_bs",
    "num_tokens",
    "vocab",
    "mode",
    "impl",
    "kind",
    "resolved",
    "status",
    "verified",
    "n",
    "median_us",
    "p10_us",
    "p90_us",
    "mean_us",
    "min_us",
    "max_us",
    "bytes",
    "algbw_gbps",
    "busbw_gbps",
    "vs_copy",
    "vs_nccl_cupy",
    "vs_torch_dist",
    "note",
)


# -- configuration ------------------------------------------------------------------
@dataclass(frozen=True)
class BenchConfig:
    """A validated sweep.

    Raises
    ------
    ValueError
        On an empty list, a non-positive size or an unknown name.
    """

    pad_bs: tuple[int, ...] = GPU_DEFAULTS["pad_bs"]
    num_tokens: int = 4
    vocab: int = GPU_DEFAULTS["vocab"]
    dtypes: tuple[str, ...] = GPU_DEFAULTS["dtypes"]
    tp: tuple[int, ...] = GPU_DEFAULTS["tp"]
    backends: tuple[str, ...] = BACKEND_CHOICES
    modes: tuple[str, ...] = MODES
    ops: tuple[str, ...] = OPS
    baselines: tuple[str, ...] = BASELINES
    iters: int = 50
    warmup: int = 10
    graph_ops: int = 10
    out: str = "ipc-dpsample-bench"
    cpu: bool = False
    verify: bool = True
    seed: int = 0
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        for name in ("pad_bs", "dtypes", "tp", "backends", "modes", "ops"):
            if not getattr(self, name):
                raise ValueError(f"{name} must not be empty")
        for name, values in (("pad_bs", self.pad_bs), ("tp", self.tp)):
            bad = [v for v in values if v < 1]
            if bad:
                raise ValueError(f"{name} values {bad} must be >= 1")
        for name, value in (("num_tokens", self.num_tokens), ("vocab", self.vocab)):
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if self.iters < 1 or self.warmup < 0 or self.graph_ops < 1:
            raise ValueError(
                f"iters={self.iters} must be >= 1, warmup={self.warmup} >= 0, "
                f"graph_ops={self.graph_ops} >= 1"
            )
        for name, values, allowed in (
            ("dtypes", self.dtypes, LOGITS_DTYPES),
            ("backends", self.backends, BACKEND_CHOICES),
            ("modes", self.modes, MODES),
            ("ops", self.ops, OPS),
            ("baselines", self.baselines, BASELINES),
        ):
            bad = [v for v in values if v not in allowed]
            if bad:
                raise ValueError(f"{name} {bad} not in {allowed}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be > 0")


def parse_int_list(text: str) -> tuple[int, ...]:
    """``"8,64,256"`` -> ``(8, 64, 256)`` (argparse ``type=``)."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("empty list")
    return values


def parse_dtype_list(text: str) -> tuple[str, ...]:
    """``"bf16,fp32"`` -> ``("bfloat16", "float32")`` (argparse ``type=``)."""
    out = []
    for v in text.split(","):
        if not v.strip():
            continue
        try:
            name = normalize_dtype(v.strip())
        except TypeError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if name not in LOGITS_DTYPES:
            raise argparse.ArgumentTypeError(f"{v!r}: logits dtypes are {LOGITS_DTYPES}")
        out.append(name)
    if not out:
        raise argparse.ArgumentTypeError("empty list")
    return tuple(dict.fromkeys(out))


def choice_list(choices: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """An argparse ``type=`` for a comma-separated subset of ``choices``."""

    def parse(text: str) -> tuple[str, ...]:
        values = tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
        bad = [v for v in values if v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected a comma-separated subset of {','.join(choices)}"
            )
        return values

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``ipc-dpsample bench``."""

    def dflt(key: str) -> str:
        g, c = GPU_DEFAULTS[key], CPU_DEFAULTS[key]
        if isinstance(g, tuple):
            return f"default {','.join(map(str, g))}; --cpu: {','.join(map(str, c))}"
        return f"default {g}; --cpu: {c}"

    p.add_argument("--pad-bs", type=parse_int_list, help=f"padded batch sizes ({dflt('pad_bs')})")
    p.add_argument("--num-tokens", type=int, default=4, help="N, rows per request (default 4)")
    p.add_argument("--vocab", type=int, help=f"communication vocab V ({dflt('vocab')})")
    p.add_argument("--dtype", type=parse_dtype_list, help=f"logits dtypes ({dflt('dtypes')})")
    p.add_argument("--tp", type=parse_int_list, help=f"ranks per group ({dflt('tp')})")
    p.add_argument(
        "--backends",
        type=choice_list(BACKEND_CHOICES),
        default=BACKEND_CHOICES,
        help="backends to measure (default: all; unavailable ones are reported skipped)",
    )
    p.add_argument(
        "--baselines",
        type=choice_list(BASELINES),
        default=BASELINES,
        help="baselines measured in the same run (default: all that can run)",
    )
    p.add_argument(
        "--mode",
        type=choice_list(MODES),
        default=MODES,
        help="eager calls and/or CUDA-graph replays (default: both; graph needs CUDA)",
    )
    p.add_argument(
        "--ops", type=choice_list(OPS), default=OPS, help="ops to measure (default: all)"
    )
    p.add_argument("--iters", type=int, default=50, help="timed samples per point (default 50)")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls per point (default 10)")
    p.add_argument(
        "--graph-ops", type=int, default=10, help="calls captured per CUDA graph (default 10)"
    )
    p.add_argument(
        "--out", default=None, help="output folder (default ./ipc-dpsample-bench-<timestamp>)"
    )
    p.add_argument("--cpu", action="store_true", help="CPU ranks over gloo even where GPUs exist")
    p.add_argument(
        "--no-verify", action="store_true", help="skip the bit-exact check before timing"
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per tp (default 1800)")


def config_from_args(ns: argparse.Namespace, *, gpu_machine: bool) -> BenchConfig:
    """Turn parsed options into a :class:`BenchConfig` (defaults depend on whether
    the sweep runs on GPUs: ``gpu_machine and not ns.cpu``).

    Raises
    ------
    ValueError
        Inconsistent values (from :class:`BenchConfig`).
    """
    d = GPU_DEFAULTS if gpu_machine and not ns.cpu else CPU_DEFAULTS
    out = ns.out or "ipc-dpsample-bench-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return BenchConfig(
        pad_bs=ns.pad_bs or d["pad_bs"],
        num_tokens=ns.num_tokens,
        vocab=ns.vocab or d["vocab"],
        dtypes=ns.dtype or d["dtypes"],
        tp=ns.tp or d["tp"],
        backends=tuple(ns.backends),
        modes=tuple(ns.mode),
        ops=tuple(ns.ops),
        baselines=tuple(ns.baselines),
        iters=ns.iters,
        warmup=ns.warmup,
        graph_ops=ns.graph_ops,
        out=out,
        cpu=bool(ns.cpu),
        verify=not ns.no_verify,
        timeout_s=float(ns.timeout),
    )


# -- plan ---------------------------------------------------------------------------
@dataclass(frozen=True)
class LaunchPlan:
    """One set of ranks of the sweep (one ``tp``).

    Attributes
    ----------
    tp : int
    launch : {"processes", "threads"}
    device : {"cpu", "cuda"}
    impls : tuple of str
        Backends and baselines these ranks measure.
    skipped : tuple of (impl, reason)
        Requested ones that cannot run here.
    pad_bs : tuple of int
        The configured batch sizes that are multiples of ``tp``.
    modes : tuple of str
    reason : str
        Non-empty when the whole launch is skipped.
    """

    tp: int
    launch: str
    device: str
    impls: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]
    pad_bs: tuple[int, ...]
    modes: tuple[str, ...]
    reason: str = ""


def plan_launches(cfg: BenchConfig, machine: Machine) -> list[LaunchPlan]:
    """Where each ``tp`` runs and what it can measure (pure)."""
    cuda = machine.gpus > 0 and not cfg.cpu
    plans = []
    for tp in cfg.tp:
        pads = tuple(p for p in cfg.pad_bs if p % tp == 0)
        reason = ""
        if cfg.vocab % tp:
            reason = f"vocab={cfg.vocab} is not a multiple of tp={tp}"
        elif not pads:
            reason = f"no pad_bs in {cfg.pad_bs} is a multiple of tp={tp}"
        skipped: list[tuple[str, str]] = []
        modes = cfg.modes
        if not cuda:
            launch, device = "processes", "cpu"
            for b in cfg.backends:
                if b in ("onesided", "nccl"):
                    skipped.append((b, f"{b} needs CUDA data (CPU sweep)"))
            if "nccl_cupy" in cfg.baselines:
                skipped.append(("nccl_cupy", "needs a GPU per rank (CPU sweep)"))
            if "graph" in modes:
                skipped.append(("graph", "CUDA graphs need CUDA (CPU sweep)"))
                modes = tuple(m for m in modes if m != "graph")
        elif tp <= machine.gpus:
            launch, device = "processes", "cuda"
            if "nccl_cupy" in cfg.baselines and not (machine.cupy_nccl and machine.cupy_gpus):
                skipped.append(("nccl_cupy", "cupy.cuda.nccl cannot load libnccl here"))
        else:
            launch, device = "threads", "cuda"
            for b in cfg.backends:
                if b == "torch":
                    skipped.append(
                        (
                            b,
                            f"torch.distributed needs one process per GPU ({tp} > "
                            f"{machine.gpus} GPUs)",
                        )
                    )
                elif b == "nccl":
                    skipped.append(
                        (b, f"NCCL refuses two ranks on one GPU ({tp} > {machine.gpus} GPUs)")
                    )
            for b in ("nccl_cupy", "torch_dist"):
                if b in cfg.baselines:
                    skipped.append((b, f"needs one GPU per rank ({tp} > {machine.gpus} GPUs)"))
            if not (machine.onesided and machine.cupy_gpus):
                reason = reason or (
                    f"tp={tp} > {machine.gpus} GPUs needs in-process ranks with the one-sided "
                    f"backend, which is unavailable: "
                    f"{machine.onesided_error or 'CuPy cannot drive the GPU'}"
                )
        gone = {name for name, _ in skipped}
        impls = tuple(b for b in cfg.backends if b not in gone) + tuple(
            b for b in cfg.baselines if b not in gone
        )
        if not reason and not any(i in BACKEND_CHOICES for i in impls):
            reason = "none of the requested backends can run here"
        plans.append(LaunchPlan(tp, launch, device, impls, tuple(skipped), pads, modes, reason))
    return plans


def points(cfg: BenchConfig, lp: LaunchPlan) -> list[tuple[str, str, int, str]]:
    """``(op, dtype, pad_bs, mode)`` measured by every impl of ``lp`` (the logits
    dtype sweeps the swap only; the gathers move int32 / float32)."""
    out = []
    for op in cfg.ops:
        dtypes = cfg.dtypes if op == "swap_batch_vocab" else (_gather_dtype(op),)
        for pad_bs in lp.pad_bs:
            for dtype in dtypes:
                for mode in lp.modes:
                    out.append((op, dtype, pad_bs, mode))
    return out


def _gather_dtype(op: str) -> str:
    return "int32" if op == "gather_verify_outputs" else "float32"


def op_bytes(op: str, dtype: str, pad_bs: int, tp: int, num_tokens: int, vocab: int) -> int:
    """Bytes each rank receives in ``op`` (= what the copy baseline copies)."""
    if op == "swap_batch_vocab":
        return pad_bs // tp * num_tokens * vocab * ITEMSIZE[dtype]
    if op == "gather_verify_outputs":
        return pad_bs * (2 * num_tokens + 1) * 4
    return pad_bs * num_tokens * 4


# -- statistics and rows ------------------------------------------------------------
def summarize(samples: Sequence[float]) -> dict[str, float]:
    """Median, p10, p90, mean, min, max, std and count of ``samples`` (seconds).

    Raises
    ------
    ValueError
        Empty input or a non-finite sample.
    """
    a = np.asarray(samples, dtype=np.float64)
    if a.size == 0:
        raise ValueError("no samples")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"non-finite samples: {a[~np.isfinite(a)][:3].tolist()}")
    p10, median, p90 = np.percentile(a, [10, 50, 90])
    return {
        "n": int(a.size),
        "median": float(median),
        "p10": float(p10),
        "p90": float(p90),
        "mean": float(a.mean()),
        "min": float(a.min()),
        "max": float(a.max()),
        "std": float(a.std()),
    }


def slowest(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per-sample maximum over ranks (a collective is done when every rank is)."""
    n = min(len(s) for s in per_rank)
    return [max(s[i] for s in per_rank) for i in range(n)]


def make_rows(
    cfg: BenchConfig, lp: LaunchPlan, rank_results: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """Rows of one launch from every rank's :func:`bench_rank` result (or skipped
    rows when the launch did not run; ``rank_results=None``)."""
    rows = []
    base = {
        "tp": lp.tp,
        "launch": lp.launch,
        "device": lp.device,
        "num_tokens": cfg.num_tokens,
        "vocab": cfg.vocab,
    }
    impls = [*lp.impls, *(name for name, _ in lp.skipped if name != "graph")]
    skip_reason = dict(lp.skipped)
    for impl in impls:
        kind = "baseline" if impl in BASELINES else "backend"
        for op, dtype, pad_bs, mode in points(cfg, lp):
            row: dict[str, Any] = dict.fromkeys(COLUMNS)
            row.update(base)
            row.update(op=op, dtype=dtype, pad_bs=pad_bs, mode=mode, impl=impl, kind=kind)
            row["bytes"] = op_bytes(op, dtype, pad_bs, lp.tp, cfg.num_tokens, cfg.vocab)
            key = (impl, op, dtype, pad_bs, mode)
            if lp.reason or impl in skip_reason or rank_results is None:
                row.update(status="skipped", note=lp.reason or skip_reason.get(impl, ""))
                rows.append(row)
                continue
            infos = [r["info"].get(key) for r in rank_results]
            if any(i is None for i in infos):
                row.update(status="failed", note="a rank reported nothing for this point")
                rows.append(row)
                continue
            statuses = {i["status"] for i in infos}
            notes = sorted({i["note"] for i in infos if i["note"]})
            row["resolved"] = infos[0]["resolved"]
            verified = [i["verified"] for i in infos]
            row["verified"] = None if any(v is None for v in verified) else all(verified)
            row["note"] = "; ".join(notes)
            if statuses != {"ok"}:
                row["status"] = "failed" if "failed" in statuses else "skipped"
                rows.append(row)
                continue
            stats = summarize(slowest([r["samples"][key] for r in rank_results]))
            row["status"] = "ok"
            row["n"] = stats["n"]
            for name in ("median", "p10", "p90", "mean", "min", "max"):
                row[f"{name}_us"] = round(stats[name] * 1e6, 3)
            algbw = row["bytes"] / stats["median"] / 1e9
            row["algbw_gbps"] = round(algbw, 3)
            factor = 1.0 if impl == "copy" or lp.tp == 1 else (lp.tp - 1) / lp.tp
            row["busbw_gbps"] = round(algbw * factor, 3)
            rows.append(row)
    add_ratios(rows)
    return rows


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Fill ``vs_<baseline>`` = baseline median / row median for rows of the same
    ``(tp, launch, op, dtype, pad_bs, mode)``."""
    medians: dict[tuple[Any, ...], float] = {}
    for r in rows:
        if r["status"] == "ok" and r["impl"] in BASELINES:
            medians[(*_point(r), r["impl"])] = float(r["median_us"])
    for r in rows:
        if r["status"] != "ok":
            continue
        for b in BASELINES:
            m = medians.get((*_point(r), b))
            r[f"vs_{b}"] = round(m / float(r["median_us"]), 4) if m and r["median_us"] else None


def _point(r: Mapping[str, Any]) -> tuple[Any, ...]:
    return (r["tp"], r["launch"], r["op"], r["dtype"], r["pad_bs"], r["mode"])


# -- writers ------------------------------------------------------------------------
def write_csv(rows: Iterable[Mapping[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Write ``rows`` with :data:`COLUMNS` as header (None -> empty cell)."""
    path = Path(path)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(COLUMNS), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: "" if r.get(k) is None else r.get(k) for k in COLUMNS})
    return path


def write_json(
    rows: Sequence[Mapping[str, Any]],
    meta: Mapping[str, Any],
    path: str | os.PathLike[str],
) -> Path:
    """Write ``{"schema": "ipc-dpsample-bench", "schema_version": 1, "meta", "columns",
    "rows"}``."""
    path = Path(path)
    doc = {
        "schema": "ipc-dpsample-bench",
        "schema_version": 1,
        "meta": dict(meta),
        "columns": list(COLUMNS),
        "rows": [dict(r) for r in rows],
    }
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return path


#: One color per backend/baseline (baselines in muted colors), one line style per dtype.
_IMPL_COLORS = {
    "auto": "tab:blue",
    "onesided": "tab:red",
    "nccl": "tab:green",
    "torch": "tab:purple",
    "copy": "tab:gray",
    "nccl_cupy": "tab:olive",
    "torch_dist": "tab:brown",
}
_DTYPE_STYLES = ("-", "--", ":", "-.")


def write_plot(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Median latency against bytes per rank, log-log: one panel per (op, tp), one
    line per (impl, mode, dtype) through its pad_bs points; a color per impl, a
    marker per mode, a line style per dtype, baselines thinner. Draws on an Agg
    canvas directly (no pyplot state, no display needed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    ok = [r for r in rows if r.get("status") == "ok" and r.get("median_us")]
    ops = [op for op in OPS if any(r["op"] == op for r in ok)] or ["no data"]
    tps = sorted({(int(r["tp"]), str(r["launch"])) for r in ok}) or [(0, "")]
    fig = Figure(figsize=(5.2 * len(tps), 3.9 * len(ops)), dpi=100)
    FigureCanvasAgg(fig)
    grid = fig.subplots(len(ops), len(tps), squeeze=False)
    for i, op in enumerate(ops):
        for j, (tp, launch) in enumerate(tps):
            ax = grid[i][j]
            series: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
            for r in ok:
                if r["op"] == op and int(r["tp"]) == tp and r["launch"] == launch:
                    key = (str(r["impl"]), str(r["mode"]), str(r["dtype"]))
                    series.setdefault(key, []).append((float(r["bytes"]), float(r["median_us"])))
            dtypes = sorted({k[2] for k in series})
            for (impl, mode, dtype), pts in sorted(series.items()):
                pts.sort()
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    color=_IMPL_COLORS.get(impl, "black"),
                    marker="o" if mode == "eager" else "s",
                    markersize=4,
                    linestyle=_DTYPE_STYLES[dtypes.index(dtype) % len(_DTYPE_STYLES)],
                    linewidth=1.0 if impl in BASELINES else 1.8,
                    label=f"{impl} {mode}" + (f" {dtype}" if len(dtypes) > 1 else ""),
                )
            if series:
                ax.set_xscale("log")
                ax.set_yscale("log")
                # label decades only: minor-tick labels of short log ranges overlap
                ax.xaxis.set_minor_formatter(NullFormatter())
                ax.yaxis.set_minor_formatter(NullFormatter())
                ax.legend(fontsize=7, loc="best")
            else:
                ax.text(0.5, 0.5, "no successful measurement", ha="center", va="center")
            ax.set_title(f"{op}, tp={tp} {launch}" if tp else op, fontsize=10)
            ax.set_xlabel("bytes received per rank")
            ax.set_ylabel("median latency (us)")
            ax.grid(True, which="major", alpha=0.4)
            ax.grid(True, which="minor", alpha=0.15)
    fig.suptitle("ipc-dpsample bench: latency vs bytes (lower is better)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    return path


# -- data ---------------------------------------------------------------------------
_TORCH_NAMES = {"bfloat16", "float16", "float32", "int32"}


def _seed_of(*idx: int) -> int:
    return int(np.random.SeedSequence(list(idx)).generate_state(1, np.uint64)[0] >> 1)


def rand_block(shape: tuple[int, ...], dtype: str, device: Any, *idx: int) -> Any:
    """A seeded random torch tensor: the same on every rank for the same ``idx``."""
    import torch

    assert dtype in _TORCH_NAMES
    g = torch.Generator(device=device)
    g.manual_seed(_seed_of(*idx))
    if dtype == "int32":
        return torch.randint(1, 1 << 20, shape, generator=g, device=device, dtype=torch.int32)
    t = torch.randn(shape, generator=g, device=device, dtype=getattr(torch, dtype))
    return t * 4 if dtype != "float32" else t * 4 - 1e-3


def swap_input(
    seed: int, src: int, tp: int, pad_bs: int, n: int, vocab: int, dtype: str, device: Any
) -> Any:
    """Rank ``src``'s ``local_logits [pad_bs*N, V/tp]``: row block ``dst`` is
    ``rand_block(seed, src, dst)``."""
    import torch

    rows, vs = pad_bs // tp * n, vocab // tp
    return torch.cat(
        [rand_block((rows, vs), dtype, device, seed, 1, src, dst) for dst in range(tp)]
    )


def swap_expected(
    seed: int, dst: int, tp: int, pad_bs: int, n: int, vocab: int, dtype: str, device: Any
) -> Any:
    """What rank ``dst`` must receive from :func:`swap_input` of every rank (column
    block ``s`` is rank ``s``'s row block ``dst``: the layout contract)."""
    import torch

    rows, vs = pad_bs // tp * n, vocab // tp
    return torch.cat(
        [rand_block((rows, vs), dtype, device, seed, 1, src, dst) for src in range(tp)], dim=1
    )


def _same_bits(a: Any, b: Any) -> str:
    import torch

    if tuple(a.shape) != tuple(b.shape):
        return f"shape {tuple(a.shape)} != expected {tuple(b.shape)}"
    view = torch.int16 if a.element_size() == 2 else torch.int32
    diff = a.contiguous().view(view) != b.contiguous().view(view)
    bad = int(diff.sum().item())
    return f"{bad} of {a.numel()} elements differ" if bad else ""


# -- rank body ----------------------------------------------------------------------
class _Runner:
    """One backend or baseline on one rank: ``prepare(op, dtype, pad_bs)`` returns
    the call to time and an optional bit-exact check."""

    resolved: str | None = None

    def prepare(self, op: str, dtype: str, pad_bs: int) -> tuple[Callable[[], Any], Any]:
        raise NotImplementedError

    def close(self) -> None:
        return None


class _CommRunner(_Runner):
    def __init__(self, ctx: _RankCtx, backend: str) -> None:
        from ..comm import DpSamplingComm

        self.ctx = ctx
        cfg, lp = ctx.cfg, ctx.lp
        self.comm = DpSamplingComm(
            tp_size=lp.tp,
            rank=ctx.rank,
            group=ctx.group,
            max_pad_bs=max(lp.pad_bs),
            num_tokens_per_req=cfg.num_tokens,
            vocab_size=cfg.vocab,
            logits_dtype=None,
            backend=backend,
            device=ctx.device,
            timeout_s=30.0,
        )
        self.resolved = self.comm.backend

    def prepare(self, op: str, dtype: str, pad_bs: int) -> tuple[Callable[[], Any], Any]:
        import torch

        c, cfg, r, tp, dev = self.comm, self.ctx.cfg, self.ctx.rank, self.ctx.lp.tp, self.ctx.device
        n, s = cfg.num_tokens, cfg.seed
        if op == "swap_batch_vocab":
            c.prepare_verify_outputs(dtype)
            x = swap_input(s, r, tp, pad_bs, n, cfg.vocab, dtype, dev)

            def swap() -> Any:
                return c.swap_batch_vocab(x, pad_bs=pad_bs)

            def check_swap() -> str:
                exp = swap_expected(s, r, tp, pad_bs, n, cfg.vocab, dtype, dev)
                return _same_bits(self.ctx.settle(swap()), exp)

            return swap, check_swap
        rq = pad_bs // tp
        if op == "gather_verify_outputs":
            parts = [
                [rand_block(shape, "int32", dev, s, 2, k, src) for src in range(tp)]
                for k, shape in enumerate(((rq, n), (rq, n), (rq,)))
            ]

            def gather() -> Any:
                return c.gather_verify_outputs(parts[0][r], parts[1][r], parts[2][r], pad_bs=pad_bs)

            def check_gather() -> str:
                outs = self.ctx.settle(gather())
                return "; ".join(
                    d
                    for o, p in zip(outs, parts, strict=True)
                    if (d := _same_bits(o, torch.cat(p)))
                )

            return gather, check_gather
        lps = [rand_block((rq, n), "float32", dev, s, 3, src) for src in range(tp)]

        def logprobs() -> Any:
            return c.gather_verify_logprobs(lps[r], pad_bs=pad_bs)

        def check_lp() -> str:
            return _same_bits(self.ctx.settle(logprobs()), torch.cat(lps))

        return logprobs, check_lp

    def close(self) -> None:
        self.comm.close()


class _CopyRunner(_Runner):
    """The copy limit: one ``copy_`` of the op's bytes per rank (to the next GPU when
    each rank has its own)."""

    def __init__(self, ctx: _RankCtx) -> None:
        import torch

        self.ctx = ctx
        dev = ctx.device
        if ctx.lp.device == "cuda" and ctx.lp.launch == "processes" and ctx.lp.tp > 1:
            self.dst_device = torch.device("cuda", (dev.index + 1) % torch.cuda.device_count())
            self.resolved = "peer copy"
        else:
            self.dst_device = dev
            self.resolved = "memcpy" if ctx.lp.device == "cpu" else "device copy"

    def prepare(self, op: str, dtype: str, pad_bs: int) -> tuple[Callable[[], Any], Any]:
        import torch

        cfg = self.ctx.cfg
        nbytes = op_bytes(op, dtype, pad_bs, self.ctx.lp.tp, cfg.num_tokens, cfg.vocab)
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=self.ctx.device)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=self.dst_device)

        def copy() -> Any:
            return dst.copy_(src, non_blocking=True)

        return copy, None


class _TorchDistRunner(_Runner):
    """Raw torch.distributed collectives on the world group."""

    resolved = "torch.distributed"

    def __init__(self, ctx: _RankCtx) -> None:
        import torch.distributed as dist

        self.ctx = ctx
        self.dist = dist

    def prepare(self, op: str, dtype: str, pad_bs: int) -> tuple[Callable[[], Any], Any]:
        import torch

        dist, cfg, tp, dev = self.dist, self.ctx.cfg, self.ctx.lp.tp, self.ctx.device
        if op == "swap_batch_vocab":
            nbytes = op_bytes(op, dtype, pad_bs, tp, cfg.num_tokens, cfg.vocab)
            src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            return (lambda: dist.all_to_all_single(dst, src)), None
        rq, n = pad_bs // tp, cfg.num_tokens
        words = rq * (2 * n + 1) if op == "gather_verify_outputs" else rq * n
        src = torch.randint(1, 1000, (words,), dtype=torch.int32, device=dev)
        dst = torch.empty(tp * words, dtype=torch.int32, device=dev)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return (lambda: gather(dst, src)), None


class _NcclCupyRunner(_Runner):
    """Raw NCCL through ``cupy.cuda.nccl`` on the rank's stream."""

    resolved = "cupy.cuda.nccl"

    def __init__(self, ctx: _RankCtx) -> None:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from cupy.cuda import nccl
        import cupy

        from ..backends.nccl import normalize_unique_id, unique_id_for_cupy

        self.ctx = ctx
        self.nccl = nccl
        mine = normalize_unique_id(nccl.get_unique_id()) if ctx.rank == 0 else b""
        raw = ctx.host.all_gather_bytes(mine, timeout_s=120, what="nccl unique id")[0]
        with cupy.cuda.Device(ctx.device.index):
            try:
                self.comm = nccl.NcclCommunicator(ctx.lp.tp, unique_id_for_cupy(raw), ctx.rank)
            except TypeError:  # the other unique-id form (CuPy 13 tuple / CuPy 14 bytes)
                form = "tuple" if isinstance(unique_id_for_cupy(raw), bytes) else "bytes"
                self.comm = nccl.NcclCommunicator(
                    ctx.lp.tp, unique_id_for_cupy(raw, form), ctx.rank
                )
        self.u8 = int(getattr(nccl, "NCCL_UINT8", 1))

    def prepare(self, op: str, dtype: str, pad_bs: int) -> tuple[Callable[[], Any], Any]:
        import torch

        nccl, comm, u8 = self.nccl, self.comm, self.u8
        cfg, tp, dev = self.ctx.cfg, self.ctx.lp.tp, self.ctx.device

        def stream() -> int:
            return int(torch.cuda.current_stream(dev).cuda_stream)

        if op == "swap_batch_vocab":
            nbytes = op_bytes(op, dtype, pad_bs, tp, cfg.num_tokens, cfg.vocab)
            chunk = nbytes // tp
            src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            self._alive = (src, dst)  # raw pointers below; keep the tensors alive
            sp, dp = src.data_ptr(), dst.data_ptr()

            def all_to_all() -> None:
                s = stream()
                nccl.groupStart()
                for peer in range(tp):
                    comm.send(sp + peer * chunk, chunk, u8, peer, s)
                    comm.recv(dp + peer * chunk, chunk, u8, peer, s)
                nccl.groupEnd()

            return all_to_all, None
        rq, n = pad_bs // tp, cfg.num_tokens
        nbytes = 4 * (rq * (2 * n + 1) if op == "gather_verify_outputs" else rq * n)
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
        dst = torch.empty(tp * nbytes, dtype=torch.uint8, device=dev)
        self._alive = (src, dst)
        sp, dp = src.data_ptr(), dst.data_ptr()

        def all_gather() -> None:
            comm.allGather(sp, dp, nbytes, u8, stream())

        return all_gather, None

    def close(self) -> None:
        self.comm.destroy()


@dataclass
class _RankCtx:
    rank: int
    group: Any  # what DpSamplingComm gets: None (world) or a ThreadGroup
    host: Any  # HostGroup for barriers and agreement
    device: Any  # torch.device
    stream: Any  # torch.cuda.Stream or None
    cfg: BenchConfig
    lp: LaunchPlan
    keep: Any = None  # the CUDA graph being timed

    def sync(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def sync_all(self) -> None:
        """Collective sync: rank threads sharing a GPU first agree that every rank
        has issued its ops, then block (see ipc_dpsample.testing.run_threads)."""
        if self.stream is not None and self.group is not None:
            self.host.barrier(timeout_s=self.cfg.timeout_s, what="ops issued")
        self.sync()

    def settle(self, out: Any) -> Any:
        self.sync_all()
        return out

    def agree(self, ok: bool, what: str) -> bool:
        flags = self.host.all_gather_bytes(
            b"\1" if ok else b"\0", timeout_s=self.cfg.timeout_s, what=what
        )
        return all(f == b"\1" for f in flags)


def _make_runner(ctx: _RankCtx, impl: str) -> _Runner:
    if impl in BACKEND_CHOICES:
        return _CommRunner(ctx, impl)
    if impl == "copy":
        return _CopyRunner(ctx)
    if impl == "torch_dist":
        return _TorchDistRunner(ctx)
    return _NcclCupyRunner(ctx)


_CAPTURE_LOCK = threading.Lock()


def _build(ctx: _RankCtx, fn: Callable[[], Any], mode: str) -> tuple[Callable[[], Any], int]:
    """What one timed sample runs, and how many calls it holds: ``fn`` itself
    (eager), or the replay of a CUDA graph that captured ``cfg.graph_ops`` calls
    (graph). Purely local: capturing launches nothing, so no rank waits here."""
    if mode != "graph":
        return fn, 1
    import torch

    graph = torch.cuda.CUDAGraph()
    # torch.cuda.graph synchronises the device and empties the cache on entry: rank
    # threads sharing a GPU capture one at a time (capturing launches nothing).
    with (
        _CAPTURE_LOCK,
        torch.cuda.graph(graph, stream=ctx.stream, capture_error_mode="thread_local"),
    ):
        for _ in range(ctx.cfg.graph_ops):
            fn()
    ctx.keep = graph  # replays need it alive; replaced at the next point
    return graph.replay, ctx.cfg.graph_ops


def _time(ctx: _RankCtx, body: Callable[[], Any], calls: int) -> list[float]:
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
    """Progress on stderr: a redrawn bar on a terminal, a line per tenth in a log."""

    def __init__(self, total: int, desc: str, *, tty: bool) -> None:
        self.total, self.desc, self.n, self.tty = max(1, total), desc, 0, tty
        self._shown = 0

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.tty:
            done = int(30 * self.n / self.total)
            bar = "#" * done + " " * (30 - done)
            sys.stderr.write(f"\r{self.desc} [{bar}] {self.n}/{self.total}")
        elif 10 * self.n // self.total > self._shown or self.n == self.total:
            self._shown = 10 * self.n // self.total
            sys.stderr.write(f"{self.desc}: {self.n}/{self.total}\n")
        sys.stderr.flush()

    def set_postfix_str(self, text: str) -> None:
        del text

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


def bench_rank(
    rank: int, world: int, group: Any, lp: LaunchPlan, cfg: BenchConfig
) -> dict[str, Any]:
    """Body of one benchmark rank (for ``run_ranks`` / ``run_threads``).

    Returns
    -------
    dict
        ``samples``: ``{(impl, op, dtype, pad_bs, mode): [seconds]}``; ``info``: per
        key ``status`` (``ok``, ``failed`` or ``skipped``), ``note``, ``verified``
        (True/False, None for baselines) and ``resolved`` (the backend that ran).
    """
    import torch

    from ..group import TorchStoreGroup

    cuda = lp.device == "cuda"
    if cuda:
        if lp.launch == "threads":
            torch.cuda.set_device(0)
        device = torch.device("cuda", torch.cuda.current_device())
        stream = torch.cuda.Stream(device)
    else:
        device, stream = torch.device("cpu"), None
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, world)))
    host = group if group is not None else TorchStoreGroup(None)
    ctx = _RankCtx(rank, group, host, device, stream, cfg, lp)
    samples: dict[tuple[Any, ...], list[float]] = {}
    info: dict[tuple[Any, ...], dict[str, Any]] = {}
    total = sum(len(points(cfg, lp)) for impl in lp.impls)
    bar = _progress(total, f"tp={lp.tp} {lp.launch} {lp.device}") if rank == 0 else None
    scope: Any = torch.cuda.stream(stream) if cuda else _NullCtx()
    try:
        with scope:
            for impl in lp.impls:
                _bench_impl(ctx, impl, samples, info, bar)
    finally:
        if bar is not None:
            bar.close()
    return {"samples": samples, "info": info}


def _bench_impl(
    ctx: _RankCtx,
    impl: str,
    samples: dict[tuple[Any, ...], list[float]],
    info: dict[tuple[Any, ...], dict[str, Any]],
    bar: Any,
) -> None:
    cfg, lp = ctx.cfg, ctx.lp
    pts = points(cfg, lp)
    runner: _Runner | None = None
    note = ""
    try:
        runner = _make_runner(ctx, impl)
    except Exception as exc:
        note = f"{type(exc).__name__}: {exc}".splitlines()[0]
    if not ctx.agree(runner is not None, f"start {impl}"):
        note = note or "another rank could not start it"
        for op, dtype, pad_bs, mode in pts:
            info[(impl, op, dtype, pad_bs, mode)] = _info("skipped", note, None, None)
        if runner is not None:
            runner.close()
        if bar is not None:
            bar.update(len(pts))
        return
    assert runner is not None
    broken_modes: dict[str, str] = {}
    try:
        for op, dtype, pad_bs, mode in pts:
            key = (impl, op, dtype, pad_bs, mode)
            if bar is not None:
                bar.set_postfix_str(f"{impl} {op} {dtype} pad_bs={pad_bs} {mode}")
            if mode in broken_modes:
                info[key] = _info("failed", broken_modes[mode], None, runner.resolved)
                if bar is not None:
                    bar.update()
                continue
            status, note, verified, step = _bench_point(ctx, runner, key, samples)
            ctx.keep = None
            if status == "failed" and step == "graph":
                broken_modes["graph"] = f"graph capture failed earlier: {note}"
            info[key] = _info(status, note, verified, runner.resolved)
            samples.setdefault(key, [])
            if bar is not None:
                bar.update()
    finally:
        ctx.sync()
        runner.close()


def _bench_point(
    ctx: _RankCtx,
    runner: _Runner,
    key: tuple[Any, ...],
    samples: dict[tuple[Any, ...], list[float]],
) -> tuple[str, str, bool | None, str]:
    """Measure one point: set up (prepare, bit-exact check, warm-up), build (eager
    call or captured graph), time. Each step ends with an agreement of all ranks,
    so every rank takes the same branch even when one fails.

    Returns
    -------
    (status, note, verified, failed step)
        ``status`` is ``ok`` or ``failed``; ``verified`` None when not checked.
    """
    _impl, op, dtype, pad_bs, mode = key
    cfg = ctx.cfg
    verified: bool | None = None
    note = ""
    fn: Callable[[], Any] = _noop
    body: Callable[[], Any] = _noop
    calls = 1
    for step in ("setup", mode, "timing"):
        error = ""
        try:
            if step == "setup":
                fn, check = runner.prepare(op, dtype, pad_bs)
                if check is not None and cfg.verify:
                    diff = check()
                    verified = not diff
                    note = f"WRONG RESULT: {diff}" if diff else ""
                for _ in range(cfg.warmup):
                    fn()
                ctx.sync_all()
            elif step == "timing":
                samples[key] = _time(ctx, body, calls)
            else:
                body, calls = _build(ctx, fn, mode)
        except Exception as exc:
            error = f"{step}: {type(exc).__name__}: {exc}".splitlines()[0]
            _recover(ctx)
        if not ctx.agree(not error, f"{key} {step}"):
            return "failed", error or f"{step} failed on another rank", verified, step
    return "ok", note, verified, ""


def _noop() -> None:
    return None


def _recover(ctx: _RankCtx) -> None:
    try:
        ctx.sync()
    except Exception:
        pass


def _info(status: str, note: str, verified: bool | None, resolved: str | None) -> dict[str, Any]:
    return {"status": status, "note": note, "verified": verified, "resolved": resolved}


class _NullCtx:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# -- driver -------------------------------------------------------------------------
def run_launch(cfg: BenchConfig, lp: LaunchPlan) -> tuple[list[dict[str, Any]], str]:
    """Run one launch; returns its rows and an error text ("" when the ranks ran)."""
    from ..testing import RankFailure, run_ranks, run_threads

    if lp.reason:
        return make_rows(cfg, lp, None), ""
    try:
        if lp.launch == "threads":
            results = run_threads(lp.tp, bench_rank, lp, cfg, timeout_s=cfg.timeout_s)
        else:
            env = {"IPC_DPSAMPLE_TEST_PG_BACKEND": "gloo"} if lp.device == "cpu" else {}
            results = run_ranks(lp.tp, bench_rank, lp, cfg, timeout_s=cfg.timeout_s, env=env)
    except RankFailure as exc:
        failed = dataclasses.replace(lp, reason=f"ranks failed: {str(exc).strip()[-300:]}")
        rows = make_rows(cfg, failed, None)
        for r in rows:
            r["status"] = "failed"
        return rows, str(exc)
    return make_rows(cfg, lp, results), ""


def _fmt(v: Any, spec: str = "") -> str:
    if v is None or v == "":
        return "-"
    return format(v, spec) if spec else str(v)


def format_rows(rows: Sequence[Mapping[str, Any]]) -> str:
    """A text table of measured rows (skipped ones summarised per impl)."""
    head = ("op", "dtype", "pad_bs", "mode", "impl", "median_us", "p10_us", "p90_us")
    head += ("bytes", "GB/s", "vs_copy", "vs_nccl", "vs_torch", "verified")
    table = [head]
    for r in rows:
        if r["status"] == "skipped":
            continue
        if r["status"] != "ok":
            table.append(
                (r["op"], r["dtype"], str(r["pad_bs"]), r["mode"], r["impl"], "FAILED")
                + ("",) * 7
                + (r["note"][:60] if r["note"] else "",)
            )
            continue
        table.append(
            (
                r["op"],
                r["dtype"],
                str(r["pad_bs"]),
                r["mode"],
                r["impl"] + (f"->{r['resolved']}" if r["impl"] == "auto" else ""),
                _fmt(r["median_us"], ".1f"),
                _fmt(r["p10_us"], ".1f"),
                _fmt(r["p90_us"], ".1f"),
                str(r["bytes"]),
                _fmt(r["algbw_gbps"], ".2f"),
                _fmt(r["vs_copy"], ".2f"),
                _fmt(r["vs_nccl_cupy"], ".2f"),
                _fmt(r["vs_torch_dist"], ".2f"),
                {True: "yes", False: "NO", None: "-"}[r["verified"]],
            )
        )
    widths = [max(len(str(t[i])) for t in table) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(t, widths, strict=True)) for t in table]
    skipped: dict[str, str] = {}
    for r in rows:
        if r["status"] == "skipped":
            skipped.setdefault(r["impl"], r["note"] or "")
    lines += [f"  skipped {impl}: {why}" for impl, why in skipped.items()]
    return "\n".join(line.rstrip() for line in lines)


def run_bench(cfg: BenchConfig, machine: Machine | None = None) -> int:
    """Run the sweep, print a table per launch, write CSV/JSON/PNG into ``cfg.out``.

    Returns 0 when every measured point succeeded and verified, else 1.
    """
    machine = machine or detect_machine()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat()
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    plans = plan_launches(cfg, machine)
    for lp in plans:
        print(
            f"\n== tp={lp.tp}: {lp.launch} on {lp.device}"
            + (f" (skipped: {lp.reason})" if lp.reason else ""),
            flush=True,
        )
        t0 = time.perf_counter()
        launch_rows, error = run_launch(cfg, lp)
        if error:
            errors.append(error)
            print(f"ranks failed:\n{error}", file=sys.stderr)
        rows += launch_rows
        if not lp.reason:
            print(format_rows(launch_rows))
            print(f"   ({time.perf_counter() - t0:.1f} s)", flush=True)
    meta = {
        "config": dataclasses.asdict(cfg),
        "machine": dataclasses.asdict(machine),
        "launches": [dataclasses.asdict(lp) for lp in plans],
        "started": started,
        "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "host": os.uname().nodename,
        "versions": _versions(),
        "errors": errors,
        "ratio_definition": "vs_<baseline> = baseline median / median (above 1: faster)",
    }
    paths = [
        write_csv(rows, out / "bench.csv"),
        write_json(rows, meta, out / "bench.json"),
        write_plot(rows, out / "bench.png"),
    ]
    print("\nwrote " + ", ".join(str(p) for p in paths))
    measured = [r for r in rows if r["status"] == "ok"]
    wrong = [r for r in rows if r["verified"] is False]
    failed = [r for r in rows if r["status"] == "failed"]
    if wrong:
        print(f"FAILED: {len(wrong)} points produced wrong results", file=sys.stderr)
    if failed:
        print(f"FAILED: {len(failed)} points failed (see the note column)", file=sys.stderr)
    if not measured:
        print("FAILED: nothing was measured", file=sys.stderr)
    return 0 if measured and not wrong and not failed else 1


def _versions() -> dict[str, str | None]:
    v: dict[str, str | None] = {"python": sys.version.split()[0]}
    for mod in ("torch", "cupy", "numpy"):
        try:
            v[mod] = str(__import__(mod).__version__)
        except Exception:
            v[mod] = None
    return v


def run(ns: argparse.Namespace) -> int:
    """Run ``ipc-dpsample bench``."""
    machine = detect_machine()
    try:
        cfg = config_from_args(ns, gpu_machine=machine.gpus > 0)
    except ValueError as exc:
        print(f"ipc-dpsample bench: {exc}", file=sys.stderr)
        return 2
    return run_bench(cfg, machine)

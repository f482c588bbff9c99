"""The bench's results: statistics over ranks (:func:`summarize`), the rows of a
launch (:func:`make_rows`) with their ratios to the baselines, and the writers
(CSV, JSON, the PNG plot when matplotlib is installed, the text table).
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..common import ARGMAX, OPS, VERIFY, ranks_share_gpu
from ..verify_case import record_bytes
from .config import (
    ARGMAX_BASELINES,
    BASELINES,
    COLUMNS,
    VERIFY_BASELINES,
    BenchConfig,
    LaunchPlan,
    op_bytes,
    points,
)

__all__ = [
    "IMPL_LABELS",
    "PLOT_HINT",
    "add_ratios",
    "format_rows",
    "launch_label",
    "make_rows",
    "series_label",
    "slowest",
    "summarize",
    "timing_text",
    "write_csv",
    "write_json",
    "write_plot",
]


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
        "launch": launch_label(lp),
        "device": lp.device,
        "num_tokens": cfg.num_tokens,
        "vocab": cfg.vocab,
    }
    impls = [*lp.impls, *(name for name, _ in lp.skipped if name != "graph")]
    skip_reason = dict(lp.skipped)
    for impl in impls:
        kind = "baseline" if impl in BASELINES else "backend"
        for op, dtype, pad_bs, bs, mode, mix in points(cfg, lp, impl):
            row: dict[str, Any] = dict.fromkeys(COLUMNS)
            row.update(base)
            row.update(op=op, dtype=dtype, pad_bs=pad_bs, bs=bs, mode=mode, impl=impl, kind=kind)
            if op in (ARGMAX, "swap_argmax", VERIFY, "swap_sample_gather"):
                row["vocab_limit"] = cfg.limit
            if mix:
                row["mix"] = mix
            if op == VERIFY:
                row["record_bytes"] = record_bytes(
                    mix, pad_bs, cfg.num_tokens, cfg.vocab, bs=bs, vocab_limit=cfg.vocab_limit,
                    backend=impl,
                )  # fmt: skip
            row["bytes"] = op_bytes(
                op, dtype, pad_bs, lp.tp, cfg.num_tokens, cfg.vocab, bs, mix, cfg.vocab_limit,
                backend=impl, max_pad_bs=max(lp.pad_bs),
            )  # fmt: skip
            key = (impl, op, dtype, pad_bs, bs, mode, mix)
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
            row["bs_arg"] = infos[0].get("bs_arg") or None
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


def launch_label(lp: LaunchPlan) -> str:
    """The ``launch`` column: ``processes``, ``threads gated`` or, for rank threads
    sharing a GPU timed without the gate, ``threads ungated``."""
    if lp.gated:
        return f"{lp.launch} gated"
    return f"{lp.launch} ungated" if ranks_share_gpu(lp.launch, lp.device) else lp.launch


def timing_text(cfg: BenchConfig, lp: LaunchPlan) -> str:
    """What a launch's times are, for the header of its table (one line)."""
    g = cfg.graph_ops
    graph = f"graph: one replay of a CUDA graph of {g} calls / {g}"
    if lp.device == "cpu":
        return (
            f"timing: host wall clock (perf_counter) of each eager call on {lp.tp} CPU rank "
            "processes over gloo, the slowest rank per sample"
        )
    if lp.gated:
        return (
            f"timing: gated device time: all {lp.tp} rank threads sharing GPU 0 are released "
            "together (every rank's stream waits at one CUDA event until all have issued the "
            f"sample); eager: {g} calls back to back / {g}; {graph}; CUDA events, the slowest "
            "rank per sample"
        )
    if lp.launch == "threads":
        return (
            f"timing: host path, ungated (--ungated): {lp.tp} rank threads sharing GPU 0 "
            "issue each eager call in their turn at the GIL, so its time includes that "
            f"launch skew; {graph}; CUDA events, the slowest rank per sample"
        )
    return (
        f"timing: CUDA events on each rank's stream, one process per GPU, not gated: eager "
        f"calls issued back to back (an op shorter than its launch shows the host's issue "
        f"time); {graph}; the slowest rank per sample"
    )


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Fill, for measured rows: ``vs_<baseline>`` = baseline median / row median for
    rows of the same ``(tp, launch, op, dtype, pad_bs, bs, mode, mix)``; for the
    argmax, ``vs_swap_argmax`` and ``vs_read_once`` = that op's median (same impl) /
    the argmax's (above 1: the argmax is faster); for the verify,
    ``vs_swap_sample_gather`` (same mix), ``vs_read_once`` and ``vs_argmax`` likewise;
    ``vs_full_bs`` = row median / the median of the same row at ``bs = pad_bs`` (the
    fraction of the full batch's time)."""
    medians: dict[tuple[Any, ...], float] = {}
    for r in rows:
        if r["status"] == "ok" and r["median_us"]:
            medians[(*_point(r), r["impl"])] = float(r["median_us"])
    for r in rows:
        if r["status"] != "ok" or not r["median_us"]:
            continue
        me = float(r["median_us"])
        for b in BASELINES:
            m = medians.get((*_point(r), b))
            r[f"vs_{b}"] = round(m / me, 4) if m else None
        if r["op"] == ARGMAX:
            for helper in ARGMAX_BASELINES:
                m = medians.get((*_point(r, op=helper), r["impl"]))
                r[f"vs_{helper}"] = round(m / me, 4) if m else None
        if r["op"] == VERIFY:
            for helper in VERIFY_BASELINES:
                mix = r.get("mix") if helper == "swap_sample_gather" else ""
                m = medians.get((*_point(r, op=helper, mix=mix), r["impl"]))
                column = "vs_argmax" if helper == ARGMAX else f"vs_{helper}"
                r[column] = round(m / me, 4) if m else None
        full = medians.get((*_point(r, bs=r["pad_bs"]), r["impl"]))
        r["vs_full_bs"] = round(me / full, 4) if full else None


def _point(r: Mapping[str, Any], **change: Any) -> tuple[Any, ...]:
    p = {k: r[k] for k in ("tp", "launch", "op", "dtype", "pad_bs", "bs", "mode")}
    p["mix"] = r.get("mix") or ""
    p |= change
    p["mix"] = p["mix"] or ""
    return tuple(p.values())


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
#: Legend names: this package's backends apart from the raw libraries they stand on.
IMPL_LABELS = {
    "auto": "ipc_dpsample auto",
    "onesided": "ipc_dpsample onesided",
    "nccl": "ipc_dpsample nccl backend",
    "torch": "ipc_dpsample torch backend",
    "copy": "copy limit",
    "nccl_cupy": "raw NCCL (cupy.cuda.nccl)",
    "torch_dist": "raw torch.distributed",
}
#: What to install for the plot.
PLOT_HINT = "pip install 'ipc-dpsample[bench]'"


def series_label(impl: str, mode: str, dtype: str, *, show_dtype: bool) -> str:
    """The legend entry of one line: ``"ipc_dpsample torch backend eager"`` vs
    ``"raw torch.distributed eager"`` (the dtype too when a panel has several)."""
    return f"{IMPL_LABELS.get(impl, impl)} {mode}" + (f" {dtype}" if show_dtype else "")


def write_plot(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Median latency against bytes per rank, log-log: one panel per (op, tp), one
    line per (impl, mode, dtype) through its (pad_bs, bs) points; a color per impl,
    a marker per mode, a line style per dtype, baselines thinner; every point is
    labelled with its pad_bs (and bs when smaller). Draws on an Agg canvas directly
    (no pyplot state, no display needed).

    Raises
    ------
    ImportError
        matplotlib is not installed (:data:`PLOT_HINT` says how to get it).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    ok = [r for r in rows if r.get("status") == "ok" and r.get("median_us")]
    helpers = dict.fromkeys((*ARGMAX_BASELINES, *VERIFY_BASELINES))
    ops = [op for op in dict.fromkeys((*OPS, *helpers)) if any(r["op"] == op for r in ok)]
    ops = ops or ["no data"]
    tps = sorted({(int(r["tp"]), str(r["launch"])) for r in ok}) or [(0, "")]
    fig = Figure(figsize=(5.2 * len(tps), 3.9 * len(ops)), dpi=100)
    FigureCanvasAgg(fig)
    grid = fig.subplots(len(ops), len(tps), squeeze=False)
    for i, op in enumerate(ops):
        for j, (tp, launch) in enumerate(tps):
            ax = grid[i][j]
            series: dict[tuple[str, str, str], list[tuple[float, float, str]]] = {}
            for r in ok:
                if r["op"] == op and int(r["tp"]) == tp and r["launch"] == launch:
                    mix = f" {r['mix']}" if r.get("mix") else ""  # a line per mix
                    key = (str(r["impl"]), str(r["mode"]) + mix, str(r["dtype"]))
                    pad, bs = int(r["pad_bs"]), r.get("bs")
                    label = f"pad_bs={pad}" if bs in (None, pad) else f"bs={bs}/{pad}"
                    point = (float(r["bytes"]), float(r["median_us"]), label)
                    series.setdefault(key, []).append(point)
            dtypes = sorted({k[2] for k in series})
            for (impl, mode, dtype), pts in sorted(series.items()):
                pts.sort()
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    color=_IMPL_COLORS.get(impl, "black"),
                    marker="o" if mode.startswith("eager") else "s",
                    markersize=4,
                    linestyle=_DTYPE_STYLES[dtypes.index(dtype) % len(_DTYPE_STYLES)],
                    linewidth=1.0 if impl in BASELINES else 1.8,
                    label=series_label(impl, mode, dtype, show_dtype=len(dtypes) > 1),
                )
                for x, y, label in pts:
                    ax.annotate(
                        label,
                        (x, y),
                        textcoords="offset points",
                        xytext=(3, 3),
                        fontsize=6,
                        color=_IMPL_COLORS.get(impl, "black"),
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
            ax.set_xlabel("bytes moved per rank (real rows)")
            ax.set_ylabel("median latency (us)")
            ax.grid(True, which="major", alpha=0.4)
            ax.grid(True, which="minor", alpha=0.15)
    fig.suptitle("ipc-dpsample bench: latency vs bytes (lower is better)")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, format="png")
    return path


def _fmt(v: Any, spec: str = "") -> str:
    if v is None or v == "":
        return "-"
    return format(v, spec) if spec else str(v)


def _op_label(r: Mapping[str, Any]) -> str:
    """The op, with the parameter mix of a verify point: ``verify_batch_vocab[topk50]``."""
    return f"{r['op']}[{r['mix']}]" if r.get("mix") else str(r["op"])


def format_rows(rows: Sequence[Mapping[str, Any]]) -> str:
    """A text table of measured rows (skipped ones summarised per impl)."""
    head = ("op", "dtype", "pad_bs", "bs", "mode", "impl", "median_us", "p10_us", "p90_us")
    head += ("bytes", "GB/s", "vs_copy", "vs_nccl", "vs_torch", "verified")
    table = [head]
    for r in rows:
        if r["status"] == "skipped":
            continue
        if r["status"] != "ok":
            table.append(
                (_op_label(r), r["dtype"], str(r["pad_bs"]), str(r["bs"]), r["mode"], r["impl"])
                + ("FAILED",)
                + ("",) * 7
                + (r["note"][:60] if r["note"] else "",)
            )
            continue
        table.append(
            (
                _op_label(r),
                r["dtype"],
                str(r["pad_bs"]),
                str(r["bs"]) + ("*" if r.get("bs_arg") == "device" else ""),
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
    skipped: dict[tuple[str, str], None] = {}
    for r in rows:
        if r["status"] == "skipped":
            skipped.setdefault((r["impl"], r["note"] or ""), None)
    lines += [f"  skipped {impl}: {why}" for impl, why in skipped]
    if any(r.get("bs_arg") == "device" for r in rows):
        lines.append("  bs*: passed as a device int32 tensor (one CUDA graph serves every bs)")
    return "\n".join(line.rstrip() for line in lines)

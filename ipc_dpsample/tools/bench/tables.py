"""The bench's summary tables, printed after each launch's rows:

* :func:`format_bs_table` (issue 13): for every backend op measured at several
  ``bs`` of one ``pad_bs``, the median time at each ``bs`` and its ratio to the
  time at ``bs = pad_bs``, eager and graph side by side, against the targets;
* :func:`format_argmax_table` (issue 14): ``argmax_batch_vocab`` against its two
  baselines from the same run, ``swap_argmax`` (swap, then ``torch.argmax``) and
  ``read_once`` (``torch.amax`` over the shard's real rows), against the targets;
* :func:`format_verify_table` (issue 24): ``verify_batch_vocab`` per parameter mix
  against ``swap_sample_gather`` (swap, the package's full-row sampler, gather),
  ``read_once`` and ``argmax_batch_vocab`` from the same run, with the record bytes
  per row per shard, against the targets (:data:`VERIFY_TARGETS`).

The targets were set for, and measured as, device time on a GPU: ranks released
together behind the gate (gated eager) or CUDA-graph replays (BENCHMARKS.md: tp=8
on one H200, gated). :func:`target_reason` says where they do not apply: CPU
rows (wall clock over gloo) and eager rows timed without the gate (host issue
time, launch skew). There a table says ``n/a`` with a footnote, and a table
without any row they apply to leaves them out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ...arrays import ITEMSIZE
from ..common import ARGMAX, OPS, VERIFY
from ..verify_case import TARGET_MIXES, mix_text
from .config import FULL_ROW_SAMPLER

__all__ = [
    "ARGMAX_TARGETS",
    "BS_TARGETS",
    "VERIFY_TARGETS",
    "bs_target",
    "format_argmax_table",
    "format_bs_table",
    "format_verify_table",
    "target_reason",
]

#: Issue 13: ``time(bs) / time(bs=pad_bs)`` at most this, keyed by ``bs / pad_bs``
#: (given for pad_bs=256 at bs=130 and bs=8; other pad_bs get the same fraction's).
BS_TARGETS: dict[float, float] = {130 / 256: 0.56, 8 / 256: 0.08}
#: Issue 14: the argmax at least this many times faster than swap + argmax, and at
#: most this many times the read-once time.
ARGMAX_TARGETS: dict[str, float] = {"vs_swap_argmax": 2.3, "over_read_once": 1.3}
#: Issue 24, for the mixes of :data:`~ipc_dpsample.tools.verify_case.TARGET_MIXES`
#: (temperature only, top-k 50, top-k 50 + top-p 0.9): the verify at least this many
#: times faster than swap + sampler + gather, at most this many times the read-once
#: time, and at ``pad_bs = 8`` replayed in a CUDA graph at most this many times the
#: argmax's time.
VERIFY_TARGETS: dict[str, float] = {
    "vs_swap_sample_gather": 2.5,
    "over_read_once": 1.5,
    "over_argmax": 1.5,
}
#: The ``pad_bs`` of the ``over_argmax`` target (graph replays only).
VERIFY_ARGMAX_PAD_BS = 8


def target_reason(row: Mapping[str, Any]) -> str:
    """``""`` when the issue targets apply to ``row``'s timing (GPU, graph replay
    or gated eager), else why they do not (short, for a footnote)."""
    if row.get("device") != "cuda":
        return "CPU rows time wall clock over gloo"
    if row.get("mode") != "graph" and str(row.get("launch", "")).split()[-1:] != ["gated"]:
        return "eager rows without the gate time host issue and launch skew"
    return ""


def _footnote(reasons: set[str]) -> list[str]:
    if not reasons:
        return []
    return [
        "  n/a: the targets are set for device time on a GPU (gated eager, graph replays); "
        + "; ".join(sorted(reasons))
    ]


def bs_target(bs: int, pad_bs: int) -> float | None:
    """The issue-13 ratio target for ``bs`` of ``pad_bs`` (a fraction within 0.01 of
    a :data:`BS_TARGETS` key), or None."""
    for fraction, target in BS_TARGETS.items():
        if abs(bs / pad_bs - fraction) <= 0.01:
            return target
    return None


def _render(table: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table
    ]


def _us(v: Any) -> str:
    return "-" if v is None else f"{float(v):.1f}"


def _ok(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [r for r in rows if r["status"] == "ok" and r["kind"] == "backend" and r["median_us"]]


def format_bs_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The ``bs`` scaling table ("" when no op was measured at two ``bs`` values).

    One line per (op, impl, dtype, pad_bs, bs); per mode the median (us) and
    ``time / time(bs=pad_bs)``; ``target`` says whether every mode the target
    applies to (:func:`target_reason`) met the issue's ratio (:func:`bs_target`),
    naming those modes when not all do, ``n/a`` when none does. Without a mode
    it applies to anywhere in the table, no target column."""
    ok = [r for r in _ok(rows) if r["op"] in OPS]
    groups: dict[tuple[Any, ...], dict[tuple[int, str], Mapping[str, Any]]] = {}
    for r in ok:
        op = f"{r['op']}[{r['mix']}]" if r.get("mix") else r["op"]
        g = groups.setdefault((op, r["impl"], r["dtype"], r["pad_bs"]), {})
        g[(int(r["bs"]), str(r["mode"]))] = r
    groups = {k: g for k, g in groups.items() if len({bs for bs, _ in g}) > 1}
    if not groups:
        return ""
    modes = [m for m in ("eager", "graph") if any(m == k[1] for g in groups.values() for k in g)]
    judged = any(not target_reason(r) for g in groups.values() for r in g.values())
    head = ["op", "impl", "dtype", "pad_bs", "bs", "bs/pad_bs"]
    for m in modes:
        head += [f"{m} us", f"{m} ratio"]
    table = [[*head, "target"] if judged else head]
    reasons: set[str] = set()
    for (op, impl, dtype, pad_bs), g in groups.items():
        for bs in sorted({bs for bs, _ in g}, reverse=True):
            line = [op, impl, dtype, str(pad_bs), str(bs), f"{bs / pad_bs:.3f}"]
            ratios: dict[str, float] = {}
            why: dict[str, str] = {}
            for m in modes:
                r, full = g.get((bs, m)), g.get((pad_bs, m))
                ratio = float(r["median_us"]) / float(full["median_us"]) if r and full else None
                if ratio is not None:
                    ratios[m] = ratio
                    why[m] = target_reason(r)  # type: ignore[arg-type]
                line += [_us(r and r["median_us"]), "-" if ratio is None else f"{ratio:.3f}"]
            target = bs_target(bs, pad_bs) if bs != pad_bs else None
            if judged:
                line.append(_bs_verdict(target, ratios, why, reasons))
            table.append(line)
    intro = "bs scaling: median us at each real batch size and ratio = time / time at bs=pad_bs"
    if judged:
        intro += " (issue 13: bs=130 <= 0.56, bs=8 <= 0.08 of bs=256)"
    device = any(r.get("bs_arg") == "device" for r in ok)
    how = "; graph: bs is a device int32 tensor, eager: a host int" if device else ""
    return "\n".join([intro + how, *_render(table), *_footnote(reasons)])


def _bs_verdict(
    target: float | None, ratios: dict[str, float], why: dict[str, str], reasons: set[str]
) -> str:
    """The target cell of one line of :func:`format_bs_table` (adds to ``reasons``
    why a mode is not judged)."""
    if target is None:
        return ""
    judged = {m: v for m, v in ratios.items() if not why[m]}
    skipped = {why[m] for m in ratios if why[m]}
    if not judged:
        reasons |= skipped
        return "n/a" if skipped else ""
    verdict = f"<= {target}: " + ("met" if max(judged.values()) <= target else "MISSED")
    if skipped:
        reasons |= skipped
        verdict += f" ({', '.join(judged)}; n/a for {', '.join(m for m in ratios if why[m])})"
    return verdict


def format_argmax_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """``argmax_batch_vocab`` against ``swap_argmax`` and ``read_once`` of the same
    impl and point ("" when no argmax was measured); the targets only on rows they
    apply to (:func:`target_reason`; ``n/a`` and a footnote on the others, no
    targets column when they apply to none)."""
    ok = _ok(rows)
    med = {
        (r["op"], r["impl"], r["dtype"], r["pad_bs"], r["bs"], r["mode"]): float(r["median_us"])
        for r in ok
    }
    argmax = [r for r in ok if r["op"] == ARGMAX]
    if not argmax:
        return ""
    judged = any(not target_reason(r) for r in argmax)
    head = ["impl", "dtype", "pad_bs", "bs", "mode", "argmax us", "swap+argmax us"]
    head += ["read_once us", "speedup vs swap+argmax", "argmax / read_once"]
    table = [[*head, "targets"] if judged else head]
    reasons: set[str] = set()
    for r in argmax:
        point = (r["impl"], r["dtype"], r["pad_bs"], r["bs"], r["mode"])
        me, swap = med[(ARGMAX, *point)], med.get(("swap_argmax", *point))
        read = med.get(("read_once", *point))
        speedup = swap / me if swap else None
        over = me / read if read else None
        line = [str(v) for v in point] + [_us(me), _us(swap), _us(read)]
        line += [
            "-" if speedup is None else f"{speedup:.2f}x",
            "-" if over is None else f"{over:.2f}",
        ]
        if judged:
            why = target_reason(r)
            verdict = []
            if why:
                reasons.add(why)
                verdict.append("n/a")
            if speedup is not None and not why:
                goal = ARGMAX_TARGETS["vs_swap_argmax"]
                verdict.append(f">= {goal}x " + ("met" if speedup >= goal else "MISSED"))
            if over is not None and not why:
                goal = ARGMAX_TARGETS["over_read_once"]
                verdict.append(f"<= {goal} " + ("met" if over <= goal else "MISSED"))
            line.append(", ".join(verdict))
        table.append(line)
    intro = "argmax_batch_vocab vs its baselines in the same run"
    if judged:
        intro += " (issue 14: >= 2.3x faster than swap+argmax, <= 1.3x read-once)"
    return "\n".join([intro, *_render(table), *_footnote(reasons)])


def format_verify_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """``verify_batch_vocab`` against its baselines of the same impl and point, one
    line per (impl, dtype, pad_bs, bs, mode, mix) where the verify or its baseline was
    measured ("" when neither was): the medians of the verify, ``swap_sample_gather``,
    ``read_once`` and ``argmax_batch_vocab``, the ratios, the bytes per row per shard
    of the verify's record and of the swap, and the targets where they apply (the
    mixes of :data:`~ipc_dpsample.tools.verify_case.TARGET_MIXES`, device time on a
    GPU: :func:`target_reason`; ``n/a`` and a footnote elsewhere, no targets column
    when they apply nowhere). A verify point its backend cannot run says so."""
    ok = _ok(rows)
    med = {_key(r): float(r["median_us"]) for r in ok}
    ran = {(r["tp"], r["launch"], r["impl"]) for r in ok}  # impls that started
    missing = {
        _key(r): r["note"]
        for r in rows
        if r["op"] == VERIFY
        and r["status"] == "skipped"
        and (r["tp"], r["launch"], r["impl"]) in ran
    }
    lines = {}
    for r in rows:
        if r["op"] in (VERIFY, "swap_sample_gather") and (_key(r) in med or _key(r) in missing):
            lines.setdefault(_key(r)[1:], r)
    if not lines:
        return ""
    judged = any(not target_reason(r) for r in lines.values())
    head = ["impl", "dtype", "pad_bs", "bs", "mode", "mix", "record B", "swap B", "verify us"]
    head += ["swap+sample+gather us", "read_once us", "argmax us", "speedup vs swap+sample+gather"]
    head += ["verify / read_once", "verify / argmax"]
    table = [[*head, "targets"] if judged else head]
    reasons: set[str] = set()
    notes: dict[str, None] = {}
    for point, r in lines.items():
        impl, dtype, pad_bs, bs, mode, mix = point
        me = med.get((VERIFY, *point))
        swap = med.get(("swap_sample_gather", *point))
        read = med.get(("read_once", impl, dtype, pad_bs, bs, mode, ""))
        greedy = med.get((ARGMAX, impl, dtype, pad_bs, bs, mode, ""))
        speedup = swap / me if swap and me else None
        over_read = me / read if read and me else None
        over_argmax = me / greedy if greedy and me else None
        verify_cell = _us(me)
        if me is None and (VERIFY, *point) in missing:
            verify_cell = "not available"
            notes[missing[(VERIFY, *point)]] = None
        rec = _record_bytes(rows, (VERIFY, *point))
        shard = int(r["vocab"]) // int(r["tp"]) * ITEMSIZE[str(dtype)]
        line = [str(v) for v in point] + [rec, str(shard), verify_cell, _us(swap), _us(read)]
        line += [_us(greedy), _x(speedup), _f(over_read), _f(over_argmax)]
        if judged:
            line.append(_verify_verdict(r, mix, speedup, over_read, over_argmax, reasons))
        table.append(line)
    intro = "verify_batch_vocab vs its baselines in the same run"
    if judged:
        intro += (
            f" (issue 24, mixes {', '.join(TARGET_MIXES)}: >= 2.5x faster than "
            "swap+sample+gather, <= 1.5x read-once, <= 1.5x argmax at pad_bs=8 graph-replayed)"
        )
    mixes = dict.fromkeys(str(p[5]) for p in lines)
    foot = [
        f"  swap+sample+gather: the backend's swap_batch_vocab, {FULL_ROW_SAMPLER} over "
        "the rank's full rows, its gather_verify_outputs",
        "  record B: the record each shard sends per row (torch: one all-gather, rows the "
        "records leave open add 896 B each in a probe round; nccl, and onesided above 64 "
        "rows pad_bs * N: to the row's owner, then the results are gathered; onesided up "
        "to 64 rows: to every rank, no gather (IPC_DPSAMPLE_VERIFY_BROADCAST); '-': the "
        "kernels refuse the mix, which takes the swap route); swap B: the swap's bytes "
        "per row per shard",
        *(f"  {m}: {mix_text(m)}" for m in mixes),
        *(f"  not available: {n}" for n in notes),
    ]
    return "\n".join([intro, *_render(table), *foot, *_footnote(reasons)])


def _key(r: Mapping[str, Any]) -> tuple[Any, ...]:
    return (r["op"], r["impl"], r["dtype"], r["pad_bs"], r["bs"], r["mode"], r.get("mix") or "")


def _record_bytes(rows: Sequence[Mapping[str, Any]], key: tuple[Any, ...]) -> str:
    for r in rows:
        if _key(r) == key and r.get("record_bytes"):
            return str(r["record_bytes"])
    return "-"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _verify_verdict(
    r: Mapping[str, Any],
    mix: str,
    speedup: float | None,
    over_read: float | None,
    over_argmax: float | None,
    reasons: set[str],
) -> str:
    """The targets cell of one line of :func:`format_verify_table` (adds to
    ``reasons`` why the targets do not apply)."""
    if mix not in TARGET_MIXES:
        return ""
    why = target_reason(r)
    if why:
        reasons.add(why)
        return "n/a"
    goals = VERIFY_TARGETS
    out = []
    if speedup is not None:
        goal = goals["vs_swap_sample_gather"]
        out.append(f">= {goal}x " + ("met" if speedup >= goal else "MISSED"))
    if over_read is not None:
        goal = goals["over_read_once"]
        out.append(f"<= {goal} read_once " + ("met" if over_read <= goal else "MISSED"))
    if over_argmax is not None and r["mode"] == "graph" and r["pad_bs"] == VERIFY_ARGMAX_PAD_BS:
        goal = goals["over_argmax"]
        out.append(f"<= {goal} argmax " + ("met" if over_argmax <= goal else "MISSED"))
    return ", ".join(out)

"""The bench's summary tables, printed after each launch's rows:

* :func:`format_bs_table` (issue 13): for every backend op measured at several
  ``bs`` of one ``pad_bs``, the median time at each ``bs`` and its ratio to the
  time at ``bs = pad_bs``, eager and graph side by side, against the targets;
* :func:`format_argmax_table` (issue 14): ``argmax_batch_vocab`` against its two
  baselines from the same run, ``swap_argmax`` (swap, then ``torch.argmax``) and
  ``read_once`` (``torch.amax`` over the shard's real rows), against the targets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..common import ARGMAX, OPS

__all__ = [
    "ARGMAX_TARGETS",
    "BS_TARGETS",
    "bs_target",
    "format_argmax_table",
    "format_bs_table",
]

#: Issue 13: ``time(bs) / time(bs=pad_bs)`` at most this, keyed by ``bs / pad_bs``
#: (given for pad_bs=256 at bs=130 and bs=8; other pad_bs get the same fraction's).
BS_TARGETS: dict[float, float] = {130 / 256: 0.56, 8 / 256: 0.08}
#: Issue 14: the argmax at least this many times faster than swap + argmax, and at
#: most this many times the read-once time.
ARGMAX_TARGETS: dict[str, float] = {"vs_swap_argmax": 2.3, "over_read_once": 1.3}


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
    ``time / time(bs=pad_bs)``; ``target`` says whether every mode met the
    issue's ratio (:func:`bs_target`)."""
    ok = [r for r in _ok(rows) if r["op"] in OPS]
    groups: dict[tuple[Any, ...], dict[tuple[int, str], Mapping[str, Any]]] = {}
    for r in ok:
        g = groups.setdefault((r["op"], r["impl"], r["dtype"], r["pad_bs"]), {})
        g[(int(r["bs"]), str(r["mode"]))] = r
    groups = {k: g for k, g in groups.items() if len({bs for bs, _ in g}) > 1}
    if not groups:
        return ""
    modes = [m for m in ("eager", "graph") if any(m == k[1] for g in groups.values() for k in g)]
    head = ["op", "impl", "dtype", "pad_bs", "bs", "bs/pad_bs"]
    for m in modes:
        head += [f"{m} us", f"{m} ratio"]
    table = [[*head, "target"]]
    for (op, impl, dtype, pad_bs), g in groups.items():
        for bs in sorted({bs for bs, _ in g}, reverse=True):
            line = [op, impl, dtype, str(pad_bs), str(bs), f"{bs / pad_bs:.3f}"]
            ratios = []
            for m in modes:
                r, full = g.get((bs, m)), g.get((pad_bs, m))
                ratio = float(r["median_us"]) / float(full["median_us"]) if r and full else None
                ratios += [] if ratio is None else [ratio]
                line += [_us(r and r["median_us"]), "-" if ratio is None else f"{ratio:.3f}"]
            target = bs_target(bs, pad_bs) if bs != pad_bs else None
            verdict = "" if target is None else f"<= {target}: "
            if target is not None:
                verdict += "met" if ratios and max(ratios) <= target else "MISSED"
            table.append([*line, verdict])
    intro = (
        "bs scaling: median us at each real batch size and ratio = time / time at "
        "bs=pad_bs (issue 13: bs=130 <= 0.56, bs=8 <= 0.08 of bs=256)"
    )
    device = any(r.get("bs_arg") == "device" for r in ok)
    how = "; graph: bs is a device int32 tensor, eager: a host int" if device else ""
    return "\n".join([intro + how, *_render(table)])


def format_argmax_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """``argmax_batch_vocab`` against ``swap_argmax`` and ``read_once`` of the same
    impl and point ("" when no argmax was measured)."""
    ok = _ok(rows)
    med = {
        (r["op"], r["impl"], r["dtype"], r["pad_bs"], r["bs"], r["mode"]): float(r["median_us"])
        for r in ok
    }
    head = ["impl", "dtype", "pad_bs", "bs", "mode", "argmax us", "swap+argmax us"]
    head += ["read_once us", "speedup vs swap+argmax", "argmax / read_once", "targets"]
    table = [head]
    for r in ok:
        if r["op"] != ARGMAX:
            continue
        point = (r["impl"], r["dtype"], r["pad_bs"], r["bs"], r["mode"])
        me, swap = med[(ARGMAX, *point)], med.get(("swap_argmax", *point))
        read = med.get(("read_once", *point))
        speedup = swap / me if swap else None
        over = me / read if read else None
        verdict = []
        if speedup is not None:
            goal = ARGMAX_TARGETS["vs_swap_argmax"]
            verdict.append(f">= {goal}x " + ("met" if speedup >= goal else "MISSED"))
        if over is not None:
            goal = ARGMAX_TARGETS["over_read_once"]
            verdict.append(f"<= {goal} " + ("met" if over <= goal else "MISSED"))
        table.append(
            [str(v) for v in point]
            + [_us(me), _us(swap), _us(read)]
            + [
                "-" if speedup is None else f"{speedup:.2f}x",
                "-" if over is None else f"{over:.2f}",
            ]
            + [", ".join(verdict)]
        )
    if len(table) == 1:
        return ""
    intro = (
        "argmax_batch_vocab vs its baselines in the same run (issue 14: >= 2.3x faster "
        "than swap+argmax, <= 1.3x read-once)"
    )
    return "\n".join([intro, *_render(table)])

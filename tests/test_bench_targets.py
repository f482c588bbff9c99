"""The issue-13 and issue-14 targets of the bench's summary tables (issue 23, point 3)
are judged only where they apply: device time on a GPU (gated eager rows, graph
replays). CPU rows and eager rows timed without the gate get no verdict: no target
column when nothing in the table is comparable, else ``n/a`` and a footnote; never
``MISSED``."""

from __future__ import annotations

from typing import Any

from test_bench_cli import fake_rows
from test_cli import CPU_BOX, EIGHT_GPUS, ONE_GPU

from ipc_dpsample.tools import bench, common
from ipc_dpsample.tools.bench import tables

ARGMAX = common.ARGMAX


def _bs_cfg(**kw: Any) -> bench.BenchConfig:
    base = dict(
        tp=(8,), pad_bs=(256,), bs=((256, 130, 8),), dtypes=("float32",),
        ops=("swap_batch_vocab",), backends=("onesided",), baselines=("copy",),
    )  # fmt: skip
    return bench.BenchConfig(**(base | kw))


def _argmax_cfg(**kw: Any) -> bench.BenchConfig:
    return _bs_cfg(ops=(ARGMAX,), bs=(), **kw)


def _slow_eager(impl: str, op: str, pad_bs: int, bs: int, mode: str) -> float:
    """Eager misses both bs targets (a fixed 100 us), graph meets them."""
    return (100e-6 if mode == "eager" else 0.0) + 1e-6 * bs


_ARGMAX_SPEED = {ARGMAX: 200e-6, "swap_argmax": 300e-6, "read_once": 90e-6}  # misses both


def test_target_reason() -> None:
    row = {"device": "cuda", "launch": "threads gated", "mode": "eager"}
    assert tables.target_reason(row) == ""
    assert tables.target_reason(row | {"mode": "graph", "launch": "processes"}) == ""
    assert "without the gate" in tables.target_reason(row | {"launch": "threads ungated"})
    assert "without the gate" in tables.target_reason(row | {"launch": "processes"})
    assert "CPU" in tables.target_reason(row | {"device": "cpu", "launch": "processes"})


def test_cpu_tables_have_no_targets() -> None:
    cfg = _bs_cfg(tp=(2,), pad_bs=(8,), bs=((8, 4),), backends=("torch",), cpu=True)
    rows = fake_rows(cfg, _slow_eager, CPU_BOX)
    assert {r["device"] for r in rows} == {"cpu"}
    text = tables.format_bs_table(rows)
    assert text and "target" not in text and "MISSED" not in text and "issue 13" not in text
    cfg = _argmax_cfg(tp=(2,), pad_bs=(8,), backends=("torch",), cpu=True)
    text = tables.format_argmax_table(fake_rows(cfg, lambda i, op, *a: _ARGMAX_SPEED[op], CPU_BOX))
    assert "argmax_batch_vocab vs its baselines" in text and "1.50x" in text
    assert "targets" not in text and "MISSED" not in text and "issue 14" not in text


def test_ungated_eager_rows_get_n_a_and_graph_rows_a_verdict() -> None:
    rows = fake_rows(_bs_cfg(ungated=True), _slow_eager, ONE_GPU)
    assert {r["launch"] for r in rows} == {"threads ungated"}
    text = tables.format_bs_table(rows)
    lines = {ln.split()[4]: ln for ln in text.splitlines()[2:] if not ln.startswith("  ")}
    assert lines["130"].endswith("<= 0.56: met (graph; n/a for eager)")
    assert lines["8"].endswith("<= 0.08: met (graph; n/a for eager)")
    assert "MISSED" not in text
    assert text.splitlines()[-1].startswith("  n/a: the targets are set for device time")
    assert "eager rows without the gate" in text.splitlines()[-1]
    # eager only: nothing to judge at all, so no target column
    eager = tables.format_bs_table(
        fake_rows(_bs_cfg(ungated=True, modes=("eager",)), _slow_eager, ONE_GPU)
    )
    assert "target" not in eager and "MISSED" not in eager and "n/a" not in eager

    rows = fake_rows(_argmax_cfg(ungated=True), lambda i, op, *a: _ARGMAX_SPEED[op], ONE_GPU)
    text = tables.format_argmax_table(rows)
    body = [ln for ln in text.splitlines()[2:] if not ln.startswith("  ")]
    verdicts = {ln.split()[4]: ln for ln in body}
    assert verdicts["eager"].endswith("n/a")
    assert verdicts["graph"].endswith(">= 2.3x MISSED, <= 1.3 MISSED")  # graph is judged
    assert "n/a: the targets are set for device time" in text


def test_processes_judge_graph_rows_only_and_gated_rows_all() -> None:
    rows = fake_rows(_argmax_cfg(), lambda i, op, *a: _ARGMAX_SPEED[op], EIGHT_GPUS)
    assert {r["launch"] for r in rows} == {"processes"}
    text = tables.format_argmax_table(rows)
    assert text.count("MISSED, <= 1.3 MISSED") == 1 and text.count("n/a") == 2  # row, footnote
    gated = fake_rows(_argmax_cfg(gated=True), lambda i, op, *a: _ARGMAX_SPEED[op], ONE_GPU)
    text = tables.format_argmax_table(gated)
    assert text.count(">= 2.3x MISSED, <= 1.3 MISSED") == 2 and "n/a" not in text
    assert "issue 14" in text

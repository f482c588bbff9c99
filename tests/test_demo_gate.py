"""Where ``ipc-dpsample demo`` gates its timings (issue 23, point 4): rank threads
sharing the one GPU time every call behind the start gate by default (``--ungated``
opts out), one process per GPU and the CPU do not; the table's header says what
was measured."""

from __future__ import annotations

from typing import Any

import pytest
from test_cli import CPU_BOX, EIGHT_GPUS, ONE_GPU, ONE_GPU_NO_ONESIDED, _fake_demo_results

from ipc_dpsample.tools import cli, common, demo, demo_rank


def test_plan_gates_rank_threads_on_one_gpu_only() -> None:
    assert demo.plan_demo(ONE_GPU).gated
    assert not demo.plan_demo(ONE_GPU, ungated=True).gated
    assert not demo.plan_demo(EIGHT_GPUS).gated  # a process per GPU
    assert not demo.plan_demo(CPU_BOX).gated
    assert not demo.plan_demo(ONE_GPU_NO_ONESIDED).gated  # one rank
    assert not demo.plan_demo(ONE_GPU, cpu=True).gated


def test_run_demo_hands_one_gate_to_gated_rank_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(demo, "spawn", lambda *args, **kw: seen.append(args) or [])
    monkeypatch.setattr(demo, "make_round", lambda plan, k: [])
    demo.run_demo(demo.plan_demo(ONE_GPU))
    launch, device, world, body, plan, shared, gate = seen[-1]
    assert (launch, device, world, body) == ("threads", "cuda", 4, demo.demo_rank)
    assert isinstance(gate, common.Gate) and plan.gated
    assert shared == [[]] * plan.rounds  # the threads' one copy of the data
    demo.run_demo(demo.plan_demo(ONE_GPU, ungated=True))
    assert seen[-1][-1] is None
    demo.run_demo(demo.plan_demo(CPU_BOX))
    assert seen[-1][0] == "processes" and seen[-1][-1] is None


def test_ungated_option_reaches_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    plans: list[common.DemoPlan] = []
    monkeypatch.setattr(demo, "detect_machine", lambda: ONE_GPU)

    def fake_run(plan: common.DemoPlan, **kw: Any) -> Any:
        plans.append(plan)
        return _fake_demo_results(plan, None)

    monkeypatch.setattr(demo, "run_demo", fake_run)
    parser = cli.build_parser()
    assert demo.run(parser.parse_args(["demo", "--iters", "3"])) == 0
    assert demo.run(parser.parse_args(["demo", "--iters", "3", "--ungated"])) == 0
    assert [p.gated for p in plans] == [True, False]


@pytest.mark.parametrize(
    ("machine", "kw", "label", "line"),
    [
        (ONE_GPU, {}, "gated", "timing: gated device time: the 4 rank threads sharing the GPU"),
        (ONE_GPU, {"ungated": True}, "host path", "timing: host path, ungated (--ungated)"),
        (EIGHT_GPUS, {}, "events", "timing: CUDA events around each call"),
        (CPU_BOX, {}, "wall clock", "timing: host wall clock (perf_counter)"),
    ],
)
def test_report_header_says_what_was_timed(
    machine: common.Machine, kw: dict[str, Any], label: str, line: str
) -> None:
    plan = demo.plan_demo(machine, iters=5, **kw)
    text = demo.format_report(plan, _fake_demo_results(plan, None))
    lines = text.splitlines()
    timing = next(i for i, ln in enumerate(lines) if ln.startswith("timing: "))
    assert lines[timing].startswith(line)
    header = lines[timing + 2]
    assert header.startswith("op ") and f"median ({label})" in header and f"p90 ({label})" in header


def test_gated_timer_times_every_call_behind_the_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []

    def fake_time_gated(group: Any, rank: int, gate: Any, stream: Any, fn: Any, **kw: Any):
        calls.append((group, rank, gate, stream, fn, kw))
        return [1e-6] * kw["iters"]

    monkeypatch.setattr(demo_rank, "time_gated", fake_time_gated)
    gate, fn = common.Gate(), lambda: None
    timer = demo_rank._gated_timer("group", 3, gate, "stream", 30.0)
    assert timer(fn, 5) == [1e-6] * 5
    assert calls == [("group", 3, gate, "stream", fn, {"iters": 5, "timeout_s": 30.0})]

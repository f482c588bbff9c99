"""Where ``ipc-dpsample bench`` gates its timings (issue 23, point 4): rank threads
sharing a GPU time every sample behind the start gate by default (``--ungated``
opts out); one process per GPU and the CPU are not gated; every table says what
was measured. The gate's retake logic runs here with fake CUDA events."""

from __future__ import annotations

import argparse
import threading
from pathlib import Path
from typing import Any

import pytest
from test_bench_cli import fake_rows
from test_cli import CPU_BOX, EIGHT_GPUS, ONE_GPU

from ipc_dpsample.testing import run_threads
from ipc_dpsample.tools import bench, cli, common


def _cfg(*argv: str, gpu: bool = True) -> bench.BenchConfig:
    ns = cli.build_parser().parse_args(["bench", *argv])
    return bench.config_from_args(ns, gpu_machine=gpu)


def _plans(cfg: bench.BenchConfig, machine: common.Machine) -> dict[int, Any]:
    return {lp.tp: lp for lp in bench.plan_launches(cfg, machine)}


def test_ranks_sharing_a_gpu_are_gated_by_default() -> None:
    plans = _plans(_cfg("--tp", "1,2,8"), ONE_GPU)
    assert (plans[1].launch, plans[1].gated) == ("processes", False)  # one rank, own GPU
    assert (plans[2].launch, plans[2].gated) == ("threads", True)
    assert (plans[8].launch, plans[8].gated) == ("threads", True)
    plans = _plans(_cfg("--tp", "2,8", "--ungated"), ONE_GPU)
    assert [(lp.launch, lp.gated) for lp in plans.values()] == [("threads", False)] * 2
    # one process per GPU: nothing shares a GPU, nothing is gated (as before)
    assert not any(lp.gated for lp in bench.plan_launches(_cfg("--tp", "2,8"), EIGHT_GPUS))
    # --gated: every tp as rank threads on GPU 0, gated
    plans = _plans(_cfg("--tp", "2,8", "--gated"), EIGHT_GPUS)
    assert [(lp.launch, lp.gated) for lp in plans.values()] == [("threads", True)] * 2
    cpu = bench.plan_launches(_cfg("--tp", "2", "--cpu"), CPU_BOX)[0]
    assert (cpu.device, cpu.gated) == ("cpu", False)
    assert common.ranks_share_gpu("threads", "cuda")
    assert not common.ranks_share_gpu("threads", "cpu")
    assert not common.ranks_share_gpu("processes", "cuda")


def test_gated_and_ungated_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["bench", "--gated", "--ungated"])
    assert exc.value.code == 2 and "not allowed with" in capsys.readouterr().err
    with pytest.raises(ValueError, match="exclude each other"):
        bench.BenchConfig(gated=True, ungated=True)
    assert _cfg("--ungated").ungated and not _cfg().ungated


def test_launch_column_and_timing_header_say_what_was_measured() -> None:
    cfg = _cfg("--tp", "2", "--graph-ops", "7")
    gated = bench.plan_launches(cfg, ONE_GPU)[0]
    text = bench.timing_text(cfg, gated)
    assert text.startswith("timing: gated device time: all 2 rank threads sharing GPU 0")
    assert "released together" in text and "7 calls back to back / 7" in text
    ungated = bench.plan_launches(_cfg("--tp", "2", "--ungated"), ONE_GPU)[0]
    text = bench.timing_text(cfg, ungated)
    assert text.startswith("timing: host path, ungated (--ungated)") and "launch skew" in text
    procs = bench.plan_launches(cfg, EIGHT_GPUS)[0]
    assert "one process per GPU, not gated" in bench.timing_text(cfg, procs)
    cpu = bench.plan_launches(_cfg("--tp", "2", gpu=False), CPU_BOX)[0]
    assert bench.timing_text(cfg, cpu).startswith("timing: host wall clock (perf_counter)")
    from ipc_dpsample.tools.bench.output import launch_label

    assert [launch_label(lp) for lp in (gated, ungated, procs, cpu)] == [
        "threads gated",
        "threads ungated",
        "processes",
        "processes",
    ]


def test_run_bench_prints_the_timing_header_and_ok(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = bench.BenchConfig(
        tp=(2,), pad_bs=(8,), dtypes=("float32",), ops=("gather_verify_outputs",),
        backends=("onesided",), baselines=("copy",), out=str(tmp_path / "out"),
    )  # fmt: skip
    rows = fake_rows(cfg, lambda *a: 1e-6, ONE_GPU)
    monkeypatch.setattr(bench, "run_launch", lambda cfg, lp: (rows, ""))
    assert bench.run_bench(cfg, ONE_GPU) == 0
    out = capsys.readouterr().out
    assert "== tp=2: threads on cuda\ntiming: gated device time: all 2 rank threads" in out
    assert "OK: no point failed" in out and "FAILED" not in out


def test_run_launch_hands_the_gate_to_gated_launches_only(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[Any] = []

    def fake_spawn(launch: str, device: str, world: int, body: Any, *args: Any, **kw: Any):
        seen.append(args[2])  # (lp, cfg, gate)
        return [{"samples": {}, "info": {}, "gate_skewed": 3, "gate_cycles": 64}] * world

    monkeypatch.setattr(bench, "spawn", fake_spawn)
    cfg = _cfg("--tp", "2", "--ops", "gather_verify_outputs", "--backends", "onesided")
    bench.run_launch(cfg, bench.plan_launches(cfg, ONE_GPU)[0])
    assert isinstance(seen[-1], common.Gate)
    assert "opened before every rank had issued in 6 samples" in capsys.readouterr().err
    cfg = _cfg("--tp", "2", "--ops", "gather_verify_outputs", "--ungated")
    bench.run_launch(cfg, bench.plan_launches(cfg, ONE_GPU)[0])
    assert seen[-1] is None


# -- the gate's retakes, with fake CUDA events ---------------------------------------------
class _Event:
    """A CUDA event stand-in: elapsed time 1 ms, records nothing."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing = enable_timing

    def record(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, other: Any) -> float:
        return 1.0


class _Stream:
    def __init__(self) -> None:
        self.waits = 0

    def wait_event(self, event: Any) -> None:
        self.waits += 1


class _FakeGate(common.Gate):
    """A gate whose event reports "already open" for the first ``opened`` checks."""

    def __init__(self, opened: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.opened = opened
        self.armed = 0
        self.lock = threading.Lock()
        event = argparse.Namespace(query=self._query)
        self._cuda = (None, event)

    def _query(self) -> bool:
        self.opened -= 1
        return self.opened >= 0

    def arm(self) -> None:
        self.armed += 1


@pytest.mark.parametrize(("opened", "max_cycles", "early", "skewed", "armed"), [
    (0, 1000, 0, 0, 4),  # never early: one sample per iteration
    (2, 1000, 2, 0, 6),  # two early samples taken again, the gate doubled twice
    (3, 200, 3, 2, 5),  # 100 -> 200 (the cap) after one; the next two early ones are kept
])  # fmt: skip
def test_time_gated_retakes_early_samples_on_every_rank(
    monkeypatch: pytest.MonkeyPatch, opened: int, max_cycles: int, early: int, skewed: int,
    armed: int,
) -> None:  # fmt: skip
    import torch

    monkeypatch.setattr(torch.cuda, "Event", _Event)
    gate = _FakeGate(opened, cycles=100, max_cycles=max_cycles)
    calls = [0, 0]

    def body(rank: int, world: int, group: Any) -> list[float]:
        stream = _Stream()

        def op() -> None:
            calls[rank] += 1

        out = common.time_gated(group, rank, gate, stream, op, iters=4, timeout_s=30, repeat=2)
        assert stream.waits == armed  # held behind the gate at every attempt
        return out

    out = run_threads(2, body, timeout_s=60)
    assert out == [[0.5e-3] * 4] * 2  # 1 ms per sample of 2 calls, the same count on both
    assert (gate.early, gate.skewed, gate.armed) == (early, skewed, armed)
    assert calls == [2 * armed] * 2
    assert gate.cycles == min(100 * 2 ** (early - skewed), max_cycles)


def test_gate_is_made_lazily_and_rejects_bad_lengths() -> None:
    gate = common.Gate()  # no CUDA here: nothing is created before a rank uses it
    assert gate.cycles == common.GATE_CYCLES and gate._cuda is None
    with pytest.raises(ValueError, match="gate cycles"):
        common.Gate(cycles=0)
    with pytest.raises(ValueError, match="gate cycles"):
        common.Gate(cycles=10, max_cycles=5)

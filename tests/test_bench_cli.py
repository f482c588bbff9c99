"""``ipc-dpsample bench``: parsing, planning, statistics, rows, writers, the rank
body in process, and an end-to-end CPU run as a subprocess (the bs lists, the
argmax and the summary tables: tests/test_bench_bs_argmax.py)."""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_cli import (
    CPU_BOX,
    EIGHT_GPUS,
    ONE_GPU,
    ONE_GPU_NO_ONESIDED,
    _assert_png_has_content,
)

from ipc_dpsample.layout import reference_swap_batch_vocab
from ipc_dpsample.tools import bench, cli, common
from ipc_dpsample.tools.bench import measure as bench_measure
from ipc_dpsample.tools.bench import runners as bench_runners


# -- bench: parsing, planning, statistics, rows, writers -----------------------------
def test_bench_list_parsers() -> None:
    assert bench.parse_int_list("8,64,256") == (8, 64, 256)
    assert bench.parse_dtype_list("bf16,fp32,bfloat16") == ("bfloat16", "float32")
    assert bench.choice_list(bench.MODES)("graph,eager") == ("graph", "eager")
    for parse, text in (
        (bench.parse_int_list, "8,a"),
        (bench.parse_int_list, ","),
        (bench.parse_dtype_list, "int32"),
        (bench.parse_dtype_list, "fp8"),
        (bench.choice_list(bench.MODES), "eager,lazy"),
    ):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def test_bench_config_from_args() -> None:
    p = cli.build_parser()
    gpu = bench.config_from_args(p.parse_args(["bench"]), gpu_machine=True)
    assert (gpu.pad_bs, gpu.vocab, gpu.dtypes, gpu.tp) == (
        (8, 64, 256), 152064, ("bfloat16", "float32"), (2, 4, 8)
    )  # fmt: skip
    assert (gpu.backends, gpu.modes, gpu.iters, gpu.warmup) == (
        ("auto", "onesided", "nccl", "torch"), ("eager", "graph"), 50, 10
    )  # fmt: skip
    assert gpu.out.startswith("ipc-dpsample-bench-") and gpu.verify
    cpu = bench.config_from_args(p.parse_args(["bench"]), gpu_machine=False)
    assert (cpu.vocab, cpu.dtypes) == (32000, ("float32",))
    assert bench.config_from_args(p.parse_args(["bench", "--cpu"]), gpu_machine=True).vocab == 32000
    ns = p.parse_args(
        ["bench", "--pad-bs", "4", "--vocab", "1000", "--dtype", "fp16", "--tp", "2",
         "--backends", "torch", "--mode", "eager", "--iters", "3", "--warmup", "0",
         "--out", "x", "--no-verify", "--ops", "gather_verify_logprobs"]
    )  # fmt: skip
    cfg = bench.config_from_args(ns, gpu_machine=True)
    assert (cfg.pad_bs, cfg.vocab, cfg.dtypes, cfg.tp, cfg.backends) == (
        (4,), 1000, ("float16",), (2,), ("torch",)
    )  # fmt: skip
    assert (cfg.iters, cfg.warmup, cfg.out, cfg.verify, cfg.ops) == (
        3, 0, "x", False, ("gather_verify_logprobs",)
    )  # fmt: skip
    with pytest.raises(ValueError, match="iters=0"):
        bench.BenchConfig(iters=0)
    with pytest.raises(ValueError, match="pad_bs values"):
        bench.BenchConfig(pad_bs=(0, 8))
    with pytest.raises(ValueError, match="backends"):
        bench.BenchConfig(backends=("mpi",))


def test_plan_launches() -> None:
    cfg = bench.BenchConfig(pad_bs=(6, 8, 64), tp=(2, 4, 8), vocab=152064)
    plans = {lp.tp: lp for lp in bench.plan_launches(cfg, EIGHT_GPUS)}
    assert all(lp.launch == "processes" and lp.device == "cuda" for lp in plans.values())
    assert plans[2].pad_bs == (6, 8, 64) and plans[4].pad_bs == (8, 64)
    assert plans[8].impls == (
        "auto", "onesided", "nccl", "torch", "copy", "nccl_cupy", "torch_dist"
    )  # fmt: skip

    plans = {lp.tp: lp for lp in bench.plan_launches(cfg, ONE_GPU)}
    lp = plans[8]
    assert (lp.launch, lp.device, lp.reason) == ("threads", "cuda", "")
    assert lp.impls == ("auto", "onesided", "copy")
    assert {name for name, _ in lp.skipped} == {"nccl", "torch", "nccl_cupy", "torch_dist"}
    assert "NCCL refuses two ranks on one GPU" in dict(lp.skipped)["nccl"]

    lp = bench.plan_launches(cfg, ONE_GPU_NO_ONESIDED)[0]
    assert "one-sided backend" in lp.reason and "no kernels" in lp.reason

    cpu = bench.plan_launches(cfg, CPU_BOX)[0]
    assert (cpu.launch, cpu.device, cpu.modes) == ("processes", "cpu", ("eager",))
    assert cpu.impls == ("auto", "torch", "copy", "torch_dist")
    assert dict(cpu.skipped)["graph"].startswith("CUDA graphs need CUDA")

    odd = bench.plan_launches(bench.BenchConfig(vocab=1001, tp=(2,)), EIGHT_GPUS)[0]
    assert "vocab=1001 is not a multiple of tp=2" in odd.reason
    none = bench.plan_launches(bench.BenchConfig(pad_bs=(6,), tp=(4,)), EIGHT_GPUS)[0]
    assert "no pad_bs" in none.reason


def test_points_sweep_dtypes_only_for_the_logits_ops() -> None:
    cfg = bench.BenchConfig(
        pad_bs=(8, 16), dtypes=("bfloat16", "float32"), modes=("eager",), ops=common.OPS[:3]
    )
    lp = bench.plan_launches(cfg, EIGHT_GPUS)[0]
    pts = bench.points(cfg, lp)
    assert len(pts) == 2 * 2 + 2 + 2
    assert ("gather_verify_outputs", "int32", 8, 8, "eager", "") in pts
    assert ("gather_verify_logprobs", "float32", 16, 16, "eager", "") in pts
    assert bench.op_bytes("swap_batch_vocab", "bfloat16", 64, 8, 4, 152064) == 8 * 4 * 152064 * 2
    assert bench.op_bytes("gather_verify_outputs", "int32", 64, 8, 4, 152064) == 64 * 9 * 4


def test_summarize() -> None:
    s = bench.summarize([float(v) for v in range(1, 11)])
    assert s["n"] == 10 and s["median"] == 5.5 and s["min"] == 1.0 and s["max"] == 10.0
    assert s["p10"] == pytest.approx(1.9) and s["p90"] == pytest.approx(9.1)
    assert s["mean"] == 5.5 and s["std"] == pytest.approx(np.std(np.arange(1, 11)))
    assert bench.summarize([3.0])["p90"] == 3.0
    with pytest.raises(ValueError, match="no samples"):
        bench.summarize([])
    with pytest.raises(ValueError, match="non-finite"):
        bench.summarize([1.0, float("nan")])
    assert bench.slowest([[1.0, 5.0, 2.0], [3.0, 1.0, 2.5]]) == [3.0, 5.0, 2.5]


def fake_rows(
    cfg: bench.BenchConfig, seconds: Any, machine: common.Machine = EIGHT_GPUS
) -> list[dict[str, Any]]:
    """Rows of a launch whose two ranks report 5 samples per point: rank 0
    ``seconds(impl, op, pad_bs, bs, mode) * (1, 1.1, ... 1.4)``, rank 1 twice that."""
    lp = bench.plan_launches(cfg, machine)[0]

    def rank(r: int) -> dict[str, Any]:
        samples, info = {}, {}
        for impl in lp.impls:
            for op, dtype, pad_bs, bs, mode, mix in bench.points(cfg, lp, impl):
                key = (impl, op, dtype, pad_bs, bs, mode, mix)
                base = seconds(impl, op, pad_bs, bs, mode)
                samples[key] = [base * (1 + 0.1 * i) * (1 + r) for i in range(5)]
                info[key] = {"status": "ok", "note": "", "resolved": impl, "bs_arg": "host",
                             "verified": True if impl == "onesided" else None}  # fmt: skip
        return {"samples": samples, "info": info}

    return bench.make_rows(cfg, lp, [rank(0), rank(1)])


def _rows() -> list[dict[str, Any]]:
    cfg = bench.BenchConfig(
        pad_bs=(8, 64), dtypes=("bfloat16",), tp=(2,), modes=("eager",), backends=("onesided",),
        baselines=("copy", "nccl_cupy"), ops=("swap_batch_vocab",), vocab=1024, num_tokens=2,
    )  # fmt: skip
    speed = {"onesided": 2e-6, "copy": 1e-6, "nccl_cupy": 8e-6}
    return fake_rows(cfg, lambda impl, op, pad_bs, bs, mode: speed[impl] * pad_bs)


def test_make_rows_and_ratios() -> None:
    rows = _rows()
    assert {(r["impl"], r["pad_bs"]) for r in rows} == {
        (i, p) for i in ("onesided", "copy", "nccl_cupy") for p in (8, 64)
    }
    one = next(r for r in rows if r["impl"] == "onesided" and r["pad_bs"] == 64)
    # the slowest rank (rank 1, twice as slow) sets every sample; median of 5 = the 3rd
    assert one["median_us"] == pytest.approx(2e-6 * 64 * 1.2 * 2 * 1e6)
    assert one["bytes"] == 64 // 2 * 2 * 1024 * 2
    assert one["algbw_gbps"] == pytest.approx(one["bytes"] / (one["median_us"] * 1e-6) / 1e9, 1e-3)
    assert one["busbw_gbps"] == pytest.approx(one["algbw_gbps"] / 2, 1e-2)
    assert one["vs_copy"] == pytest.approx(0.5) and one["vs_nccl_cupy"] == pytest.approx(4.0)
    assert one["vs_torch_dist"] is None and one["verified"] is True and one["kind"] == "backend"
    copy_row = next(r for r in rows if r["impl"] == "copy" and r["pad_bs"] == 8)
    assert copy_row["kind"] == "baseline" and copy_row["vs_copy"] == 1.0
    assert copy_row["busbw_gbps"] == copy_row["algbw_gbps"] and copy_row["verified"] is None


def test_make_rows_skips_and_failures() -> None:
    cfg = bench.BenchConfig(tp=(2,), pad_bs=(8,), modes=("eager",), ops=("swap_batch_vocab",))
    lp = bench.plan_launches(cfg, ONE_GPU_NO_ONESIDED)[0]
    rows = bench.make_rows(cfg, lp, None)
    assert rows and all(r["status"] == "skipped" for r in rows)
    lp = bench.plan_launches(cfg, CPU_BOX)[0]
    info = {"status": "failed", "note": "setup: boom", "resolved": None, "verified": None}
    results = [
        {
            "samples": {},
            "info": {(i, *p): dict(info) for i in lp.impls for p in bench.points(cfg, lp, i)},
        }
        for _ in range(2)
    ]
    rows = bench.make_rows(cfg, lp, results)
    by = {(r["impl"], r["status"]) for r in rows}
    assert ("torch", "failed") in by and ("onesided", "skipped") in by
    assert all(r["note"] for r in rows)


def test_write_csv_and_json(tmp_path: Path) -> None:
    rows = _rows()
    path = bench.write_csv(rows, tmp_path / "b.csv")
    with path.open() as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames or ()) == bench.COLUMNS
        back = list(reader)
    assert len(back) == len(rows)
    assert float(back[0]["median_us"]) == rows[0]["median_us"]
    assert back[0]["vs_torch_dist"] == ""  # None -> empty cell
    meta = {"config": {"tp": [2]}, "host": "h"}
    doc = json.loads(bench.write_json(rows, meta, tmp_path / "b.json").read_text())
    assert (doc["schema"], doc["schema_version"], doc["meta"]) == ("ipc-dpsample-bench", 1, meta)
    assert doc["columns"] == list(bench.COLUMNS) and doc["rows"] == rows


def test_write_plot_draws_something(tmp_path: Path) -> None:
    path = bench.write_plot(_rows(), tmp_path / "b.png")
    assert path.stat().st_size > 0
    _assert_png_has_content(path)
    empty = bench.write_plot([], tmp_path / "empty.png")
    _assert_png_has_content(empty)


@pytest.mark.parametrize(("tp", "dtype"), [(1, "float32"), (2, "bfloat16"), (4, "float32")])
def test_bench_check_data_matches_the_reference(tp: int, dtype: str) -> None:
    """The bench's device-side expected swap equals the NumPy reference."""
    import torch

    pad_bs, n, vocab = 4 * tp, 3, 10 * tp
    inputs = [bench.swap_input(7, s, tp, pad_bs, n, vocab, dtype, "cpu") for s in range(tp)]
    ref = reference_swap_batch_vocab(
        [common.to_numpy(x) for x in inputs], tp=tp, num_tokens_per_req=n, pad_bs=pad_bs
    )
    for r in range(tp):
        exp = bench.swap_expected(7, r, tp, pad_bs, n, vocab, dtype, "cpu")
        assert common.bits_equal(common.to_numpy(exp), ref[r]) == ""
        assert bench_runners.same_bits(exp, torch.from_numpy(ref[r]).view(exp.dtype)) == ""
    assert np.count_nonzero(common.to_numpy(inputs[0])) > 0.95 * inputs[0].numel()


def test_bench_rank_in_process_agrees_on_failures() -> None:
    """Two thread ranks on the CPU: the torch backend cannot start (a ThreadGroup has
    no torch.distributed group) so every rank reports it skipped; the copy
    baseline runs; a prepare that fails on one rank fails the point on both."""
    from ipc_dpsample.testing import run_threads

    cfg = bench.BenchConfig(
        pad_bs=(4,), tp=(2,), vocab=64, num_tokens=2, dtypes=("float32",), modes=("eager",),
        backends=("torch",), baselines=("copy",), iters=3, warmup=1,
    )  # fmt: skip
    lp = bench.LaunchPlan(2, "threads", "cpu", ("torch", "copy"), (), (4,), ("eager",))
    results = run_threads(2, bench.bench_rank, lp, cfg, timeout_s=60)
    rows = bench.make_rows(cfg, lp, results)
    status = {(r["impl"], r["op"]): r["status"] for r in rows}
    assert set(status.values()) >= {"ok", "skipped"}
    assert status[("copy", "swap_batch_vocab")] == "ok"
    torch_rows = [r for r in rows if r["impl"] == "torch"]
    assert all(r["status"] == "skipped" for r in torch_rows)
    assert "torch.distributed" in torch_rows[0]["note"] or "process" in torch_rows[0]["note"]

    class Flaky(bench_runners.Runner):
        def __init__(self, rank: int) -> None:
            self.rank = rank

        def prepare(self, op: str, dtype: str, pad_bs: int, bs: int, mode: str, mix: str) -> Any:
            if self.rank == 1:
                raise RuntimeError("no memory on rank 1")
            return bench_runners.Prepared(lambda: None)

    def body(rank: int, world: int, group: Any) -> Any:
        ctx = bench_runners.RankCtx(rank, group, group, None, None, cfg, lp)
        samples: dict[Any, Any] = {}
        key = ("x", "swap_batch_vocab", "float32", 4, 4, "eager", "")
        first = bench_measure.bench_point(ctx, Flaky(rank), key, samples)
        second = bench_measure.bench_point(ctx, Flaky(5), key, samples)  # both ranks fine again
        return first, second, samples[key]

    out = run_threads(2, body, timeout_s=60)
    assert out[0][0][:2] == ("failed", "setup failed on another rank")
    assert out[0][1][4] == "none"  # how bs reached the op (Prepared's default)
    assert out[1][0][0] == "failed" and "no memory on rank 1" in out[1][0][1]
    assert [o[1][0] for o in out] == ["ok", "ok"] and len(out[0][2]) == cfg.iters


def test_bench_help_lists_every_allowed_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    text = text.replace("- ", "-")  # argparse may wrap a long choice list
    for values in (bench.BACKEND_CHOICES, bench.BASELINES, bench.MODES, ("bf16", "fp16", "fp32")):
        assert "{" + ",".join(values) + "}" in text, values
    for op in common.OPS:
        assert op in text.replace(" ", ""), op


def test_plot_legend_tells_the_torch_backend_from_torch_distributed() -> None:
    from ipc_dpsample.tools.bench import output

    ours = output.series_label("torch", "eager", "float32", show_dtype=False)
    raw = output.series_label("torch_dist", "eager", "float32", show_dtype=False)
    assert ours == "ipc_dpsample torch backend eager"
    assert raw == "raw torch.distributed eager"
    assert output.series_label("onesided", "graph", "bfloat16", show_dtype=True).endswith(
        "graph bfloat16"
    )
    assert set(output.IMPL_LABELS) == set(bench.BACKEND_CHOICES) | set(bench.BASELINES)


def test_plot_labels_pad_bs_points(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.axes import Axes

    seen: list[str] = []
    real = Axes.annotate

    def spy(self: Axes, text: str, *args: Any, **kwargs: Any) -> Any:
        seen.append(text)
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(Axes, "annotate", spy)
    bench.write_plot(_rows(), tmp_path / "b.png")
    # 3 impls x 2 pad_bs points, each labelled
    assert sorted(seen) == sorted(["pad_bs=8", "pad_bs=64"] * 3)


def test_bench_without_matplotlib_writes_csv_json_and_says_how(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    rows = _rows()
    monkeypatch.setattr(bench, "run_launch", lambda cfg, lp: (rows, ""))
    monkeypatch.setenv("GIT_COMMIT", "abc1234")
    cfg = bench.BenchConfig(tp=(2,), pad_bs=(8, 64), out=str(tmp_path / "out"), cpu=True)
    assert bench.run_bench(cfg, CPU_BOX) == 0
    captured = capsys.readouterr()
    assert (tmp_path / "out" / "bench.csv").exists()
    doc = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert len(doc["rows"]) == len(rows)
    # where a figure came from: the commit (GIT_COMMIT wins over git) and the GPU
    assert doc["meta"]["commit"] == "abc1234" and "gpu" in doc["meta"]
    assert "commit abc1234" in captured.out
    assert not (tmp_path / "out" / "bench.png").exists()
    assert "pip install 'ipc-dpsample[bench]'" in captured.err
    assert "bench.csv" in captured.out and "bench.png" not in captured.out


def test_progress_in_a_log_is_a_line_per_point_with_what_and_when(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A stalled device run must show which point it stands on: in a log (no
    terminal) every finished point prints its name and the seconds since start."""
    from ipc_dpsample.tools.bench.measure import _SimpleBar

    bar = _SimpleBar(3, "tp=8 threads cuda", tty=False)
    for what in ("onesided swap bs=256 eager", "onesided swap bs=8 eager"):
        bar.set_postfix_str(what)
        bar.update()
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    first = r"tp=8 threads cuda: 1/3 onesided swap bs=256 eager \(\d+\.\d s\)"
    assert re.fullmatch(first, lines[0])
    assert lines[1].startswith("tp=8 threads cuda: 2/3 onesided swap bs=8 eager (")


def test_bench_cpu_run_passes_and_judges_no_target(tmp_path: Path) -> None:
    """Issue 23: ``bench --cpu --iters 10 --warmup 2`` reported "8 points produced
    wrong results" (the argmax logprobs against float32 ``log_softmax``) and
    "MISSED" GPU targets. Small shapes, the CPU default vocab and every op."""
    from test_cli import _run_cli

    out = tmp_path / "bench"
    proc = _run_cli(
        "bench", "--cpu", "--iters", "10", "--warmup", "2", "--tp", "2", "--pad-bs", "8",
        "--out", str(out), timeout=240,
    )  # fmt: skip
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert "FAILED" not in text and "MISSED" not in text and "WRONG" not in text
    assert "OK: no point failed" in proc.stdout
    assert "timing: host wall clock (perf_counter)" in proc.stdout
    assert "argmax_batch_vocab vs its baselines in the same run\n" in proc.stdout  # no targets
    with (out / "bench.csv").open() as f:
        rows = list(csv.DictReader(f))
    argmax = [r for r in rows if r["op"] == common.ARGMAX and r["status"] == "ok"]
    assert {r["impl"] for r in argmax} == {"auto", "torch"}
    assert all(r["verified"] == "True" and r["vocab"] == "32000" for r in argmax)

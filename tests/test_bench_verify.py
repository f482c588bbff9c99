"""``ipc-dpsample bench --ops verify_batch_vocab`` (issue 24): the points per parameter
mix and their baselines (swap + the package's full-row sampler + gather, read_once, the
argmax), the bytes (the record per row per shard), the check against the NumPy
reference on the timed inputs, a backend without the op (skipped, not failed), the
torch path kept out of CUDA graphs, the verify table and its targets (only on GPU
device time), and a CPU run end to end.

In-process runs use thread ranks with ``tests/test_demo_verify.py``'s :class:`FakeComm`
(its collectives move the data through the ``ThreadGroup`` and return the NumPy
references; its ``verify_batch_vocab`` is unavailable, right or wrong)."""

from __future__ import annotations

import csv
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from test_bench_cli import fake_rows
from test_cli import CPU_BOX, EIGHT_GPUS, ONE_GPU, _run_cli
from test_demo_verify import FakeComm

from ipc_dpsample.group import ThreadGroup
from ipc_dpsample.layout import reference_verify_batch_vocab
from ipc_dpsample.testing import run_threads
from ipc_dpsample.tools import bench, cli, common
from ipc_dpsample.tools.bench import runners, tables
from ipc_dpsample.tools.verify_case import TARGET_MIXES, VERIFY_MIXES, record_bytes

VERIFY, ARGMAX = common.VERIFY, common.ARGMAX


@pytest.fixture
def fake_comm(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FakeComm]]:
    """:class:`FakeComm` in place of ``DpSamplingComm`` (torch's thread count restored:
    CPU rank threads set it)."""
    import ipc_dpsample.comm

    threads = torch.get_num_threads()
    cls = type("Fake", (FakeComm,), {"verify_calls": 0})
    monkeypatch.setattr(ipc_dpsample.comm, "DpSamplingComm", cls)
    yield cls
    torch.set_num_threads(threads)


def _cfg(*argv: str, gpu: bool = True) -> bench.BenchConfig:
    ns = cli.build_parser().parse_args(["bench", *argv])
    return bench.config_from_args(ns, gpu_machine=gpu)


# -- options, points, bytes -------------------------------------------------------------------
def test_options_name_the_op_and_the_mixes(capsys: pytest.CaptureFixture[str]) -> None:
    assert VERIFY in common.OPS and VERIFY not in bench.DEFAULT_OPS
    assert _cfg().ops == bench.DEFAULT_OPS and _cfg().verify_mixes == ("mixed",)
    cfg = _cfg("--ops", VERIFY, "--verify-mix", "temperature,topk50-topp0.9,temperature")
    assert cfg.ops == (VERIFY,) and cfg.verify_mixes == ("temperature", "topk50-topp0.9")
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--verify-mix", "topk"])
    assert exc.value.code == 2 and "subset of greedy,temperature,topk50" in capsys.readouterr().err
    with pytest.raises(ValueError, match="verify_mixes"):
        bench.BenchConfig(verify_mixes=("topk",))
    with pytest.raises(ValueError, match="verify_mixes must not be empty"):
        bench.BenchConfig(verify_mixes=())
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse wraps anywhere
    assert "{" + ",".join(VERIFY_MIXES) + "}" in text and "swap_sample_gather" in text


def test_points_bring_the_baselines_per_mix_once_each() -> None:
    cfg = bench.BenchConfig(
        tp=(2,), pad_bs=(8,), dtypes=("bfloat16",), modes=("eager",), ops=(ARGMAX, VERIFY),
        verify_mixes=("temperature", "topk50"), backends=("onesided",), baselines=("copy",),
    )  # fmt: skip
    lp = bench.plan_launches(cfg, EIGHT_GPUS)[0]
    pts = bench.points(cfg, lp, "onesided")
    assert [(p[0], p[5]) for p in pts] == [
        (ARGMAX, ""), ("swap_argmax", ""), ("read_once", ""),
        (VERIFY, "temperature"), (VERIFY, "topk50"),
        ("swap_sample_gather", "temperature"), ("swap_sample_gather", "topk50"),
    ]  # fmt: skip
    assert all(p[1] == "bfloat16" for p in pts)  # the verify is a logits op
    # the raw baselines move the verify's records (per mix) and not the argmax
    copy = bench.points(cfg, lp, "copy")
    assert [(p[0], p[5]) for p in copy] == [(VERIFY, "temperature"), (VERIFY, "topk50")]
    only = bench.BenchConfig(tp=(2,), pad_bs=(8,), modes=("eager",), ops=(VERIFY,))
    ops = [p[0] for p in bench.points(only, bench.plan_launches(only, EIGHT_GPUS)[0], "auto")]
    assert list(dict.fromkeys(ops)) == [VERIFY, "swap_sample_gather", "read_once", ARGMAX]
    # --verify-baselines picks some
    some = bench.BenchConfig(**(vars(only) | {"verify_baselines": ("read_once", ARGMAX)}))
    ops = [p[0] for p in bench.points(some, bench.plan_launches(some, EIGHT_GPUS)[0], "auto")]
    assert list(dict.fromkeys(ops)) == [VERIFY, "read_once", ARGMAX]
    with pytest.raises(ValueError, match="verify_baselines"):
        bench.BenchConfig(ops=(VERIFY,), verify_baselines=("copy",))


def test_bytes_are_the_records_of_the_mix() -> None:
    tp, n, v = 8, 4, 152064
    for mix, rec in (("temperature", 128), ("topk50", 520), ("minp", 296), ("topp0.9", 1312)):
        assert bench.op_bytes(VERIFY, "bfloat16", 256, tp, n, v, 130, mix) == tp * 130 * n * rec
    swap = bench.op_bytes("swap_batch_vocab", "bfloat16", 256, tp, n, v, 130)
    ssg = bench.op_bytes("swap_sample_gather", "bfloat16", 256, tp, n, v, 130, "topk50")
    assert ssg == swap + 130 * (2 * n + 1) * 4
    # vocab_limit below 51 turns top-k 50 off (top-p alone: the 128-entry list)
    assert bench.op_bytes(VERIFY, "float32", 8, 2, n, 1000, 8, "topk50-topp0.9", 40) == (
        2 * 8 * n * 1312
    )
    cfg = bench.BenchConfig(
        tp=(2,), pad_bs=(8,), dtypes=("float32",), modes=("eager",), ops=(VERIFY,),
        verify_mixes=("minp",), backends=("torch",), baselines=("copy",), vocab=1000,
    )  # fmt: skip
    rows = fake_rows(cfg, lambda *a: 1e-6)
    verify = next(r for r in rows if r["op"] == VERIFY and r["impl"] == "torch")
    assert (verify["mix"], verify["record_bytes"], verify["bytes"]) == ("minp", 296, 2 * 32 * 296)
    copy = next(r for r in rows if r["op"] == VERIFY and r["impl"] == "copy")
    assert copy["bytes"] == verify["bytes"] and verify["vs_copy"] == pytest.approx(1.0)
    assert next(r for r in rows if r["op"] == "read_once")["mix"] is None


def test_gpu_backends_count_their_kernels_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """onesided / nccl: the records of the rank's own rows from every rank (48 B + 8 B per
    list entry; onesided's device parameters hold 128 entries with top-k) plus the
    results' gather, except that onesided broadcasts a small batch's records (every real
    row's from every rank, no gather); a mix the kernels refuse moves the logits (swap +
    sampler + gather)."""
    n, v = 4, 1000
    gather = 8 * (2 * n + 1) * 4
    for backend, cap in (("onesided", 128), ("nccl", 50)):
        rec = record_bytes("topk50", 8, n, v, backend=backend)
        assert rec == 4 * (12 + 2 * cap)
        got = bench.op_bytes(VERIFY, "float32", 8, 2, n, v, 8, "topk50", backend=backend)
        # 8 x 4 rows: the one-sided kernels broadcast them (IPC_DPSAMPLE_VERIFY_BROADCAST auto)
        assert got == (2 * 8 * n * rec if backend == "onesided" else 8 * n * rec + gather)
        # 64 x 4 rows go to their owners, whatever the arena
        big = bench.op_bytes(
            VERIFY, "float32", 64, 2, n, v, 64, "topk50", backend=backend, max_pad_bs=256
        )
        assert big == 64 * n * rec + 64 * (2 * n + 1) * 4
        with monkeypatch.context() as m:
            m.setenv("IPC_DPSAMPLE_VERIFY_BROADCAST", "off")
            got = bench.op_bytes(VERIFY, "float32", 8, 2, n, v, 8, "topk50", backend=backend)
            assert got == 8 * n * rec + gather
        assert record_bytes("temperature", 8, n, v, backend=backend) == 48
        assert record_bytes("minp", 8, n, v, backend=backend) == 0
        assert bench.op_bytes(VERIFY, "bfloat16", 8, 2, n, v, 8, "topp0.9", backend=backend) == (
            bench.op_bytes("swap_sample_gather", "bfloat16", 8, 2, n, v, 8)
        )


# -- the check data ---------------------------------------------------------------------------
@pytest.mark.parametrize(("dtype", "mix"), [("float32", "topk50-topp0.9"), ("bfloat16", "mixed")])
def test_case_is_the_reference_of_the_timed_inputs(dtype: str, mix: str) -> None:
    tp, pad_bs, n, v = 2, 8, 4, 600
    cfg = bench.BenchConfig(tp=(tp,), pad_bs=(pad_bs,), vocab=v, num_tokens=n, seed=3)
    ctx = SimpleNamespace(cfg=cfg, lp=SimpleNamespace(tp=tp), device=torch.device("cpu"))
    case = runners.bench_verify_case(ctx, dtype, pad_bs, mix)  # type: ignore[arg-type]
    assert runners.bench_verify_case(ctx, dtype, pad_bs, mix) is case  # built once
    inputs = [
        common.to_numpy(bench.swap_input(3, s, tp, pad_bs, n, v, dtype, "cpu")) for s in range(tp)
    ]
    assert all(np.count_nonzero(x) == x.size for x in inputs)  # fresh data, never zeros
    want = reference_verify_batch_vocab(
        inputs, case.candidates, tp=tp, pad_bs=pad_bs, dtype=dtype, **case.params
    )
    assert case.mismatches(want) == []
    assert sorted(set(case.accept_length.tolist())) == list(range(1, n + 1))  # accept + reject
    assert case.record_bytes == record_bytes(mix, pad_bs, n, v)


@pytest.mark.parametrize("mix", ["topk50-topp0.9", "mixed", "topp0.9"])
def test_reference_tokens_in_chunks_are_the_whole_batchs(
    monkeypatch: pytest.MonkeyPatch, mix: str
) -> None:
    """The bench's reference in chunks of tp requests on a thread pool: every row's
    token equals the one-call reference's."""
    from ipc_dpsample.tools import verify_case

    tp, pad_bs, n, v = 2, 8, 3, 400
    inputs = [
        common.to_numpy(bench.swap_input(5, s, tp, pad_bs, n, v, "bfloat16", "cpu"))
        for s in range(tp)
    ]
    params = verify_case.mix_params(mix, pad_bs, np.random.default_rng(1))
    kw = dict(tp=tp, pad_bs=pad_bs, dtype="bfloat16", vocab_limit=v - 3)
    whole = verify_case.reference_tokens(inputs, **kw, params=params)
    want = reference_verify_batch_vocab(inputs, np.zeros((pad_bs, n), np.int32), **kw, **params)
    assert np.array_equal(whole, want[0])
    monkeypatch.setattr(verify_case, "_REFERENCE_CHUNK_ELEMENTS", 1)  # chunks of tp requests
    got = verify_case.reference_tokens(inputs, **kw, params=params, workers=3)
    assert got.shape == (pad_bs, n) and np.array_equal(got, want[0])


# -- the rank body with a fake backend -----------------------------------------------------------
def _run(cfg: bench.BenchConfig) -> list[dict[str, Any]]:
    lp = bench.LaunchPlan(2, "threads", "cpu", ("nccl",), (), cfg.pad_bs, ("eager",))
    return bench.make_rows(cfg, lp, run_threads(2, bench.bench_rank, lp, cfg, timeout_s=120))


def _verify_cfg(**kw: Any) -> bench.BenchConfig:
    base = dict(
        tp=(2,), pad_bs=(4,), vocab=2 * 150, num_tokens=3, dtypes=("float32",),
        modes=("eager",), ops=(VERIFY,), verify_mixes=("topk50", "temperature"),
        backends=("nccl",), baselines=(), iters=2, warmup=1,
    )  # fmt: skip
    return bench.BenchConfig(**(base | kw))


def test_a_backend_without_the_op_is_skipped_not_failed(
    fake_comm: type[FakeComm], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    rows = _run(_verify_cfg())
    verify = [r for r in rows if r["op"] == VERIFY]
    assert len(verify) == 2 and all(r["status"] == "skipped" for r in verify)
    assert verify[0]["note"] == (
        "verify_batch_vocab not available on nccl in this version (the NCCL kernels of this "
        "op are not written yet)"
    )
    assert fake_comm.verify_calls == 2  # one probe per rank, not one per point
    others = [r for r in rows if r["op"] != VERIFY]
    assert {r["op"] for r in others} == {"swap_sample_gather", "read_once", ARGMAX}
    assert all(r["status"] == "ok" for r in others)
    # the baseline (the fake's swap and gather, the package's sampler) is the reference's
    assert all(r["verified"] is True for r in others if r["op"] != "read_once")

    text = tables.format_verify_table(rows)
    lines = [ln for ln in text.splitlines() if ln.startswith("nccl ")]
    assert len(lines) == 2 and all(" not available " in ln for ln in lines), text
    # record bytes of topk50, temperature: the NCCL kernels' records (48 B + 8 B per entry)
    assert "448  " in lines[0] and " 48  " in lines[1]
    assert "not available: verify_batch_vocab not available on nccl in this version" in text

    monkeypatch.setattr(bench, "run_launch", lambda cfg, lp: (rows, ""))
    cfg = bench.BenchConfig(tp=(2,), pad_bs=(4,), out=str(tmp_path), cpu=True)
    assert bench.run_bench(cfg, CPU_BOX) == 0
    out = capsys.readouterr().out
    assert "OK: no point failed" in out and "skipped nccl: verify_batch_vocab not available" in out


def test_the_verify_is_checked_on_the_timed_inputs(fake_comm: type[FakeComm]) -> None:
    fake_comm.verify = "right"
    rows = _run(_verify_cfg(bs=((4, 3),)))
    verify = [r for r in rows if r["op"] == VERIFY]
    assert {(r["mix"], r["bs"]) for r in verify} == {
        (m, b) for m in ("topk50", "temperature") for b in (4, 3)
    }
    assert all(r["status"] == "ok" and r["verified"] is True for r in verify)
    assert all(r["vs_swap_sample_gather"] and r["vs_argmax"] for r in verify)

    fake_comm.verify = "wrong"
    rows = _run(_verify_cfg())
    verify = [r for r in rows if r["op"] == VERIFY]
    assert all(r["verified"] is False for r in verify)
    assert verify[0]["note"].startswith("WRONG RESULT: predict: 1 of 12 elements differ")


def test_the_torch_path_is_not_captured_in_a_graph(fake_comm: type[FakeComm]) -> None:
    fake_comm.name = "torch"
    cfg = _verify_cfg()
    lp = bench.LaunchPlan(1, "threads", "cpu", ("torch",), (), (4,), ("graph",))
    (group,) = ThreadGroup.create(1)
    ctx = runners.RankCtx(0, group, group, torch.device("cpu"), None, cfg, lp)
    runner = runners.CommRunner(ctx, "torch")
    with pytest.raises(runners.PointSkipped, match="not capturable in a CUDA graph"):
        runner.prepare(VERIFY, "float32", 4, 4, "graph", "topk50")
    assert fake_comm.verify_calls == 0
    fake_comm.verify = "right"
    prep = runner.prepare(VERIFY, "float32", 4, 4, "eager", "topk50")
    assert prep.check is not None and prep.check(prep.fn()) == ""


def test_a_sampler_that_cannot_be_captured_skips_the_graph_baseline(
    fake_comm: type[FakeComm], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The graph points of swap_sample_gather try the sampler alone in a CUDA graph
    first (fake here: no CUDA); a capture error skips them with the reason, once."""
    captures: list[Any] = []

    class Capture:
        def __init__(self, graph: Any, **kw: Any) -> None:
            captures.append(kw)

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: Any) -> None:
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", Capture)
    cfg = _verify_cfg()
    lp = bench.LaunchPlan(1, "threads", "cpu", ("nccl",), (), (4,), ("graph",))
    (group,) = ThreadGroup.create(1)
    ctx = runners.RankCtx(0, group, group, torch.device("cpu"), None, cfg, lp)
    runner = runners.CommRunner(ctx, "nccl")
    for mix in ("topk50", "temperature"):
        with pytest.raises(runners.PointSkipped, match="could not be captured in a CUDA graph"):
            runner.prepare("swap_sample_gather", "float32", 4, 4, "graph", mix)
    assert len(captures) == 1 and captures[0]["capture_error_mode"] == "thread_local"
    monkeypatch.setattr(Capture, "__exit__", lambda self, *exc: None)
    runner = runners.CommRunner(ctx, "nccl")
    prep = runner.prepare("swap_sample_gather", "float32", 4, 4, "graph", "topk50")
    assert prep.check is not None and prep.check(prep.fn()) == ""  # eager call of the route


# -- the verify table ------------------------------------------------------------------------
_SPEED = {VERIFY: 10e-6, "swap_sample_gather": 30e-6, "read_once": 8e-6, ARGMAX: 5e-6}


def _table_cfg(**kw: Any) -> bench.BenchConfig:
    base = dict(
        tp=(8,), pad_bs=(8,), dtypes=("bfloat16",), ops=(VERIFY,), backends=("onesided",),
        baselines=("copy",), verify_mixes=("temperature", "minp"),
    )  # fmt: skip
    return bench.BenchConfig(**(base | kw))


def test_verify_table_judges_the_targets_on_gpu_device_time() -> None:
    rows = fake_rows(_table_cfg(gated=True), lambda i, op, *a: _SPEED[op], ONE_GPU)
    text = tables.format_verify_table(rows)
    assert text.splitlines()[0].startswith(
        "verify_batch_vocab vs its baselines in the same run (issue 24, mixes temperature"
    )
    line = {tuple(ln.split()[4:6]): ln for ln in text.splitlines() if ln.startswith("onesided")}
    eager, graph = line[("eager", "temperature")], line[("graph", "temperature")]
    # 30/10 = 3x >= 2.5x; 10/8 = 1.25 <= 1.5; 10/5 = 2 > 1.5 x argmax at pad_bs=8 graph
    assert eager.endswith(">= 2.5x met, <= 1.5 read_once met"), eager
    assert graph.endswith(">= 2.5x met, <= 1.5 read_once met, <= 1.5 argmax MISSED"), graph
    assert "3.00x" in eager and "1.25" in eager and "2.00" in eager
    # the one-sided kernels' record (48 B) and the swap's bytes per row per shard
    assert " 48 " in eager and " 38016 " in eager
    minp = line[("eager", "minp")]  # the kernels refuse min-p without top-k: no record
    assert minp.split()[6] == "-" and "met" not in minp and "MISSED" not in minp  # no target
    assert "minp: min-p 0.05 without top-k" in text and "sampling.verify_rows" in text
    assert set(TARGET_MIXES) == {"temperature", "topk50", "topk50-topp0.9"}


def test_verify_table_has_no_targets_off_gpu_device_time() -> None:
    cfg = _table_cfg(backends=("torch",), modes=("eager",))
    text = tables.format_verify_table(fake_rows(cfg, lambda i, op, *a: _SPEED[op], CPU_BOX))
    assert "issue 24" not in text and "met" not in text and "MISSED" not in text
    assert "targets" not in text.splitlines()[1]  # the header: no targets column
    ungated = tables.format_verify_table(
        fake_rows(_table_cfg(), lambda i, op, *a: _SPEED[op], EIGHT_GPUS)
    )  # one process per GPU: eager rows are host issue time, graph rows are judged
    eager = next(ln for ln in ungated.splitlines() if " eager " in ln and "temperature" in ln)
    assert eager.endswith("n/a") and "n/a: the targets are set for device time" in ungated
    assert tables.format_verify_table(fake_rows(_table_cfg(ops=(ARGMAX,)), lambda *a: 1e-6)) == ""


# -- end to end on the CPU -------------------------------------------------------------------------
def test_bench_cpu_verify_end_to_end(tmp_path: Path) -> None:
    """One dtype, bfloat16 (its storage bits through the case, the ranks and the check);
    float32: the check data in test_case_is_the_reference_of_the_timed_inputs, the torch
    backend's verify in test_verify_torch, the other ops end to end in test_bench_cli."""
    out = tmp_path / "bench"
    proc = _run_cli(
        "bench", "--cpu", "--ops", VERIFY, "--iters", "3", "--warmup", "1", "--tp", "2",
        "--pad-bs", "8", "--bs", "8,5", "--vocab", "2048", "--dtype", "bf16",
        "--verify-mix", "temperature,topp0.9", "--out", str(out), timeout=240,
    )  # fmt: skip
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert "FAILED" not in text and "WRONG" not in text and "MISSED" not in text
    assert "verify_batch_vocab vs its baselines in the same run\n" in proc.stdout  # no targets
    with (out / "bench.csv").open() as f:
        rows = list(csv.DictReader(f))
    verify = [r for r in rows if r["op"] == VERIFY and r["kind"] == "backend"]
    ok = [r for r in verify if r["status"] == "ok"]
    assert {r["impl"] for r in ok} == {"auto", "torch"} and len(ok) == 2 * 2 * 2  # impl x bs x mix
    assert all(r["verified"] == "True" for r in ok)
    assert {(r["mix"], r["record_bytes"]) for r in ok} == {
        ("temperature", "128"),
        ("topp0.9", "1312"),
    }
    assert {r["status"] for r in verify if r["impl"] in ("onesided", "nccl")} == {"skipped"}
    ssg = [r for r in rows if r["op"] == "swap_sample_gather" and r["status"] == "ok"]
    assert len(ssg) == len(ok) and all(r["verified"] == "True" for r in ssg)
    assert all(float(r["vs_swap_sample_gather"]) > 0 and float(r["vs_read_once"]) > 0 for r in ok)
    # each point's outcome is printed as it is measured (a run stopped later keeps it)
    lines = [ln for ln in proc.stderr.splitlines() if "auto verify_batch_vocab [temperature]" in ln]
    assert lines and all(
        re.search(r"median [0-9.]+ us \[p10 [0-9.]+, p90 [0-9.]+\], n=3, checked", ln)
        for ln in lines
    ), lines

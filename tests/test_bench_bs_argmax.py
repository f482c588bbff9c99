"""``ipc-dpsample bench`` with real batch sizes (``--bs`` lists, issue 13) and
``argmax_batch_vocab`` against its baselines (issue 14): parsing, points, bytes,
the summary tables from synthetic rows, the graph-reuse and bs-passing decisions,
the argmax check data against the NumPy reference, and one CPU run end to end."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from test_bench_cli import fake_rows
from test_cli import CPU_BOX, EIGHT_GPUS, ONE_GPU, _assert_png_has_content, _run_cli

from ipc_dpsample.layout import Layout, reference_argmax_batch_vocab
from ipc_dpsample.tools import bench, cli, common
from ipc_dpsample.tools.bench import measure, runners, tables

ARGMAX = common.ARGMAX


def _cfg(*argv: str, gpu: bool = True) -> bench.BenchConfig:
    ns = cli.build_parser().parse_args(["bench", *argv])
    return bench.config_from_args(ns, gpu_machine=gpu)


# -- options ----------------------------------------------------------------------------
def test_bs_list_for_one_pad_bs_and_one_list_per_pad_bs() -> None:
    cfg = _cfg("--gated", "--tp", "8", "--pad-bs", "256", "--bs", "256,192,130,64,8")
    assert cfg.bs == ((256, 192, 130, 64, 8),)
    assert cfg.bs_values(256) == (256, 192, 130, 64, 8)
    cfg = _cfg("--pad-bs", "64,256", "--bs", "64,33,2/256,130")
    assert cfg.bs_values(64) == (64, 33, 2) and cfg.bs_values(256) == (256, 130)
    cfg = _cfg("--pad-bs", "64,256", "--bs", "8,2")  # one list for every pad_bs
    assert cfg.bs_values(64) == cfg.bs_values(256) == (8, 2)
    plain = _cfg("--pad-bs", "8,64")
    assert plain.bs == () and plain.bs_values(64) == (64,)  # no --bs: every row


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pad-bs", "8,64", "--bs", "4,32"], "out of range for pad_bs=8"),  # old syntax
        (["--pad-bs", "8,64,128", "--bs", "8/64"], "one list per pad_bs"),
        (["--pad-bs", "64", "--bs", "0,8"], r"bs=\[0\] out of range"),
        (["--vocab", "1000", "--vocab-limit", "1001"], "vocab_limit=1001 out of range"),
    ],
)
def test_inconsistent_bs_and_vocab_limit_raise(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _cfg(*argv)


@pytest.mark.parametrize(
    "argv", [["--bs", "8,x"], ["--bs", "8//4"], ["--ops", "argmax"], ["--vocab-limit", "a"]]
)
def test_bad_option_text_exits_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["bench", *argv])
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_ops_and_vocab_limit_options() -> None:
    cfg = _cfg("--ops", "argmax_batch_vocab", "--vocab", "1000", "--vocab-limit", "990")
    assert cfg.ops == (ARGMAX,) and cfg.vocab_limit == 990 and cfg.limit == 990
    assert _cfg("--vocab", "1000").limit == 1000
    assert ARGMAX in _cfg().ops  # measured by default


def test_help_defines_the_bs_syntax(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for part in ("LIST[/LIST...]", "--bs 64,33,2/256,130,8", "device int32", "--vocab-limit"):
        assert part in text, part
    assert "swap_argmax" in text and "read_once" in text


# -- points and bytes -------------------------------------------------------------------
def test_points_bring_the_argmax_baselines_and_bs_innermost() -> None:
    cfg = bench.BenchConfig(
        tp=(2,), pad_bs=(8,), dtypes=("bfloat16",), ops=(ARGMAX, "gather_verify_logprobs"),
        bs=((8, 3),), backends=("onesided",), baselines=("copy",),
    )  # fmt: skip
    lp = bench.plan_launches(cfg, EIGHT_GPUS)[0]
    pts = bench.points(cfg, lp, "onesided")
    assert [p[0] for p in pts][::4] == [
        ARGMAX,
        "swap_argmax",
        "read_once",
        "gather_verify_logprobs",
    ]
    assert pts[:4] == [
        (ARGMAX, "bfloat16", 8, 8, "eager", ""),
        (ARGMAX, "bfloat16", 8, 3, "eager", ""),
        (ARGMAX, "bfloat16", 8, 8, "graph", ""),
        (ARGMAX, "bfloat16", 8, 3, "graph", ""),
    ]
    # the raw baselines measure the collectives only
    assert {p[0] for p in bench.points(cfg, lp, "copy")} == {"gather_verify_logprobs"}


def test_bytes_count_real_rows_only() -> None:
    tp, n, v = 8, 4, 152064
    lay = Layout(tp, 256, n, v)
    for bs in (256, 130, 8):
        swap = bench.op_bytes("swap_batch_vocab", "float32", 256, tp, n, v, bs)
        assert swap == lay.swap_bytes_per_rank(256, 4, bs) == bs * n * (v // tp) * 4
        assert bench.op_bytes(ARGMAX, "float32", 256, tp, n, v, bs) == swap
        assert bench.op_bytes("read_once", "float32", 256, tp, n, v, bs) == swap
        assert bench.op_bytes("gather_verify_outputs", "int32", 256, tp, n, v, bs) == bs * 9 * 4
        assert bench.op_bytes("gather_verify_logprobs", "float32", 256, tp, n, v, bs) == bs * 16
    # without bs: the old accounting (what each rank receives in a full swap)
    assert bench.op_bytes("swap_batch_vocab", "bfloat16", 64, 8, 4, v) == 8 * 4 * v * 2
    cfg = bench.BenchConfig(
        tp=(2,), pad_bs=(64,), bs=((64, 16),), dtypes=("float32",), modes=("eager",),
        ops=("swap_batch_vocab", "gather_verify_outputs"), backends=("onesided",),
        baselines=("copy",), vocab=1024, num_tokens=2,
    )  # fmt: skip
    rows = fake_rows(cfg, lambda impl, op, pad_bs, bs, mode: 1e-6 * bs)
    swap16 = next(r for r in rows if r["op"] == "swap_batch_vocab" and r["bs"] == 16)
    assert swap16["bytes"] == 16 * 2 * 512 * 4
    assert swap16["algbw_gbps"] == pytest.approx(
        swap16["bytes"] / (swap16["median_us"] * 1e3), 1e-3
    )
    gather = next(r for r in rows if r["op"] == "gather_verify_outputs" and r["bs"] == 16)
    assert gather["bytes"] == 16 * 5 * 4 and gather["vs_full_bs"] == pytest.approx(0.25)
    assert all(r["bs"] in (64, 16) for r in rows)


# -- summary tables ---------------------------------------------------------------------
def _gated_cfg(**kw: Any) -> bench.BenchConfig:
    base = dict(
        tp=(8,), pad_bs=(256,), bs=((256, 192, 130, 64, 8),), dtypes=("float32",),
        ops=("swap_batch_vocab",), backends=("onesided",), baselines=("copy",), gated=True,
    )  # fmt: skip
    return bench.BenchConfig(**(base | kw))


def test_bs_table_ratios_and_targets() -> None:
    def seconds(impl: str, op: str, pad_bs: int, bs: int, mode: str) -> float:
        fixed = {"eager": 10e-6, "graph": 2e-6}[mode]  # graph: less fixed cost
        extra = 40e-6 if (bs == 130 and mode == "eager") else 0.0  # eager misses at 130
        return fixed + 1e-6 * bs + extra

    rows = fake_rows(_gated_cfg(), seconds, ONE_GPU)
    text = tables.format_bs_table(rows)
    lines = {ln.split()[4]: ln for ln in text.splitlines()[2:]}
    assert set(lines) == {"256", "192", "130", "64", "8"}
    # ratio = time(bs) / time(256) per mode
    assert f"{(10 + 130 + 40) / (10 + 256):.3f}" in lines["130"]
    assert f"{(2 + 130) / (2 + 256):.3f}" in lines["130"]
    assert lines["130"].endswith("<= 0.56: MISSED")  # the eager ratio 0.677 misses
    assert lines["8"].endswith("<= 0.08: met")  # 0.068 and 0.039
    assert lines["256"].split()[-1] == "1.000" and "target" in text.splitlines()[1]
    assert "eager us" in text and "graph ratio" in text and "issue 13" in text
    assert tables.format_bs_table(fake_rows(_gated_cfg(bs=()), seconds, ONE_GPU)) == ""
    # the same fraction of another pad_bs gets the target: 33/64 ~ 130/256, 2/64 = 8/256
    assert tables.bs_target(33, 64) == 0.56 and tables.bs_target(2, 64) == 0.08
    assert tables.bs_target(48, 64) is None


def test_bs_table_says_how_bs_reached_the_op() -> None:
    rows = fake_rows(_gated_cfg(), lambda *a: 1e-6, ONE_GPU)
    for r in rows:
        r["bs_arg"] = "device" if r["mode"] == "graph" else "host"
    assert "graph: bs is a device int32 tensor" in tables.format_bs_table(rows)
    assert "bs*: passed as a device int32 tensor" in bench.format_rows(rows)


def test_argmax_table_against_both_baselines() -> None:
    speed = {ARGMAX: 100e-6, "swap_argmax": 300e-6, "read_once": 90e-6}
    cfg = _gated_cfg(ops=(ARGMAX,), bs=(), dtypes=("float32", "bfloat16"))
    rows = fake_rows(cfg, lambda impl, op, *a: speed[op] * (2 if a[-1] == "graph" else 1), ONE_GPU)
    arg = [r for r in rows if r["op"] == ARGMAX]
    assert len(arg) == 4 and all(r["vocab_limit"] == cfg.vocab for r in arg)
    assert all(r["vs_swap_argmax"] == pytest.approx(3.0) for r in arg)
    assert all(r["vs_read_once"] == pytest.approx(0.9) for r in arg)
    text = tables.format_argmax_table(rows)
    body = text.splitlines()[2:]
    assert len(body) == 4
    assert all("3.00x" in ln and "1.11" in ln and ">= 2.3x met, <= 1.3 met" in ln for ln in body)
    slow = {ARGMAX: 200e-6, "swap_argmax": 300e-6, "read_once": 90e-6}
    text = tables.format_argmax_table(fake_rows(cfg, lambda i, op, *a: slow[op], ONE_GPU))
    assert "1.50x" in text and "2.22" in text and ">= 2.3x MISSED, <= 1.3 MISSED" in text
    assert tables.format_argmax_table(_gated_rows_without_argmax()) == ""


def _gated_rows_without_argmax() -> list[dict[str, Any]]:
    return fake_rows(_gated_cfg(bs=()), lambda *a: 1e-6, ONE_GPU)


# -- decisions of the rank body ---------------------------------------------------------
def test_graph_of_the_same_key_is_replayed_not_recaptured() -> None:
    """A point whose ``graph_key`` matches the kept graph replays it (no capture,
    which would need CUDA here); eager points return the call itself."""

    class Graph:
        def replay(self) -> None:
            return None

    graph, last = Graph(), object()
    ctx = SimpleNamespace(
        cfg=bench.BenchConfig(graph_ops=7), keep=(("swap", "f32", 8), graph, last)
    )
    prep = runners.Prepared(lambda: None, graph_key=("swap", "f32", 8), bs_arg="device")
    body, calls, out = measure._build(ctx, prep, "graph")  # type: ignore[arg-type]
    assert body == graph.replay and calls == 7 and out is last
    body, calls, out = measure._build(ctx, prep, "eager")  # type: ignore[arg-type]
    assert body is prep.fn and calls == 1 and out is None


def test_bs_reaches_the_package_ops_as_host_int_or_device_scalar() -> None:
    r = object.__new__(runners.CommRunner)
    r.ctx = SimpleNamespace(cfg=bench.BenchConfig(pad_bs=(8,), bs=((8, 3),)), device="cpu")
    r._bs_dev = None
    assert r._bs_kw("swap_batch_vocab", 3, "eager") == ({"bs": 3}, "host")
    assert r._bs_kw("swap_argmax", 3, "graph") == ({"bs": 3}, "host")  # baselines: host
    kw, how = r._bs_kw(ARGMAX, 3, "graph")
    assert how == "device" and kw["bs"].dtype == torch.int32 and kw["bs"].tolist() == [3]
    again, _ = r._bs_kw("gather_verify_outputs", 5, "graph")  # one scalar, rewritten
    assert again["bs"] is kw["bs"] and kw["bs"].tolist() == [5]
    r.ctx = SimpleNamespace(cfg=bench.BenchConfig(pad_bs=(8,)), device="cpu")
    assert r._bs_kw("swap_batch_vocab", 8, "graph") == ({}, "none")  # no --bs: not passed


@pytest.mark.parametrize(("dtype", "limit"), [("float32", None), ("bfloat16", 37), ("float16", 5)])
def test_argmax_check_data_matches_the_reference(dtype: str, limit: int | None) -> None:
    tp, pad_bs, n, vocab = 2, 4, 3, 40
    inputs = [bench.swap_input(3, s, tp, pad_bs, n, vocab, dtype, "cpu") for s in range(tp)]
    ref = reference_argmax_batch_vocab(
        [common.to_numpy(x) for x in inputs], tp=tp, num_tokens_per_req=n, pad_bs=pad_bs,
        dtype=dtype, vocab_limit=limit,
    )  # fmt: skip
    for r in range(tp):
        full = bench.swap_expected(3, r, tp, pad_bs, n, vocab, dtype, "cpu")
        ids, lps = runners.argmax_expected(full, limit or vocab)
        assert ids.dtype == torch.int32 and np.array_equal(ids.numpy(), ref[r][0])
        assert lps.dtype == torch.float64  # the reference is float64, not float32
        # the layout's reference (float64, rounded to float32) is within the tolerance
        assert runners.close_logprobs(torch.from_numpy(ref[r][1]), lps, limit or vocab) == ""


def test_close_logprobs_is_nan_aware() -> None:
    a = torch.tensor([-1.0, float("nan"), float("-inf"), -2.0])
    assert runners.close_logprobs(a, a.double(), 1000) == ""
    assert runners.close_logprobs(a, a.double() + 2e-6, 1000) == ""  # NaN, -inf still match
    msg = runners.close_logprobs(a, torch.tensor([-1.0, -3.0, float("-inf"), -2.1]), 1000)
    assert msg.startswith("2 of 4 logprobs differ from the float64 reference by more than")
    assert "worst inf" in msg  # the NaN against -3 counts as infinitely far
    assert common.logprobs_close(a.numpy(), a.numpy() + 2e-6, 1000) == ""
    far = common.logprobs_close(a.numpy(), a.numpy() - [0, 0, 0, 1], 1000)
    assert far.startswith("1 of 4 logprobs differ") and "first at 3" in far
    # an infinity matches only itself, whatever the tolerance
    assert "1 of 1" in common.logprobs_close(np.array([-1e30]), np.array([-np.inf]), 1000)
    assert common.logprobs_close(a.numpy(), a.numpy() + 0.5, 1000, atol=0.6) == ""


# -- end to end on the CPU --------------------------------------------------------------
def test_bench_cpu_bs_list_and_argmax_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = _run_cli(
        "bench", "--cpu", "--tp", "2", "--pad-bs", "4,8", "--bs", "4,3/8,5,1", "--vocab", "512",
        "--vocab-limit", "500", "--num-tokens", "2", "--dtype", "fp32,bf16", "--iters", "3",
        "--warmup", "1", "--out", str(out), timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with (out / "bench.csv").open() as f:
        rows = list(csv.DictReader(f))
    ok = [r for r in rows if r["status"] == "ok"]
    assert {r["impl"] for r in ok} == {"auto", "torch", "copy", "torch_dist"}
    assert {r["impl"] for r in rows if r["status"] == "skipped"} == {
        "onesided",
        "nccl",
        "nccl_cupy",
    }
    checked = [r for r in ok if r["kind"] == "backend" and r["op"] != "read_once"]
    assert checked and all(r["verified"] == "True" for r in checked)
    assert all(float(r["median_us"]) > 0 and float(r["p90_us"]) >= float(r["p10_us"]) for r in ok)
    torch_ops = {(r["op"], r["pad_bs"], r["bs"]) for r in ok if r["impl"] == "torch"}
    for op in (*bench.DEFAULT_OPS, "swap_argmax", "read_once"):
        assert {(p, b) for o, p, b in torch_ops if o == op} == {
            ("4", "4"), ("4", "3"), ("8", "8"), ("8", "5"), ("8", "1")
        }, op  # fmt: skip
    for r in ok:
        dtype = r["dtype"] if r["dtype"] != "int32" else "float32"
        want = bench.op_bytes(r["op"], dtype, int(r["pad_bs"]), 2, 2, 512, int(r["bs"]))
        assert int(r["bytes"]) == want, r
        assert r["bs_arg"] == ("host" if r["kind"] == "backend" else "none")  # CPU: eager
    argmax = [r for r in ok if r["op"] == ARGMAX]
    assert all(r["vocab_limit"] == "500" and float(r["vs_swap_argmax"]) > 0 for r in argmax)
    assert all(float(r["vs_full_bs"]) > 0 for r in ok)
    assert "bs scaling" in proc.stdout and "argmax_batch_vocab vs its baselines" in proc.stdout
    doc = json.loads((out / "bench.json").read_text())
    assert doc["meta"]["config"]["bs"] == [[4, 3], [8, 5, 1]]
    assert doc["meta"]["config"]["vocab_limit"] == 500
    _assert_png_has_content(out / "bench.png")


def test_gated_plans_on_gpus_and_not_on_the_cpu() -> None:
    cfg = _cfg("--gated", "--tp", "8,1", "--pad-bs", "64,256", "--bs", "64,50/256,130")
    plans = bench.plan_launches(cfg, EIGHT_GPUS)
    assert [(lp.tp, lp.launch, lp.gated) for lp in plans] == [
        (8, "threads", True),
        (1, "threads", True),
    ]
    assert "gated" in bench.plan_launches(cfg, CPU_BOX)[0].reason
    rows = bench.make_rows(cfg, plans[0], None)
    swap = [r for r in rows if r["op"] == "swap_batch_vocab"]
    assert {(r["pad_bs"], r["bs"]) for r in swap} == {(64, 64), (64, 50), (256, 256), (256, 130)}
    assert all(r["launch"] == "threads gated" for r in rows)


# -- scripts/bench_onesided.py ------------------------------------------------------------
def _bench_onesided_argvs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *argv: str):
    import importlib.util
    import sys

    path = Path(__file__).resolve().parent.parent / "scripts" / "bench_onesided.py"
    spec = importlib.util.spec_from_file_location("bench_onesided_script", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    calls: list[list[str]] = []
    monkeypatch.setattr(script, "tool_main", lambda a: calls.append(list(a)) or 0)
    monkeypatch.setattr(sys, "argv", ["bench_onesided.py", "--out", str(tmp_path), *argv])
    assert script.main() == 0
    return calls


def _opt(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_bench_onesided_passes_bs_to_the_big_swap_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls = _bench_onesided_argvs(monkeypatch, tmp_path, "--bs", "256,130,8")
    big, small_swap, gathers = calls
    assert _opt(big, "--pad-bs") == "256" and _opt(big, "--bs") == "256,130,8"
    assert _opt(big, "--mode") == "eager,graph" and _opt(big, "--tp") == "8,1"
    assert "--bs" not in small_swap and "--bs" not in gathers  # their pad_bs are 8 and 64
    (only,) = _bench_onesided_argvs(monkeypatch, tmp_path, "--big-only")
    assert "--bs" not in only and _opt(only, "--mode") == "eager"

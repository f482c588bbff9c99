"""The command-line tools: argument parsing, pure planning and verdict logic, the
doctor's JSON schema, the bench's statistics and writers, and end-to-end runs of
``python -m ipc_dpsample demo|doctor|bench`` as subprocesses on this machine."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ipc_dpsample.layout import reference_swap_batch_vocab
from ipc_dpsample.tools import bench, cli, common, demo, doctor
from ipc_dpsample.tools.doctor.collect import _cuda_version

REPO = Path(__file__).resolve().parents[1]
CPU_BOX = common.Machine(torch_gpus=0, cupy_gpus=0, cpu_count=2)
ONE_GPU = common.Machine(
    torch_gpus=1, cupy_gpus=1, onesided=True, nccl_backend=True, cupy_nccl=True
)
ONE_GPU_NO_ONESIDED = common.Machine(
    torch_gpus=1, cupy_gpus=1, onesided_error="ImportError: no kernels", cupy_nccl=True
)
EIGHT_GPUS = common.Machine(
    torch_gpus=8, cupy_gpus=8, onesided=True, nccl_backend=True, cupy_nccl=True
)


# -- helpers ------------------------------------------------------------------------
def _launcher_rank() -> int | None:
    from ipc_dpsample.launch import launched_world

    world = launched_world()
    return None if world is None or world[1] == 1 else world[0]


def _run_cli(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -m ipc_dpsample ARGS`` in a clean environment (no launcher
    variables, the repository first on ``PYTHONPATH``)."""
    rank = _launcher_rank()
    if rank not in (None, 0):
        pytest.skip(f"end-to-end CLI runs on launcher rank 0 only (this is rank {rank})")
    drop = set(cli.launcher_variables(os.environ))
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.pop("IPC_DPSAMPLE_BACKEND", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "ipc_dpsample", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=env,
        check=False,
    )


def _assert_png_has_content(path: Path) -> None:
    """The PNG decodes, has pixels, and is not one flat color."""
    from matplotlib.image import imread

    img = imread(str(path))
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100, img.shape
    rgb = img[..., :3].reshape(-1, 3)
    colors = np.unique((rgb * 255).astype(np.uint8), axis=0)
    assert len(colors) > 20, f"only {len(colors)} colors: a blank image"
    dark = np.mean(rgb.mean(axis=1) < 0.5)
    assert dark > 0.002, f"only {dark:.4%} dark pixels: nothing is drawn"


# -- cli ------------------------------------------------------------------------------
def test_parser_knows_every_subcommand() -> None:
    p = cli.build_parser()
    ns = p.parse_args(["demo", "--world-size", "3", "--backend", "torch", "--iters", "5"])
    assert (ns.command, ns.world_size, ns.backend, ns.iters, ns.cpu) == (
        "demo",
        3,
        "torch",
        5,
        False,
    )
    assert ns.func is demo.run
    ns = p.parse_args(["doctor", "--json"])
    assert ns.json is True and ns.func is doctor.run
    ns = p.parse_args(["bench", "--pad-bs", "8,64", "--dtype", "bf16", "--tp", "2"])
    assert (ns.pad_bs, ns.dtype, ns.tp) == ((8, 64), ("bfloat16",), (2,))
    assert ns.func is bench.run


@pytest.mark.parametrize("command", ["demo", "bench", "doctor"])
def test_subcommand_help_is_plain_complete_sentences(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--help`` shows the whole description (not its first line cut mid-sentence),
    with no reST markup; every paragraph ends a sentence."""
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "`" not in text and ":func:" not in text and ":mod:" not in text
    module = {"demo": demo, "bench": bench, "doctor": doctor}[command]
    description = module.DESCRIPTION
    assert description in text  # verbatim: as wrapped by hand, nothing cut
    paragraphs = [p for p in description.split("\n\n") if p.strip()]
    assert len(paragraphs) >= 2 and "Exit status" in paragraphs[-1]
    for p in paragraphs:
        assert p.rstrip().endswith("."), p
        assert all(len(line) <= 79 for line in p.splitlines()), p
    head = text.split("\n\n")
    assert head[0].startswith(f"usage: ipc-dpsample {command}")
    assert head[1] == paragraphs[0]  # the description comes right after the usage


def test_top_level_help_has_no_markup(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    assert "`" not in text and all(c in text for c in ("demo", "doctor", "bench"))


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["nope"],
        ["demo", "--backend", "mpi"],
        ["bench", "--backends", "auto,foo"],
        ["bench", "--pad-bs", "8,x"],
        ["bench", "--dtype", "int32"],
        ["bench", "--mode", "lazy"],
    ],
)
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_refuses_to_run_as_one_rank_of_a_launched_world(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in cli._LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.main(["doctor"]) == 2
    assert "launched as rank 1 of 2" in capsys.readouterr().err


def test_a_launcher_world_of_one_is_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in cli._LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert cli._detach_from_launcher() is None
    for name in ("SLURM_PROCID", "SLURM_NTASKS", "TORCHELASTIC_USE_AGENT_STORE"):
        assert name not in os.environ


# -- demo planning and checking -------------------------------------------------------
def test_plan_demo_per_machine() -> None:
    plan = demo.plan_demo(CPU_BOX)
    assert (plan.world, plan.launch, plan.device) == (4, "processes", "cpu")
    assert (plan.vocab, plan.dtype, plan.pad_bs) == (32000, "float32", 16)
    plan = demo.plan_demo(ONE_GPU)
    assert (plan.world, plan.launch, plan.device, plan.dtype) == (4, "threads", "cuda", "bfloat16")
    assert (plan.pad_bs, plan.num_tokens, plan.vocab) == (64, 4, 152064)
    plan = demo.plan_demo(ONE_GPU_NO_ONESIDED)
    assert (plan.world, plan.launch) == (1, "processes")
    assert "no kernels" in plan.note
    plan = demo.plan_demo(ONE_GPU, backend="torch")
    assert (plan.world, plan.launch) == (1, "processes")
    plan = demo.plan_demo(EIGHT_GPUS)
    assert (plan.world, plan.launch, plan.device) == (8, "processes", "cuda")
    plan = demo.plan_demo(EIGHT_GPUS, cpu=True, world_size=2)
    assert (plan.world, plan.device) == (2, "cpu")


def test_demo_bs_leaves_a_partial_and_an_empty_rank() -> None:
    from ipc_dpsample.layout import real_reqs

    plan = demo.plan_demo(CPU_BOX)  # pad_bs=16 over 4 ranks
    assert plan.bs == 11 < plan.pad_bs
    assert [real_reqs(plan.reqs_per_rank, plan.bs, r) for r in range(4)] == [4, 4, 3, 0]
    one = common.DemoPlan(world=1, launch="processes", device="cpu", pad_bs=4)
    assert one.bs == 1


def test_plan_demo_rounds_shapes_up_to_the_world() -> None:
    plan = demo.plan_demo(CPU_BOX, world_size=3)
    assert plan.pad_bs % 3 == 0 and plan.vocab % 3 == 0
    assert plan.pad_bs >= 16 and plan.vocab >= 32000
    plan = demo.plan_demo(EIGHT_GPUS, world_size=5)
    assert (plan.pad_bs, plan.vocab) == (65, 152065)


def test_plan_demo_rejects_what_the_machine_cannot_place() -> None:
    with pytest.raises(ValueError, match="one process per GPU"):
        demo.plan_demo(EIGHT_GPUS, world_size=9)
    with pytest.raises(ValueError, match="one-sided backend"):
        demo.plan_demo(ONE_GPU_NO_ONESIDED, world_size=4)
    with pytest.raises(ValueError, match=">= 1"):
        demo.plan_demo(CPU_BOX, world_size=0)
    with pytest.raises(ValueError, match="multiple of 4"):
        common.DemoPlan(world=4, launch="processes", device="cpu", pad_bs=6)


def test_bits_equal_is_bit_exact() -> None:
    a = np.array([1.0, -0.0, np.nan], dtype=np.float32)
    assert common.bits_equal(a, a.copy()) == ""
    other = np.array([1.0, 0.0, np.nan], np.float32)
    assert "1 of 3 elements differ" in common.bits_equal(a, other)
    assert "shape" in common.bits_equal(a, a[:2])
    b = np.arange(6, dtype=np.uint16).reshape(2, 3)
    c = b.copy()
    c[1, 2] ^= 1
    msg = common.bits_equal(c, b)
    assert "first at (1, 2)" in msg and "got 0x4" in msg and "expected 0x5" in msg


def test_make_round_is_seeded_random_and_matches_the_reference() -> None:
    plan = common.DemoPlan(
        world=3, launch="processes", device="cpu", pad_bs=6, num_tokens=2, vocab=30,
        dtype="bfloat16", iters=1,
    )  # fmt: skip
    full = common.make_round(plan, 0)
    mine = common.make_round(plan, 0, [2])[0]
    assert common.bits_equal(mine.logits, full[2].logits) == ""
    assert common.bits_equal(mine.expect_swap, full[2].expect_swap) == ""
    other = common.make_round(plan, 1, [2])[0]
    assert common.bits_equal(other.logits, mine.logits) != ""
    for d in full:
        assert d.logits.dtype == np.uint16 and d.logits.shape == (12, 10)
        assert np.count_nonzero(d.logits) > 0.95 * d.logits.size
        assert np.all(d.accept_length >= 1) and np.all(d.logprobs < 0)
    expected = reference_swap_batch_vocab(
        [d.logits for d in full], tp=3, num_tokens_per_req=2, pad_bs=6
    )
    for r in range(3):
        assert common.bits_equal(full[r].expect_swap, expected[r]) == ""


def _fake_demo_results(plan: common.DemoPlan, bad_rank: int | None) -> list[dict[str, Any]]:
    out = []
    for r in range(plan.world):
        ops = {
            op: {
                "times_s": [1e-3 * (1 + i + r) for i in range(plan.iters)],
                "checks": 4,
                "bs_checks": 1,
                "mismatches": ["logprobs: 1 of 8 elements differ"]
                if r == bad_rank and op == "gather_verify_logprobs"
                else [],
            }
            for op in common.OPS
        }
        out.append(
            {"rank": r, "backend": "torch", "explain": "torch: test", "device": "cpu", "ops": ops}
        )
    return out


def test_demo_report_and_exit_code(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = common.DemoPlan(world=2, launch="processes", device="cpu", iters=5, note="test")
    good = _fake_demo_results(plan, None)
    assert demo.slowest_rank_times(good, "swap_batch_vocab") == [2e-3, 3e-3, 4e-3, 5e-3, 6e-3]
    table = demo.format_report(plan, good)
    assert "4.00 ms" in table  # median of the slowest rank
    assert table.count(f"yes (8 outputs, 2 with bs={plan.bs})") == len(common.OPS)  # every op
    assert "argmax_batch_vocab" in table and "2 x [32]" in table  # R*N ids and logprobs
    bad = _fake_demo_results(plan, 1)
    assert demo.mismatches(bad) == [
        "rank 1 gather_verify_logprobs: logprobs: 1 of 8 elements differ"
    ]
    assert "NO (1/8 wrong)" in demo.format_report(plan, bad)

    ns = cli.build_parser().parse_args(["demo", "--cpu", "--world-size", "2", "--iters", "5"])
    monkeypatch.setattr(demo, "run_demo", lambda p, **kw: _fake_demo_results(p, 0))
    assert demo.run(ns) == 1
    assert "FAILED: 1 outputs differ" in capsys.readouterr().out
    monkeypatch.setattr(demo, "run_demo", lambda p, **kw: _fake_demo_results(p, None))
    assert demo.run(ns) == 0

    from ipc_dpsample.testing import RankFailure

    def fail(p: common.DemoPlan, **kw: Any) -> Any:
        raise RankFailure("--- rank 1 failed ---\nboom")

    monkeypatch.setattr(demo, "run_demo", fail)
    assert demo.run(ns) == 1
    assert "boom" in capsys.readouterr().err


_TWO_TRACEBACKS = (
    '--- rank 1 failed ---\nTraceback (most recent call last):\n  File "x.py", line 3\n'
    "ValueError: local_logits shape (96, 100) != expected (96, 128)\n"
    '--- rank 3 failed ---\nTraceback (most recent call last):\n  File "y.py", line 9\n'
    "ipc_dpsample.errors.PeerTimeoutError: rank 3 timed out waiting for rank 1\n"
    "--- ranks [0, 2] still running after 60 s ---"
)


def test_failure_summary_names_ranks_and_the_first_error() -> None:
    line = common.failure_summary(_TWO_TRACEBACKS)
    assert line == (
        "ranks 1, 3 failed (ranks [0, 2] still running after 60 s): "
        "ValueError: local_logits shape (96, 100) != expected (96, 128)"
    )
    assert common.failure_summary("--- rank 0 failed ---\nRuntimeError: x") == (
        "rank 0 failed: RuntimeError: x"
    )
    hung = "--- ranks [1] did not finish within 5 s (killed) ---"
    assert common.failure_summary(hung) == "ranks [1] did not finish within 5 s (killed)"


def test_demo_rank_failure_prints_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from ipc_dpsample.testing import RankFailure

    def fail(p: common.DemoPlan, **kw: Any) -> Any:
        raise RankFailure(_TWO_TRACEBACKS)

    monkeypatch.setattr(demo, "run_demo", fail)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    parser = cli.build_parser()
    assert demo.run(parser.parse_args(["demo", "--cpu", "--world-size", "2"])) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "ranks 1, 3 failed" in err and "ValueError: local_logits shape" in err
    assert "Traceback" not in err and "PeerTimeoutError" not in err
    (log,) = tmp_path.glob("ipc-dpsample-demo-*.log")
    assert str(log) in err and log.read_text() == _TWO_TRACEBACKS

    assert demo.run(parser.parse_args(["demo", "--cpu", "--world-size", "2", "--verbose"])) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[0].startswith("ipc-dpsample demo: FAILED")
    assert err.count("Traceback") == 2 and "PeerTimeoutError" in err


# -- doctor: schema, hazards, selection, verdict -------------------------------------
def _gpu_report(n: int = 2) -> dict[str, Any]:
    """A well-formed report of a healthy n-GPU box."""
    pairs = [
        {"a": a, "b": b, "driver": None if a == b else True, "verified": True, "detail": "",
         "seconds": 1.5}
        for a in range(n) for b in range(a, n)
    ]  # fmt: skip
    report: dict[str, Any] = {
        "schema_version": doctor.SCHEMA_VERSION,
        "tool": doctor.TOOL,
        "generated_at": "2026-12-02T00:00:00+00:00",
        "verdict": {"ok": False, "level": "unhealthy", "text": ""},
        "host": {
            "hostname": "box", "platform": "Linux", "cpu_count": 16, "boot_id": "b",
            "shm_bytes": 64 << 30, "container": True,
        },
        "versions": dict.fromkeys(doctor.VERSION_KEYS, "1.0"),
        "gpus": {
            "torch_count": n,
            "cupy_count": n,
            "devices": [
                {"index": i, "name": "NVIDIA H200", "uuid": f"GPU-{i}", "compute_capability": "9.0",
                 "memory_bytes": 150 << 30, "pci_bus_id": None}
                for i in range(n)
            ],
            "error": None,
        },
        "p2p": {
            "driver": [[None if a == b else True for b in range(n)] for a in range(n)],
            "verified": [[True] * n for _ in range(n)],
            "pairs": pairs,
            "skipped": None,
        },
        "topology": {"source": "none", "gpus": [], "pairs": [], "text": None, "detail": "x"},
        "hazards": [],
        "backends": {
            "onesided": {"importable": True, "error": ""},
            "nccl": {"importable": True, "error": ""},
        },
        "selftests": [
            {"name": "torch-cpu-gloo", "backend": "torch", "resolved": "torch", "device": "cpu",
             "ranks": 2, "launch": "processes", "status": "passed", "detail": "", "seconds": 1.0},
            {"name": "onesided-threads", "backend": "onesided", "resolved": "onesided",
             "device": "cuda", "ranks": 4, "launch": "threads", "status": "passed", "detail": "",
             "seconds": 2.0},
        ],
    }  # fmt: skip
    report["selection"] = doctor.collect_selection(report, {})
    return report


def _cpu_report() -> dict[str, Any]:
    r = _gpu_report(0)
    r["gpus"]["error"] = "CuPy: CUDARuntimeError: no GPU"
    r["p2p"]["skipped"] = "no GPU CuPy can drive"
    r["selftests"] = r["selftests"][:1]
    r["selection"] = doctor.collect_selection(r, {})
    return r


def _finish(report: dict[str, Any]) -> dict[str, Any]:
    ok, text = doctor.verdict(report)
    report["verdict"] = {"ok": ok, "level": doctor.level(ok, report), "text": text}
    return report


def test_schema_is_valid_json_schema_and_reports_validate() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(doctor.SCHEMA)
    for report in (_finish(_gpu_report()), _finish(_cpu_report())):
        assert doctor.validate(report) == []
        jsonschema.validate(report, doctor.SCHEMA)
        json.loads(json.dumps(report))  # serialisable as is


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r.pop("hazards"), "missing key 'hazards'"),
        (lambda r: r.update(extra=1), "unexpected key 'extra'"),
        (lambda r: r["verdict"].update(level="fine"), "not in"),
        (lambda r: r["gpus"].update(torch_count=True), "is not integer"),
        (lambda r: r["gpus"].update(cupy_count=-1), "< minimum 0"),
        (lambda r: r.update(schema_version=2), "!= const 1"),
        (lambda r: r["selftests"][0].update(status="ok"), "not in"),
        (lambda r: r["p2p"]["driver"][0].append("yes"), "is not boolean/null"),
    ],
)
def test_validate_reports_what_is_wrong(mutate: Any, message: str) -> None:
    report = _finish(_gpu_report())
    mutate(report)
    errors = doctor.validate(report)
    assert errors and any(message in e for e in errors), errors


def test_verdict_cpu_box() -> None:
    ok, text = doctor.verdict(_cpu_report())
    assert ok and text.startswith("HEALTHY (CPU path)")
    r = _cpu_report()
    r["selftests"][0]["status"] = "failed"
    ok, text = doctor.verdict(r)
    assert not ok and "self-test torch-cpu-gloo failed" in text
    r["selftests"][0]["status"] = "skipped"
    ok, text = doctor.verdict(r)
    assert not ok and "did not pass" in text
    r = _cpu_report()
    r["hazards"] = [{"id": "x", "severity": "warning", "message": "m", "fix": "f"}]
    ok, text = doctor.verdict(r)
    assert ok and "(1 warning)" in text


def test_verdict_gpu_box() -> None:
    ok, text = doctor.verdict(_gpu_report())
    assert ok
    assert text == (
        "HEALTHY: 2 GPUs, CUDA IPC verified on 3/3 pairs, auto chooses onesided, "
        "2/2 self-tests passed"
    )
    r = _gpu_report()
    r["hazards"].append({"id": "ipc", "severity": "error", "message": "IPC broke", "fix": "f"})
    assert doctor.verdict(r) == (False, "UNHEALTHY: IPC broke")
    r = _gpu_report()
    r["selftests"][1]["status"] = "skipped"
    ok, text = doctor.verdict(r)
    assert not ok and "no GPU self-test passed" in text
    r = _gpu_report()
    r["selection"]["backend"] = None
    r["selection"]["reason"] = "nothing works"
    ok, text = doctor.verdict(r)
    assert not ok and "no backend can run (nothing works)" in text


def test_hazards() -> None:
    gpus = _gpu_report()["gpus"]
    p2p = copy.deepcopy(_gpu_report()["p2p"])
    backends = _gpu_report()["backends"]
    env = {
        "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64, expandable_segments:True",
        "NCCL_P2P_DISABLE": "1",
        "CUDA_VISIBLE_DEVICES": "0,1",
    }
    found = doctor.find_hazards(env=env, shm=64 << 20, gpus=gpus, p2p=p2p, backends=backends)
    by_id = {h["id"]: h for h in found}
    assert by_id["expandable-segments"]["severity"] == "warning"
    assert by_id["nccl-p2p-disable"]["severity"] == "warning"
    assert "64 MiB" in by_id["small-dev-shm"]["message"]
    assert "--ipc=host" in by_id["small-dev-shm"]["fix"]
    assert by_id["cuda-visible-devices"]["severity"] == "info"
    assert not any(h["severity"] == "error" for h in found)
    assert doctor.find_hazards(env={}, shm=64 << 30, gpus=gpus, p2p=p2p, backends=backends) == []

    p2p["pairs"][1].update(verified=False, detail="cudaIpcOpenMemHandle failed")
    found = doctor.find_hazards(env={}, shm=None, gpus=gpus, p2p=p2p, backends=backends)
    by_id = {h["id"]: h for h in found}
    assert by_id["ipc-failed-0-1"]["severity"] == "error"
    assert "cudaIpcOpenMemHandle failed" in by_id["ipc-failed-0-1"]["message"]
    assert "no-dev-shm" in by_id
    p2p["pairs"][1]["driver"] = False  # no P2P by design: IPC failing is expected
    found = doctor.find_hazards(env={}, shm=None, gpus=gpus, p2p=p2p, backends=backends)
    assert {h["id"]: h["severity"] for h in found}["ipc-failed-0-1"] == "warning"

    no_cupy = dict(gpus, cupy_count=0, error="CuPy: cudaErrorInsufficientDriver")
    found = doctor.find_hazards(
        env={}, shm=1 << 40, gpus=no_cupy, p2p={"pairs": []},
        backends={"onesided": {"importable": False, "error": "ImportError: x"},
                  "nccl": {"importable": True, "error": ""}},
    )  # fmt: skip
    by_id = {h["id"]: h for h in found}
    assert by_id["cupy-no-gpu"]["severity"] == "error"
    assert "cudaErrorInsufficientDriver" in by_id["cupy-no-gpu"]["message"]
    assert "ImportError: x" in by_id["onesided-unavailable"]["message"]


def test_selection_from_gathered_facts() -> None:
    r = _gpu_report()
    assert r["selection"]["backend"] == "onesided"
    assert r["selection"]["facts"]["tp_size"] == 2
    sel = doctor.collect_selection(r, {"NCCL_P2P_DISABLE": "1"})
    assert sel["backend"] == "nccl" and "NCCL_P2P_DISABLE" in sel["reason"]
    r["p2p"]["pairs"][1].update(verified=False, detail="GPU 1 at read-back: wrong")
    sel = doctor.collect_selection(r, {})
    assert sel["backend"] == "nccl" and "read-back" in sel["reason"]
    r = _gpu_report()
    r["p2p"]["driver"][0][1] = False
    sel = doctor.collect_selection(r, {})
    assert sel["backend"] == "nccl" and "GPU 0 -> GPU 1" in sel["reason"]
    r = _gpu_report()
    r["backends"]["onesided"] = {"importable": False, "error": "ImportError: y"}
    sel = doctor.collect_selection(r, {"IPC_DPSAMPLE_BACKEND": "bogus"})
    assert (
        sel["requested"] == "auto" and "invalid" in sel["note"] and "ImportError: y" in sel["note"]
    )
    assert doctor.collect_selection(_cpu_report(), {})["backend"] == "torch"
    sel = doctor.collect_selection(_cpu_report(), {"IPC_DPSAMPLE_BACKEND": "onesided"})
    assert sel["backend"] is None and "cannot run" in sel["reason"]


def test_plan_selftests_per_machine() -> None:
    assert [t.name for t in doctor.plan_selftests(CPU_BOX)] == ["torch-cpu-gloo"]
    tests = {t.name: t for t in doctor.plan_selftests(ONE_GPU_NO_ONESIDED)}
    assert list(tests) == ["torch-cpu-gloo", "onesided-threads", "nccl-tp1", "torch-cuda"]
    assert tests["onesided-threads"].plan is None and "no kernels" in tests["onesided-threads"].skip
    assert tests["torch-cuda"].ranks == 1
    tests = {t.name: t for t in doctor.plan_selftests(EIGHT_GPUS)}
    assert tests["auto-all-gpus"].ranks == 8 and tests["onesided-threads"].plan is not None
    skipped = doctor.run_selftest(doctor.plan_selftests(ONE_GPU_NO_ONESIDED)[1])
    assert (
        skipped["status"] == "skipped"
        and doctor.validate(skipped, doctor.SCHEMA["properties"]["selftests"]["items"]) == []
    )


def test_ipc_pair_check_between_two_processes() -> None:
    """Two spawned processes on GPU 0: a real verified write/read-back where CuPy
    drives a GPU, else a failure that names the GPU and the step on both sides."""
    from ipc_dpsample.identity import cupy_device_count

    (pair,) = doctor.verify_ipc_pairs(1, nbytes=1 << 16, timeout_s=60)
    assert (pair["a"], pair["b"]) == (0, 0) and pair["seconds"] >= 0
    assert (
        doctor.validate(pair, doctor.SCHEMA["properties"]["p2p"]["properties"]["pairs"]["items"])
        == []
    )
    if cupy_device_count() > 0:
        assert pair["verified"], pair["detail"]
    else:
        assert not pair["verified"]
        try:
            import cupy  # noqa: F401

            step = "GPU 0 at cudaSetDevice"  # CuPy without a GPU
        except ImportError:
            step = "No module named 'cupy'"  # the [test] extra installs no CUDA package
        assert pair["detail"].count(step) == 2, pair["detail"]


def test_collect_without_gpus_is_well_formed() -> None:
    from ipc_dpsample.identity import cupy_device_count

    if cupy_device_count() > 0:
        pytest.skip("checks the no-GPU shapes of the report")
    assert doctor.driver_p2p_matrix(2) == [[None, None], [None, None]]
    p2p = doctor.collect_p2p(0)
    assert p2p["skipped"] and p2p["pairs"] == [] and p2p["driver"] == []
    topo = doctor.collect_topology([])
    assert doctor.validate(topo, doctor.SCHEMA["properties"]["topology"]) == []
    versions = doctor.collect_versions()
    assert versions["python"] and versions["numpy"] and versions["ipc_dpsample"]
    gpus = doctor.collect_gpus(CPU_BOX)
    assert (
        gpus["devices"] == [] and doctor.validate(gpus, doctor.SCHEMA["properties"]["gpus"]) == []
    )


def test_version_formatting() -> None:
    assert doctor.nccl_version_string(22805) == "2.28.5"
    assert doctor.nccl_version_string(2708) == "2.7.8"
    assert _cuda_version(12090) == "12.9"
    assert _cuda_version(13000) == "13.0"
    assert _cuda_version(0) is None


def test_human_output_puts_the_verdict_first() -> None:
    r = _gpu_report()
    r["p2p"]["pairs"][1].update(verified=False, detail="broken pair")
    r["p2p"]["verified"][0][1] = r["p2p"]["verified"][1][0] = False
    r["hazards"] = doctor.find_hazards(
        env={}, shm=64 << 30, gpus=r["gpus"], p2p=r["p2p"], backends=r["backends"]
    )
    text = doctor.format_human(_finish(r))
    first = text.splitlines()[0]
    assert first.startswith("ipc-dpsample doctor: UNHEALTHY") and "broken pair" in first
    assert "yes/NO" in text and "-/yes" in text
    assert "[error]" in text


# -- end to end -------------------------------------------------------------------------
def test_doctor_json_end_to_end() -> None:
    proc = _run_cli("doctor", "--json", timeout=240)
    report = json.loads(proc.stdout)
    assert doctor.validate(report) == [], doctor.validate(report)
    assert proc.returncode == (0 if report["verdict"]["ok"] else 1), proc.stderr[-2000:]
    if report["gpus"]["torch_count"] == 0 and report["gpus"]["cupy_count"] == 0:
        assert proc.returncode == 0, report["verdict"]["text"]
        assert report["verdict"]["level"] == "healthy-cpu"
        assert report["selection"]["backend"] == "torch"
        assert report["selftests"][0]["status"] == "passed"


def test_demo_end_to_end() -> None:
    t0 = time.monotonic()
    proc = _run_cli("demo", timeout=60)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert elapsed < 60
    out = proc.stdout
    assert "OK: every output matches the NumPy reference" in out
    for op in common.OPS:  # the three collectives, the argmax and the sampled verify
        assert op in out
    assert "argmax_batch_vocab" in common.OPS and "verify_batch_vocab" in common.OPS
    plan = demo.plan_demo(CPU_BOX)
    assert f"one with bs={plan.bs} real requests" in out
    # every op was also checked with bs < pad_bs
    for line in out.splitlines():
        if line.startswith(common.OPS):
            assert f"with bs={plan.bs})" in line and f" 0 with bs={plan.bs}" not in line, line
    assert "NO (" not in out


def test_doctor_strips_terminal_escapes_from_tool_output() -> None:
    """``nvidia-smi topo -m`` underlines its header with escape codes even into a pipe;
    the report holds plain text."""
    from ipc_dpsample.tools.doctor.collect import _run_text

    code = "print('\\x1b[4mGPU0\\tCPU Affinity\\x1b[0m'); print('GPU0\\t X ')"
    text = _run_text([sys.executable, "-c", code])
    assert text == "GPU0\tCPU Affinity\nGPU0\t X"


def test_doctor_reports_the_packages_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    from ipc_dpsample.tools.doctor.collect import collect_versions

    monkeypatch.setenv("GIT_COMMIT", "abc1234")
    versions = collect_versions()
    assert versions["ipc_dpsample_commit"] == "abc1234"
    assert list(versions) == list(doctor.VERSION_KEYS)

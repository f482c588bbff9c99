"""scripts/bench_verify_kernels.py: its command line and the records an owner receives
(CPU); the GPU run itself is a benchmark (its output is quoted in BENCHMARKS.md)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "bench_verify_kernels.py"
_spec = importlib.util.spec_from_file_location("bench_verify_kernels", _PATH)
assert _spec is not None and _spec.loader is not None
bvk = importlib.util.module_from_spec(_spec)
sys.modules["bench_verify_kernels"] = bvk
_spec.loader.exec_module(bvk)


def test_the_defaults_are_the_gated_bench_shape() -> None:
    ns = bvk.parse_args([])
    assert (ns.tp, ns.pad_bs, ns.num_tokens, ns.vocab) == (8, 8, 4, 152064)
    assert (ns.dtype, ns.mix, ns.cap) == ("fp32", "topk50", 128)


def test_the_environment_knobs_of_the_verify_kernels_apply(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("IPC_DPSAMPLE_VERIFY_UNROLL", raising=False)
    assert "-DDV_MAX_UNROLL=2" in bvk.verify_options()
    monkeypatch.setenv("IPC_DPSAMPLE_VERIFY_UNROLL", "1")
    monkeypatch.setenv("IPC_DPSAMPLE_VERIFY_LIST_UNROLL", "2")
    opts = bvk.verify_options()
    assert "-DDV_MAX_UNROLL=1" in opts and "-DDV_LIST_UNROLL=2" in opts
    assert all(o.startswith("-DDV_") for o in opts)  # the swap's knobs stay out


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--tp", "3"], "--pad-bs 8 must be a multiple of --tp 3"),
        (["--tp", "7", "--pad-bs", "7"], "--vocab 152064 must be a multiple of --tp 7"),
        (["--iters", "0"], "must be at least 1"),
        (["--reps", "0"], "--iters and --reps must be at least 1"),
        (["--cap", "129"], "--cap 129; expected 0 (the largest top-k) or 1 to 128"),
        (["--mix", "nucleus"], "invalid choice: 'nucleus'"),
        (["--phases", "-1"], "--phases -1; expected 0 (off) or the launches to sample"),
    ],
)
def test_a_bad_command_line_names_what_is_expected(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        bvk.parse_args(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_the_phase_table_spans_reached_marks_and_skips_the_others() -> None:
    # 3 runs; the combine's marks at PH_COMB: start, two phases reached, the third not
    # (0 in every run), the fourth reached: its time runs from the last reached mark
    samples = np.zeros((3, bvk.PH_ALL), np.uint64)
    base = bvk.PH_COMB
    for r, jitter in enumerate((0, 10, 20)):
        samples[r, base : base + 5] = [1000, 1100 + jitter, 1400, 0, 2400]
    names = ("first", "second", "third (not reached)", "fourth")
    got = bvk.phase_table(samples, base, names, 1_000_000.0)  # 1 GHz: a cycle is 1 ns
    lines = got.splitlines()
    assert [ln.split()[0] for ln in lines] == ["first", "second", "fourth", "total"]
    assert lines[0].split()[1] == "110"  # the median of 100, 110, 120
    assert lines[1].split()[1] == "290" and lines[2].split()[1] == "1000"
    assert "third" not in got
    assert lines[3].split()[-4:] == ["1400", "cycles", "1.40", "us"]


def test_an_owner_receives_every_sources_rows_of_its_requests() -> None:
    tp, pad_bs, n, words = 4, 8, 3, 5
    reqs = pad_bs // tp
    records = np.arange(tp * pad_bs * n * words, dtype=np.uint32).reshape(tp, pad_bs * n, words)
    for owner in range(tp):
        got = bvk.stack_owner(records, owner, reqs, n)
        assert got.shape == (tp, reqs * n, words) and got.flags.c_contiguous
        for s in range(tp):
            for r in range(reqs * n):
                assert np.array_equal(got[s, r], records[s, owner * reqs * n + r])


@pytest.mark.parametrize(("dtype", "stored"), [("fp32", np.float32), ("bf16", np.uint16)])
def test_the_shards_are_the_bench_logits_cut_by_rank(dtype: str, stored: type) -> None:
    from ipc_dpsample.arrays import normalize_dtype
    from ipc_dpsample.tools.common import _random_logits

    shards = bvk.make_shards(7, 6, 40, 4, dtype)
    full = _random_logits(np.random.default_rng(7), (6, 40), normalize_dtype(dtype))
    assert len(shards) == 4
    for s, shard in enumerate(shards):
        assert shard.dtype == stored and shard.shape == (6, 10) and shard.flags.c_contiguous
        assert np.array_equal(shard, full[:, s * 10 : (s + 1) * 10])
    assert len(np.unique(np.concatenate(shards, axis=1))) > 200  # random, not constant


def test_without_a_gpu_it_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
    except (ImportError, RuntimeError):
        assert bvk.main(["--iters", "1"]) == 2
        assert "needs CuPy and a CUDA GPU" in capsys.readouterr().err
    else:
        pytest.skip("a GPU is present: the script runs instead (scripts/bench_verify_kernels.py)")

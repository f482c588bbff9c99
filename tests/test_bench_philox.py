"""scripts/bench_philox.py on the CPU: its arguments, its NumPy checksum, and a clear exit
where there is no GPU (the timing itself runs on the device machine)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from ipc_dpsample.layout import philox4x32_10

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "bench_philox.py"
_spec = importlib.util.spec_from_file_location("bench_philox", _PATH)
assert _spec is not None and _spec.loader is not None
bp = importlib.util.module_from_spec(_spec)
sys.modules["bench_philox"] = bp
_spec.loader.exec_module(bp)


def test_reference_checksum_is_the_xor_of_word_zero() -> None:
    k0, k1 = 0x1234ABCD, 0x0F0F0F0F
    want = 0
    for i in range(300):
        want ^= int(philox4x32_10((i, 0, 0, 0), (k0, k1))[0])
    assert bp.reference_checksum(300, k0, k1) == want
    assert bp.reference_checksum(300, k0, k1 ^ 1) != want  # the key matters


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--fraction", "0"], "--fraction 0.0: expected a share in (0, 1]"),
        (["--fraction", "1.5"], "--fraction 1.5: expected a share in (0, 1]"),
        (["--words", "1000"], "--words >= 2**20"),
    ],
)
def test_bad_arguments_are_refused(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        bp.parse_args(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


def test_without_a_gpu_it_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        import cupy as cp

        cp.cuda.runtime.getDeviceCount()
        pytest.skip("a CUDA GPU is present: this test is for machines without one")
    except (ImportError, RuntimeError):
        pass
    assert bp.main(["--iters", "1"]) == 2
    assert "needs CuPy and a CUDA GPU" in capsys.readouterr().err


def test_defaults_are_the_gated_bench_shape() -> None:
    ns = bp.parse_args([])
    assert (ns.tp, ns.rows, ns.vocab) == (8, 1024, 152064)
    assert np.isclose(ns.fraction, 0.19)

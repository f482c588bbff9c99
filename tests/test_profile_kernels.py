"""scripts/profile_kernels.py: its table, and its refusals where it cannot run."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profile_kernels.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("profile_kernels", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_table_orders_kernels_by_total_time_with_median_and_spread() -> None:
    mod = _load()
    text = mod.table({"small": [5.0, 5.0], "dp_verify_finish": [1.0, 2.0, 3.0, 4.0, 100.0]})
    lines = text.splitlines()
    assert lines[0].split() == ["kernel", "calls", "median", "us", "p10", "p90", "total", "ms"]
    # 110 us in all before 10 us in all; median 3, p10 the smallest, p90 the largest of 5
    assert lines[1].split() == ["dp_verify_finish", "5", "3.00", "1.00", "100.00", "0.11"]
    assert lines[2].split() == ["small", "2", "5.00", "5.00", "5.00", "0.01"]


def test_needs_the_separator_and_a_cuda_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    mod = _load()
    assert mod.main(["bench", "--tp", "2"]) == 2
    assert "usage: profile_kernels.py" in capsys.readouterr().err
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: the refusal below is for machines without one")
    assert mod.main(["--", "bench", "--help"]) == 2
    assert "needs torch with a CUDA GPU" in capsys.readouterr().err

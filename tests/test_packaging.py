"""The wheel ships the CUDA sources inside the package, where a non-editable
install finds them (``ipc_dpsample.kernels``)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_contains_every_kernel_source_and_py_typed(tmp_path: Path) -> None:
    pytest.importorskip("setuptools", reason="needs setuptools to build the wheel")
    pytest.importorskip("wheel", reason="needs the wheel package to build the wheel")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("ipc_dpsample-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in (ROOT / "kernels").glob("*.cu"))
    assert sources, "no kernel sources in kernels/"
    for name in sources:
        packed = f"ipc_dpsample/kernels/{name}"
        assert packed in names, f"{packed} missing from {wheel.name}"
        assert zipfile.ZipFile(wheel).read(packed) == (ROOT / "kernels" / name).read_bytes()
    assert "ipc_dpsample/kernels/__init__.py" in names
    assert "ipc_dpsample/py.typed" in names

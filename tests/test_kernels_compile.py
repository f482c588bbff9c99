"""Every CUDA source in ``kernels/`` compiles with ``nvcc`` for sm_80 and sm_90 with all
warnings as errors (no GPU needed; skipped where nvcc is absent)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"
SOURCES = sorted(KERNEL_DIR.glob("*.cu"))
NVCC = shutil.which("nvcc")


# the one-sided kernels' compile-time knobs (IPC_DPSAMPLE_SWAP_UNROLL / _STREAMING, and
# the swap's per-CTA system-scope fence of onesided.cu's DP_SWAP_CTA_RELEASE_GPU=0)
KNOBS = {
    "default": [],
    "unroll8-streaming-ctafence": [
        "-DDP_SWAP_UNROLL=8",
        "-DDP_SWAP_STREAMING=1",
        "-DDP_SWAP_CTA_RELEASE_GPU=0",
    ],
}


@pytest.mark.parametrize("knobs", sorted(KNOBS))
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", SOURCES or [None], ids=lambda p: p.name if p else "none")
def test_kernel_compiles_without_warnings(
    source: Path | None, arch: str, knobs: str, tmp_path: Path
) -> None:
    if NVCC is None:
        pytest.skip("nvcc not found on PATH (install the CUDA toolkit to compile the kernels)")
    if source is None:
        pytest.skip(f"no kernels/*.cu in {KERNEL_DIR}")
    cmd = [
        NVCC,
        f"-arch={arch}",
        "-std=c++17",
        *KNOBS[knobs],
        "-Werror",
        "all-warnings",
        "-I",
        str(KERNEL_DIR),
        "-c",
        str(source),
        "-o",
        str(tmp_path / f"{source.stem}.{arch}.o"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / f"{source.stem}.{arch}.o").stat().st_size > 0

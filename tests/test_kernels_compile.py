"""Every CUDA source in ``kernels/`` compiles with ``nvcc`` for sm_80 and sm_90 with all
warnings as errors (no GPU needed; skipped where nvcc is absent)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from ipc_dpsample.envs import OnesidedTuning

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"
SOURCES = sorted(KERNEL_DIR.glob("*.cu"))
NVCC = shutil.which("nvcc")


# the one-sided kernels' compile-time knobs, as the environment sets them
# (IPC_DPSAMPLE_SWAP_UNROLL / _STREAMING / _CTA_FENCE, IPC_DPSAMPLE_ARGMAX_UNROLL)
KNOBS = {
    "default": list(OnesidedTuning(512, 32768, 2, 4, True, False, "barrier").compile_options),
    "unroll8-streaming-sysfence": list(
        OnesidedTuning(512, 32768, 2, 8, True, True, "barrier", 4, "sys").compile_options
    ),
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

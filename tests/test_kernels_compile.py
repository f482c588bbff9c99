"""Every CUDA source in ``kernels/`` compiles with ``nvcc`` for sm_80 and sm_90 with all
warnings as errors (no GPU needed; skipped where nvcc is absent). The device code only
(``-cubin``): the package builds these sources with NVRTC, which has no host pass; the
two architectures compile at once, as two processes."""

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


ARCHS = ("sm_80", "sm_90")


@pytest.mark.parametrize("knobs", sorted(KNOBS))
@pytest.mark.parametrize("source", SOURCES or [None], ids=lambda p: p.name if p else "none")
def test_kernel_compiles_without_warnings(source: Path | None, knobs: str, tmp_path: Path) -> None:
    if NVCC is None:
        pytest.skip("nvcc not found on PATH (install the CUDA toolkit to compile the kernels)")
    if source is None:
        pytest.skip(f"no kernels/*.cu in {KERNEL_DIR}")
    runs = []
    try:
        for arch in ARCHS:
            out = tmp_path / f"{source.stem}.{arch}.cubin"
            cmd = [NVCC, f"-arch={arch}", "-std=c++17", *KNOBS[knobs], "-Werror", "all-warnings",
                   "-I", str(KERNEL_DIR), "-cubin", str(source), "-o", str(out)]  # fmt: skip
            pipe = subprocess.PIPE
            runs.append((cmd, out, subprocess.Popen(cmd, stdout=pipe, stderr=pipe, text=True)))
        for cmd, out, proc in runs:
            stdout, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{stdout}\n{stderr}"
            assert out.stat().st_size > 0
    finally:
        for _, _, proc in runs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

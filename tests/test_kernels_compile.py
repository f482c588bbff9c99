"""Every CUDA source in ``kernels/`` compiles with ``nvcc`` for sm_90 and sm_80 with the
default compile-time knobs and for sm_90 with other knobs, all warnings as errors (no GPU
needed; skipped where nvcc is absent). The device code only (``-cubin`` or ``-ptx``): the
package builds these sources with NVRTC, which has no host pass; two compiles run at once."""

from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ipc_dpsample.envs import OnesidedTuning

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"
SOURCES = sorted(KERNEL_DIR.glob("*.cu"))
NVCC = shutil.which("nvcc")


# the one-sided kernels' compile-time knobs, as the environment sets them
# (IPC_DPSAMPLE_SWAP_UNROLL / _STREAMING / _CTA_FENCE, IPC_DPSAMPLE_ARGMAX_UNROLL,
# IPC_DPSAMPLE_VERIFY_PREFETCH_LINES, IPC_DPSAMPLE_VERIFY_TEMP_ONEPASS)
KNOBS = {
    "default": list(OnesidedTuning(512, 32768, 2, 4, True, False, "barrier").compile_options),
    "unroll8-streaming-sysfence-noprefetch-onepass2": list(
        OnesidedTuning(
            512,
            32768,
            2,
            8,
            True,
            True,
            "barrier",
            4,
            "sys",
            verify_prefetch_lines=0,
            verify_temp_onepass=2,
        ).compile_options
    ),
}


#: (architecture, knobs, output) of each compile of a source: ptxas (``-cubin``) for the
#: default knobs on sm_90, where its warnings (stack, spills it cannot place) would show;
#: the front end and NVVM (``-ptx``, 40 % of the time) for the other architecture and for
#: the other knobs, where the warnings that differ are the source's own. The other knobs
#: are not compiled for sm_80 too: the sm_80 code and the knobs' code each compile above.
JOBS = (
    ("sm_90", "default", "cubin"),
    ("sm_80", "default", "ptx"),
    ("sm_90", "unroll8-streaming-sysfence-noprefetch-onepass2", "ptx"),
)
PARALLEL = 2  # compiles at once (CI has 2 cores)


@pytest.mark.parametrize("source", SOURCES or [None], ids=lambda p: p.name if p else "none")
def test_kernel_compiles_without_warnings(source: Path | None, tmp_path: Path) -> None:
    if NVCC is None:
        pytest.skip("nvcc not found on PATH (install the CUDA toolkit to compile the kernels)")
    if source is None:
        pytest.skip(f"no kernels/*.cu in {KERNEL_DIR}")
    nvcc, src = NVCC, source

    def compile_one(job: tuple[str, str, str]) -> tuple[list[str], Path, int, str]:
        arch, knobs, kind = job
        out = tmp_path / f"{src.stem}.{arch}.{knobs}.{kind}"
        cmd = [nvcc, f"-arch={arch}", "-std=c++17", *KNOBS[knobs], "-Werror", "all-warnings",
               "-I", str(KERNEL_DIR), f"-{kind}", str(src), "-o", str(out)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        return cmd, out, proc.returncode, proc.stdout + proc.stderr

    with ThreadPoolExecutor(PARALLEL) as pool:  # the cubin (the longest) starts first
        results = list(pool.map(compile_one, JOBS))
    for cmd, out, rc, text in results:
        assert rc == 0, f"{' '.join(cmd)} failed:\n{text}"
        assert out.stat().st_size > 0

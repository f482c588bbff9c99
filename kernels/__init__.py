"""CUDA sources of ipc_dpsample, shipped inside the wheel as ``ipc_dpsample.kernels``.

The ``.cu`` files next to this module are compiled at run time with NVRTC (through
CuPy ``RawModule``) and at CI time with ``nvcc`` as a strictness check.
"""

from __future__ import annotations

from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent


def source_path(name: str) -> Path:
    """Return the path of the kernel source ``name`` (e.g. ``"onesided.cu"``)."""
    path = KERNEL_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"kernel source {name!r} not found in {KERNEL_DIR}")
    return path


def read_source(name: str) -> str:
    """Return the text of the kernel source ``name``."""
    return source_path(name).read_text()

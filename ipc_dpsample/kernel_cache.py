"""Compile the shipped CUDA sources with NVRTC (CuPy ``RawModule``), once per
(source, device, options), and hand out kernels.

Nothing is compiled at import time; the first op on a device pays the compile
(CuPy also caches the binary on disk across processes).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any


def kernel_dir() -> Path:
    """The folder of the kernel sources: the installed package data
    (``ipc_dpsample.kernels``) or, when running from a source tree without an
    install (``PYTHONPATH=$PWD``), the top-level ``kernels/`` folder."""
    try:
        from .kernels import KERNEL_DIR
    except ImportError:
        return Path(__file__).resolve().parent.parent / "kernels"
    return KERNEL_DIR


def read_source(name: str) -> str:
    """Text of the kernel source ``name`` (see :func:`kernel_dir`)."""
    path = kernel_dir() / name
    if not path.is_file():
        raise FileNotFoundError(f"kernel source {name!r} not found in {path.parent}")
    return path.read_text()


__all__ = ["get_kernel", "get_module", "kernel_dir", "read_source"]

_lock = threading.Lock()
_modules: dict[tuple[str, int, tuple[str, ...], tuple[str, ...]], Any] = {}


def get_module(
    source: str,
    device: int,
    options: tuple[str, ...] = (),
    name_expressions: tuple[str, ...] = (),
) -> Any:
    """The compiled ``cupy.RawModule`` of ``kernels/<source>`` for ``device``.

    Sources may ``#include`` the headers next to them (``-I`` points there);
    ``name_expressions`` instantiates templates (``"kernel<float>"``), fetched with
    ``module.get_function(expression)``.
    """
    from . import envs

    if envs.get("IPC_DPSAMPLE_LINEINFO"):
        options = (*options, "-lineinfo")
    key = (source, device, options, name_expressions)
    mod = _modules.get(key)
    if mod is not None:
        return mod
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            import cupy

            with cupy.cuda.Device(device):
                mod = cupy.RawModule(
                    code=read_source(source),
                    options=("--std=c++17", f"-I{kernel_dir()}", *options),
                    name_expressions=name_expressions or None,
                )
                mod.compile()
            _modules[key] = mod
    return mod


def get_kernel(
    source: str,
    name: str,
    device: int,
    options: tuple[str, ...] = (),
    name_expressions: tuple[str, ...] = (),
) -> Any:
    """The kernel ``name`` (an ``extern "C"`` name or one of ``name_expressions``) of
    ``kernels/<source>`` on ``device``."""
    return get_module(source, device, options, name_expressions).get_function(name)

"""Compile the shipped CUDA sources with NVRTC (CuPy ``RawModule``), once per
(source, device, options), and hand out kernels.

Nothing is compiled at import time; the first op on a device pays the compile
(CuPy also caches the binary on disk across processes).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any


def read_source(name: str) -> str:
    """Text of the kernel source ``name``: from the installed package data
    (``ipc_dpsample.kernels``) or, when running from a source tree without an
    install (``PYTHONPATH=$PWD``), from the top-level ``kernels/`` folder."""
    try:
        from .kernels import read_source as installed
    except ImportError:
        path = Path(__file__).resolve().parent.parent / "kernels" / name
        if not path.is_file():
            raise FileNotFoundError(
                f"kernel source {name!r} not found: ipc_dpsample.kernels is not installed and "
                f"{path} does not exist"
            ) from None
        return path.read_text()
    return installed(name)


__all__ = ["get_kernel", "get_module"]

_lock = threading.Lock()
_modules: dict[tuple[str, int, tuple[str, ...]], Any] = {}


def get_module(source: str, device: int, options: tuple[str, ...] = ()) -> Any:
    """The compiled ``cupy.RawModule`` of ``kernels/<source>`` for ``device``."""
    key = (source, device, options)
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
                    options=("--std=c++17", *options),
                )
                mod.compile()
            _modules[key] = mod
    return mod


def get_kernel(source: str, name: str, device: int, options: tuple[str, ...] = ()) -> Any:
    """The ``extern "C"`` kernel ``name`` of ``kernels/<source>`` on ``device``."""
    return get_module(source, device, options).get_function(name)

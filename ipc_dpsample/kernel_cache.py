"""Compile the shipped CUDA sources with NVRTC (CuPy ``RawModule``), once per
(source, device, options), and hand out kernels.

Nothing is compiled at import time; the first op on a device pays the compile
(CuPy also caches the binary on disk across processes).
"""

from __future__ import annotations

import threading
from typing import Any

from .kernels import read_source

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

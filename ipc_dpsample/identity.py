"""Host, boot and GPU identity of this process, and the facts backend choice needs.

``IPC_DPSAMPLE_HOST_ID`` overrides the host id: a documented test hook that lets
one machine simulate a group spread over several hosts.
"""

from __future__ import annotations

import os
import socket
from functools import lru_cache
from typing import Any

__all__ = [
    "boot_id",
    "check_device_usable",
    "cupy_device_count",
    "gpu_uuid",
    "host_id",
    "nccl_available",
    "p2p_digests",
    "resolve_device",
]


def host_id() -> str:
    """The host name, or ``IPC_DPSAMPLE_HOST_ID`` when set (test hook)."""
    return os.environ.get("IPC_DPSAMPLE_HOST_ID") or socket.gethostname()


@lru_cache(maxsize=1)
def boot_id() -> str:
    """The kernel's boot id (``/proc/sys/kernel/random/boot_id``), or "" if unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def cupy_device_count() -> int:
    """CUDA devices CuPy can drive; 0 when CuPy or a GPU/driver is missing (a
    ``CUDARuntimeError`` means no GPU, not a crash)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def gpu_uuid(device: int) -> str:
    """UUID of CUDA device ``device`` as ``GPU-xxxxxxxx-...``, or "" if unknown."""
    if device < 0:
        return ""
    try:
        import cupy

        raw = cupy.cuda.runtime.getDeviceProperties(device)["uuid"]
        h = bytes(raw).hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
    except Exception:
        return ""


def nccl_available() -> bool:
    """``cupy.cuda.nccl`` loads and has a working library."""
    try:
        from cupy.cuda import nccl

        return bool(getattr(nccl, "available", True)) and hasattr(nccl, "NcclCommunicator")
    except Exception:
        return False


def p2p_digests(device: int) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
    """``(visible, reach)``: digests (:func:`ipc_dpsample.config.gpu_digest`) of the GPUs
    this process sees, and of those ``device`` can access peer-to-peer (itself
    included). Empty when CuPy cannot query the GPUs (no GPU is not an error)."""
    from .config import gpu_digest

    if device < 0:
        return (), ()
    try:
        from cupy.cuda import runtime

        count = runtime.getDeviceCount()
        visible, reach = [], []
        for d in range(count):
            uuid = gpu_uuid(d)
            if not uuid:
                continue
            visible.append(gpu_digest(uuid))
            if d == device or runtime.deviceCanAccessPeer(device, d):
                reach.append(gpu_digest(uuid))
        return tuple(visible), tuple(reach)
    except Exception:
        return (), ()


def _cuda_device_count() -> int:
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.device_count())
    except Exception:
        pass
    return cupy_device_count()


def check_device_usable(device: int) -> None:
    if device < 0:
        return
    count = _cuda_device_count()
    if device >= count:
        raise ValueError(
            f"device=cuda:{device} but this process sees {count} CUDA device(s); use "
            f"device='cpu' or a CUDA ordinal < {count}"
            if count
            else f"device=cuda:{device} but no CUDA device is usable here (torch and CuPy "
            "see none); use device='cpu'"
        )


def resolve_device(device: Any) -> int:
    """CUDA ordinal, or -1 for the CPU."""
    if device is None:
        try:
            import torch

            if torch.cuda.is_available() and torch.cuda.device_count() > 0:
                return int(torch.cuda.current_device())
        except Exception:
            pass
        if cupy_device_count() > 0:
            import cupy

            return int(cupy.cuda.runtime.getDevice())
        return -1
    if isinstance(device, bool):
        raise TypeError(
            f"device={device!r}; expected None, 'cpu', 'cuda:k', an int or torch.device"
        )
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device={device} must be >= 0 (a CUDA ordinal) or 'cpu'")
        return device
    text = str(device)
    if text == "cpu":
        return -1
    if text == "cuda":
        return resolve_device(None) if cupy_device_count() > 0 else 0
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    raise ValueError(f"device={device!r}; expected None, 'cpu', 'cuda:k', an int or torch.device")

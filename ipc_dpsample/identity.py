"""Host, boot and GPU identity of this process, and the facts backend choice needs.

``IPC_DPSAMPLE_HOST_ID`` overrides the host id: a documented test hook that lets
one machine simulate a group spread over several hosts.
"""

from __future__ import annotations

import os
import socket
from functools import lru_cache

__all__ = ["boot_id", "cupy_device_count", "gpu_uuid", "host_id", "nccl_available"]


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

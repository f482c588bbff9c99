"""ipc_dpsample: move speculative-verify logits and results between tensor-parallel
GPUs faster than NCCL, without hanging or corrupting data.

Public API::

    from ipc_dpsample import (DpSamplingComm, DpSampleError, ConfigMismatchError,
                              PeerTimeoutError, BackendUnavailableError)
"""

from __future__ import annotations

__version__ = "0.1.0"

from .comm import DpSamplingComm
from .errors import (
    BackendUnavailableError,
    ConfigMismatchError,
    DpSampleError,
    PeerTimeoutError,
)
from .group import ThreadGroup

__all__ = [
    "BackendUnavailableError",
    "ConfigMismatchError",
    "DpSampleError",
    "DpSamplingComm",
    "PeerTimeoutError",
    "ThreadGroup",
    "__version__",
]

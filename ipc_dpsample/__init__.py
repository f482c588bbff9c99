"""ipc_dpsample: move speculative-verify logits and results between tensor-parallel
GPUs faster than NCCL, without hanging or corrupting data.

Public API::

    from ipc_dpsample import (DpSamplingComm, DpSampleError, ConfigMismatchError,
                              PeerTimeoutError, BackendUnavailableError,
                              DtypeMismatchError, ThreadGroup)
    from ipc_dpsample import swap_batch_vocab  # TokenSpeed's stateless fallback
"""

from __future__ import annotations

from ._version import __version__
from .comm import DpSamplingComm, DtypeMismatchError
from .compat import swap_batch_vocab
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
    "DtypeMismatchError",
    "PeerTimeoutError",
    "ThreadGroup",
    "__version__",
    "swap_batch_vocab",
]

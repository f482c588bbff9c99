"""The portable backend: torch.distributed collectives (gloo on CPU, NCCL on CUDA).

Modules: :mod:`.backend` (the ops and the wire format), :mod:`.plans` (per-shape
send/receive plans), :mod:`.argmax` (the argmax partials and their combine, shared
with :mod:`~ipc_dpsample.backends.fallback`), :mod:`.verify` (``verify_batch_vocab``:
the host rounds of :mod:`ipc_dpsample.verify_shards` and their parameter digests),
:mod:`.failure` (diagnosing a failed collective on every rank).
"""

from __future__ import annotations

from .backend import TorchBackend

__all__ = ["TorchBackend"]

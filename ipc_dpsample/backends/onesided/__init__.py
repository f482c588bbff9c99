"""The one-sided backend: CUDA IPC arena, device peer table, one kernel launch per op.

Modules: :mod:`.contract` (the host half of ``kernels/dp_common.cuh``: arena layout,
descriptor, signatures, error block), :mod:`.arena` (allocation, IPC export,
connect/verify, teardown), :mod:`.backend` (the ops as prepared launches).
"""

from __future__ import annotations

from .arena import Arena, Connection, connect, failed_peer, prepare_arena, teardown
from .backend import OnesidedBackend, SwapPlan, swap_block
from .contract import ArenaOffsets, DpDesc, DpErrorBlock, pack_signature, unpack_signature

__all__ = [
    "Arena",
    "ArenaOffsets",
    "Connection",
    "DpDesc",
    "DpErrorBlock",
    "OnesidedBackend",
    "SwapPlan",
    "connect",
    "failed_peer",
    "pack_signature",
    "prepare_arena",
    "swap_block",
    "teardown",
    "unpack_signature",
]

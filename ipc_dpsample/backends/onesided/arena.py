"""The one-sided backend's set-up: one arena per rank (a dedicated ``cudaMalloc``), its
IPC export, opening every peer's arena, the verified write/read-back, and teardown.

Construction is one rendezvous (see :mod:`ipc_dpsample.comm`): each rank prepares
its arena and IPC record *before* the first host all-gather, which carries them with
the configuration record. Then :func:`connect` needs two more all-gathers: the
open/probe status (which doubles as the barrier after every probe write) and the
read-back verdict.
"""

from __future__ import annotations

import ctypes
import os
import warnings
from collections.abc import Sequence
from typing import Any

from ...config import CommConfig, PeerRecord
from ...errors import DpSampleError
from ...group import HostGroup
from ...ipc import (
    IpcRecord,
    close_peer,
    injected_failure,
    open_peer,
    validate_peer_record,
)
from ...kernel_cache import get_kernel
from ...protocol import FixedRecord
from .contract import ERROR_BLOCK_SIZE, MAX_SIG_PAD_BS, ArenaOffsets

__all__ = ["Arena", "Connection", "connect", "prepare_arena", "teardown"]

SOURCE = "onesided.cu"
#: one CTA signals and waits for every peer with one thread each
MAX_TP = 512
_STATUS = FixedRecord(b"DPSTATUS", 1, [("code", "B"), ("reason", "159s")])


class Arena:
    """One rank's arena: a dedicated ``cudaMalloc`` (never pooled memory: an IPC
    handle of pooled memory names the pool's base), zeroed, plus a host-mapped
    error block.

    Parameters
    ----------
    layout : ArenaOffsets
    device : int
        CUDA ordinal (must be current).
    """

    def __init__(self, layout: ArenaOffsets, device: int):
        from cupy.cuda import runtime

        self.layout = layout
        self.device = device
        self.nbytes = layout.total_bytes
        self.ptr = 0
        self.err_host = 0
        self.ptr = int(runtime.malloc(self.nbytes))
        try:
            runtime.memset(self.ptr, 0, self.nbytes)
            self.err_host = int(runtime.hostAlloc(ERROR_BLOCK_SIZE, runtime.hostAllocMapped))
            ctypes.memset(self.err_host, 0, ERROR_BLOCK_SIZE)
            runtime.deviceSynchronize()
        except BaseException:
            self.free()
            raise

    def ipc_handle(self) -> bytes:
        """The 64-byte ``cudaIpcMemHandle_t`` of the arena."""
        from cupy.cuda import runtime

        return bytes(runtime.ipcGetMemHandle(self.ptr))

    def free(self) -> None:
        """Free the memory (call only after every peer closed its mapping)."""
        from cupy.cuda import runtime

        if self.err_host:
            runtime.freeHost(self.err_host)
            self.err_host = 0
        if self.ptr:
            runtime.free(self.ptr)
            self.ptr = 0


def layout_for(cfg: CommConfig) -> ArenaOffsets:
    """The arena layout of ``cfg`` (swap regions sized for 4-byte logits when the
    dtype is not fixed yet)."""
    itemsize = 2 if cfg.logits_dtype in ("bfloat16", "float16") else 4
    return ArenaOffsets(
        cfg.tp_size, cfg.max_pad_bs, cfg.num_tokens_per_req, cfg.vocab_size, itemsize
    )


def prepare_arena(
    cfg: CommConfig, device: int, me: PeerRecord, compile_options: tuple[str, ...]
) -> tuple[Arena | None, IpcRecord]:
    """Compile the kernels, allocate and export this rank's arena: the local half of
    set-up, done before the first all-gather. Never raises: a failure becomes a
    record with ``ok=False`` and the reason, which vetoes the fast path on every rank."""
    layout = layout_for(cfg)
    arena: Arena | None = None
    reason, handle = "", b""
    if cfg.tp_size > MAX_TP:
        reason = f"tp_size={cfg.tp_size} exceeds the kernels' {MAX_TP} signalling threads"
    elif cfg.max_pad_bs > MAX_SIG_PAD_BS:
        reason = f"max_pad_bs={cfg.max_pad_bs} exceeds the op signature's {MAX_SIG_PAD_BS}"
    else:
        try:
            import cupy

            with cupy.cuda.Device(device):
                get_kernel(SOURCE, "dp_swap_push", device, compile_options)  # before sharing
                arena = Arena(layout, device)
                handle = arena.ipc_handle()
        except Exception as exc:
            if arena is not None:
                arena.free()
                arena = None
            reason = f"arena setup failed: {type(exc).__name__}: {exc}"
    rec = IpcRecord(
        ok=arena is not None,
        rank=cfg.rank,
        handle=handle,
        offset=0,
        nbytes=layout.total_bytes,
        base_ptr=arena.ptr if arena is not None else 0,
        pid=os.getpid(),
        device=device,
        host_id=me.host_id,
        boot_id=me.boot_id,
        gpu_uuid=me.gpu_uuid,
        reason=reason,
    )
    return arena, rec


def probe_value(src: int, dst: int, pid: int) -> int:
    """The word rank ``src`` writes into rank ``dst``'s probe slot at init (never 0)."""
    return (0xD5 << 56) | ((src & 0xFFFF) << 40) | ((dst & 0xFFFF) << 24) | (pid & 0xFFFFFF)


def _agree(group: HostGroup, code: int, reason: str, what: str, timeout_s: float) -> str:
    """All-gather a status; the first failing rank's reason ("" when all succeeded)."""
    raw = group.all_gather_bytes(
        _STATUS.pack(code=code, reason=_STATUS.text(reason, 159)), timeout_s=timeout_s, what=what
    )
    for r, item in enumerate(raw):
        rec = _STATUS.unpack(item, f"status record of rank {r}")
        if rec["code"]:
            return f"rank {r}: {_STATUS.untext(rec['reason'])}"
    return ""


class Connection:
    """What :func:`connect` built: the opened peer bases and the device table."""

    def __init__(self, arena: Arena, opened: list[int], peer_recs: list[IpcRecord], table: Any):
        self.arena = arena
        self.opened = opened
        self.peer_recs = peer_recs
        self.table = table  # device uint64[tp], kept alive here


def failed_peer(ipc: Sequence[IpcRecord]) -> str:
    """The first rank whose arena could not be prepared ("" when every one was)."""
    bad = next((p for p in ipc if not p.ok), None)
    return "" if bad is None else f"rank {bad.rank}: {bad.reason}"


def connect(
    cfg: CommConfig,
    group: HostGroup,
    device: int,
    arena: Arena,
    records: Sequence[PeerRecord],
    ipc: Sequence[IpcRecord],
    timeout_s: float,
    compile_options: tuple[str, ...],
) -> tuple[Connection | None, str]:
    """Open every peer's arena, write a probe word into each through the mapping with
    a kernel, agree (all-gather 2: also the barrier after every write), read the
    words back, agree (all-gather 3). Collective; every rank returns the same
    verdict: ``(connection, "verified")`` or ``(None, reason)`` after tearing down.

    Raises
    ------
    DpSampleError
        A peer's IPC record contradicts its configuration record (raised on every
        rank: every rank validates the same records).
    """
    import cupy
    import numpy as np
    from cupy.cuda import runtime

    rank, tp, layout = cfg.rank, cfg.tp_size, arena.layout
    try:
        for src, prec in enumerate(ipc):
            validate_peer_record(prec, src, records[src], layout.total_bytes)
    except DpSampleError:
        arena.free()  # nobody opened anything yet: every rank raises here
        raise
    opened: list[int] = []
    table = None
    reason = ""
    with cupy.cuda.Device(device):
        try:
            for prec in ipc:
                opened.append(open_peer(prec, rank, device))
            table = cupy.asarray(np.asarray(opened, dtype=np.uint64))
            probe = get_kernel(SOURCE, "dp_probe_write", device, compile_options)
            for dst, base in enumerate(opened):
                value = probe_value(rank, dst, os.getpid())
                probe((1,), (32,), (base + layout.probe_off + 8 * rank, value))
            runtime.deviceSynchronize()
        except Exception as exc:
            reason = f"opening peer arenas failed: {type(exc).__name__}: {exc}"
        why = _agree(group, int(bool(reason)), reason, "IPC open and probe", timeout_s)
        if not why:
            got = np.empty(tp, dtype=np.uint64)
            runtime.memcpy(got.ctypes.data, arena.ptr + layout.probe_off, 8 * tp, 2)
            expect = [probe_value(src, rank, records[src].pid) for src in range(tp)]
            if injected_failure("verify", rank):
                expect[(rank + 1) % tp] ^= 1
            bad = [s for s in range(tp) if int(got[s]) != expect[s]]
            if bad:
                reason = (
                    f"write/read-back through CUDA IPC failed: probe words from ranks {bad} "
                    f"read {[hex(int(got[s])) for s in bad]}, expected "
                    f"{[hex(expect[s]) for s in bad]}"
                )
            why = _agree(group, int(bool(reason)), reason, "IPC verification", timeout_s)
    if why:
        teardown(group, arena, opened, list(ipc), timeout_s)
        return None, why
    return Connection(arena, opened, list(ipc), table), "verified"


def teardown(
    group: HostGroup,
    arena: Arena | None,
    opened: list[int],
    peer_recs: list[IpcRecord],
    timeout_s: float,
) -> None:
    """Barrier, close peer mappings, barrier, free (freeing while a peer still maps
    the arena is undefined behaviour). A barrier that times out (dead or stalled
    peer) is reported as a warning; the mappings are still closed, but the arena
    is then kept (leaked) rather than freed under a peer that may still write it."""
    device = arena.device if arena is not None else None
    try:
        from cupy.cuda import Device, runtime

        if device is not None:
            with Device(device):
                runtime.deviceSynchronize()
    except Exception:
        pass
    clean = True
    for what in ("teardown: before close", "teardown: after close"):
        try:
            group.barrier(timeout_s=timeout_s, what=what)
        except DpSampleError as exc:
            clean = False
            warnings.warn(f"ipc_dpsample: {exc}; continuing teardown", RuntimeWarning, stacklevel=3)
        if what.endswith("before close"):
            for ptr, prec in zip(opened, peer_recs, strict=False):
                try:
                    close_peer(ptr, prec)
                except Exception as exc:
                    warnings.warn(
                        f"ipc_dpsample: closing rank {prec.rank}'s mapping failed: {exc}",
                        RuntimeWarning,
                        stacklevel=3,
                    )
            opened.clear()
    if arena is not None:
        if clean:
            arena.free()
        else:
            warnings.warn(
                f"ipc_dpsample: keeping this rank's arena ({arena.nbytes} bytes) allocated: "
                "a peer missed the teardown barrier and may still write into it",
                RuntimeWarning,
                stacklevel=3,
            )

"""CUDA IPC: the fixed-size handle records ranks exchange, their validation, opening
and closing peers' arenas, and the driver's peer-to-peer facts.

A record received from a peer is untrusted: :func:`unpack_ipc_record` checks its
size, magic, version, status and codes, and :func:`validate_peer_record` checks it
against the peer's config record (same pid, host and boot id, the expected arena
size) before any memory is opened.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from .config import PeerRecord
from .errors import DpSampleError

__all__ = [
    "IPC_RECORD_SIZE",
    "IpcRecord",
    "close_peer",
    "injected_failure",
    "open_peer",
    "p2p_matrix_ok",
    "pack_ipc_record",
    "unpack_ipc_record",
    "validate_peer_record",
]

IPC_MAGIC = b"IPCDPH01"
IPC_VERSION = 1
# magic, version, status, rank, handle, offset, nbytes, base ptr, pid, device,
# host id, boot id, GPU UUID, reason
_FMT = "<8sHHi64sQQQqi64s40s40s160s"
IPC_RECORD_SIZE = struct.calcsize(_FMT)
ENV_FAIL = "IPC_DPSAMPLE_TEST_FAIL_IPC"


@dataclass(frozen=True)
class IpcRecord:
    """What a rank tells its peers about its arena.

    Attributes
    ----------
    ok : bool
        False when the rank failed before it could export (``reason`` says why).
    rank : int
    handle : bytes
        64-byte ``cudaIpcMemHandle_t``.
    offset, nbytes : int
        The arena starts ``offset`` bytes into the handle's allocation (always 0:
        the arena is its own ``cudaMalloc``) and spans ``nbytes``.
    base_ptr : int
        Raw device address (usable by peers in the same process only).
    pid, device : int
    host_id, boot_id, gpu_uuid, reason : str
    """

    ok: bool
    rank: int
    handle: bytes
    offset: int
    nbytes: int
    base_ptr: int
    pid: int
    device: int
    host_id: str
    boot_id: str
    gpu_uuid: str
    reason: str = ""


def pack_ipc_record(rec: IpcRecord) -> bytes:
    """Fixed-size (:data:`IPC_RECORD_SIZE`) binary form of ``rec``."""
    if len(rec.handle) not in (0, 64):
        raise ValueError(f"IPC handle of {len(rec.handle)} bytes, expected 64")
    return struct.pack(
        _FMT,
        IPC_MAGIC,
        IPC_VERSION,
        1 if rec.ok else 0,
        rec.rank,
        rec.handle.ljust(64, b"\0"),
        rec.offset,
        rec.nbytes,
        rec.base_ptr,
        rec.pid,
        rec.device,
        rec.host_id.encode()[:64],
        rec.boot_id.encode()[:40],
        rec.gpu_uuid.encode()[:40],
        rec.reason.encode()[:160],
    )


def unpack_ipc_record(raw: bytes) -> IpcRecord:
    """Parse a peer's record.

    Raises
    ------
    DpSampleError
        Wrong size, magic, version or status code.
    """
    if len(raw) != IPC_RECORD_SIZE:
        raise DpSampleError(f"IPC record of {len(raw)} bytes, expected {IPC_RECORD_SIZE}")
    f = struct.unpack(_FMT, raw)
    if f[0] != IPC_MAGIC or f[1] != IPC_VERSION:
        raise DpSampleError(
            f"IPC record magic/version {f[0]!r}/{f[1]} != expected {IPC_MAGIC!r}/{IPC_VERSION}"
        )
    if f[2] not in (0, 1):
        raise DpSampleError(f"IPC record status {f[2]} not in (0, 1)")

    def dec(b: bytes) -> str:
        return b.rstrip(b"\0").decode(errors="replace")

    return IpcRecord(
        ok=f[2] == 1,
        rank=f[3],
        handle=f[4],
        offset=f[5],
        nbytes=f[6],
        base_ptr=f[7],
        pid=f[8],
        device=f[9],
        host_id=dec(f[10]),
        boot_id=dec(f[11]),
        gpu_uuid=dec(f[12]),
        reason=dec(f[13]),
    )


def validate_peer_record(rec: IpcRecord, src: int, cfg_rec: PeerRecord, nbytes: int) -> None:
    """Check a peer's IPC record against its config record before opening anything.

    Raises
    ------
    DpSampleError
        The record names another rank, process, host, boot or GPU than the peer's
        config record, or an arena of an unexpected size.
    """
    problems = []
    if rec.rank != src:
        problems.append(f"rank {rec.rank} != {src}")
    if rec.pid != cfg_rec.pid:
        problems.append(f"pid {rec.pid} != {cfg_rec.pid}")
    if rec.host_id != cfg_rec.host_id[:64] or rec.boot_id != cfg_rec.boot_id[:40]:
        problems.append(
            f"host/boot {rec.host_id}/{rec.boot_id} != {cfg_rec.host_id}/{cfg_rec.boot_id}"
        )
    if rec.gpu_uuid != cfg_rec.gpu_uuid[:40]:
        problems.append(f"GPU {rec.gpu_uuid} != {cfg_rec.gpu_uuid}")
    if rec.offset != 0 or rec.nbytes != nbytes:
        problems.append(f"arena offset/size {rec.offset}/{rec.nbytes} != 0/{nbytes}")
    if not rec.base_ptr:
        problems.append("null base pointer")
    if problems:
        raise DpSampleError(f"invalid IPC record from rank {src}: " + "; ".join(problems))


def injected_failure(stage: str, rank: int) -> bool:
    """Test hook: ``IPC_DPSAMPLE_TEST_FAIL_IPC=open:1,verify:2`` makes rank 1's handle
    open and rank 2's verification read-back fail."""
    spec = os.environ.get(ENV_FAIL, "")
    for item in spec.split(","):
        name, _, who = item.strip().partition(":")
        if name == stage and who.strip().isdigit() and int(who) == rank:
            return True
    return False


def open_peer(rec: IpcRecord, my_rank: int, my_device: int = -1) -> int:
    """Device address of a peer's arena in this process: the raw pointer for a
    same-process peer (IPC cannot open a handle in its own process), else the
    opened handle (lazy peer access)."""
    from cupy.cuda import runtime

    if injected_failure("open", my_rank):
        raise DpSampleError(f"injected IPC open failure on rank {my_rank} ({ENV_FAIL})")
    if rec.pid == os.getpid():
        # same process: the raw pointer, but a peer on another GPU needs peer access
        # enabled explicitly (IPC's lazy flag only covers opened handles)
        _enable_peer_access(my_device, rec.gpu_uuid)
        return rec.base_ptr
    return int(runtime.ipcOpenMemHandle(rec.handle, runtime.cudaIpcMemLazyEnablePeerAccess))


def _enable_peer_access(device: int, peer_uuid: str) -> None:
    """Enable access from ``device`` to the GPU ``peer_uuid`` (a no-op for the same
    GPU; "already enabled" is fine).

    Raises
    ------
    DpSampleError
        The peer GPU is not visible, or the driver says the pair cannot do P2P.
    """
    from cupy.cuda import runtime

    from .identity import gpu_uuid

    if device < 0 or peer_uuid == gpu_uuid(device):
        return
    peer = next((d for d in range(runtime.getDeviceCount()) if gpu_uuid(d) == peer_uuid), None)
    if peer is None:
        raise DpSampleError(f"peer GPU {peer_uuid} is not visible to this process")
    if not runtime.deviceCanAccessPeer(device, peer):
        raise DpSampleError(f"GPU {device} cannot access GPU {peer} peer-to-peer")
    prev = runtime.getDevice()
    try:
        runtime.setDevice(device)
        try:
            runtime.deviceEnablePeerAccess(peer)
        except runtime.CUDARuntimeError as exc:
            if "PeerAccessAlreadyEnabled" not in str(exc):
                raise
    finally:
        runtime.setDevice(prev)


def close_peer(ptr: int, rec: IpcRecord) -> None:
    """Undo :func:`open_peer`."""
    from cupy.cuda import runtime

    if rec.pid != os.getpid() and ptr:
        runtime.ipcCloseMemHandle(ptr)


def p2p_matrix_ok(device: int, peer_uuids: list[str]) -> bool | None:
    """True when this rank's GPU can reach every peer's GPU peer-to-peer (or it is
    the same GPU), False when the driver says a pair cannot, None when a peer's GPU
    is not visible to this process (the IPC check then decides)."""
    from .identity import gpu_uuid

    try:
        from cupy.cuda import runtime

        count = runtime.getDeviceCount()
    except Exception:
        return None
    by_uuid = {gpu_uuid(d): d for d in range(count)}
    mine = gpu_uuid(device)
    unknown = False
    for uuid in peer_uuids:
        if uuid == mine:
            continue
        other = by_uuid.get(uuid)
        if other is None:
            unknown = True
            continue
        if not runtime.deviceCanAccessPeer(device, other):
            return False
    return None if unknown else True

"""An in-process NCCL for ranks that are threads of one process: send/recv matched
per peer in order (receives completed at ``groupEnd``) and ``allGather``; every call
logged as ``(what, peer, nbytes)``."""

from __future__ import annotations

import ctypes
import threading
from typing import ClassVar

# low bytes (0..126) then high bytes (129..255): both halves of the C char range
UID = bytes((i * 2 + (i >= 64)) % 256 for i in range(128))


class Fabric:
    """What NCCL would move between ranks, for ranks that are threads."""

    SIZES: ClassVar[dict[int, int]] = {1: 1, 2: 4}  # NCCL_UINT8, NCCL_INT32

    def __init__(self, tp: int):
        self.tp = tp
        self.cond = threading.Condition()
        self.queues: dict[tuple[int, int], list[bytes]] = {}
        self.gathers: dict[int, dict[int, bytes]] = {}

    def post(self, src: int, dst: int, data: bytes) -> None:
        with self.cond:
            self.queues.setdefault((src, dst), []).append(data)
            self.cond.notify_all()

    def take(self, src: int, dst: int) -> bytes:
        with self.cond:
            q = self.queues.setdefault((src, dst), [])
            assert self.cond.wait_for(lambda: q, timeout=30), f"no message {src}->{dst}"
            return q.pop(0)

    def all_gather(self, rank: int, seq: int, data: bytes) -> list[bytes]:
        with self.cond:
            slot = self.gathers.setdefault(seq, {})
            slot[rank] = data
            self.cond.notify_all()
            assert self.cond.wait_for(lambda: len(slot) == self.tp, timeout=30), "allGather"
            return [slot[r] for r in range(self.tp)]


class FabricComm:
    """One rank's ``NcclCommunicator`` over a :class:`Fabric`."""

    def __init__(self, fabric: Fabric, rank: int):
        self.fabric, self.rank = fabric, rank
        self.pending: list[tuple[int, int, int]] | None = None
        self.gathers = 0
        self.log: list[tuple[str, int, int]] = []

    def group_start(self) -> None:
        assert self.pending is None, "nested groupStart"
        self.pending = []

    def group_end(self) -> None:
        assert self.pending is not None, "groupEnd without groupStart"
        for ptr, nbytes, peer in self.pending:
            data = self.fabric.take(peer, self.rank)
            # real NCCL would hang (or worse) on a size mismatch; the stand-in fails loudly
            assert len(data) == nbytes, f"rank {self.rank}: {len(data)} bytes != {nbytes}"
            ctypes.memmove(ptr, data, nbytes)
        self.pending = None

    def send(self, ptr: int, count: int, dtype: int, peer: int, stream: int) -> None:
        assert self.pending is not None, "send outside a group"
        assert count > 0, "zero-byte send"
        nbytes = count * Fabric.SIZES[dtype]
        self.fabric.post(self.rank, peer, ctypes.string_at(ptr, nbytes))
        self.log.append(("send", peer, nbytes))

    def recv(self, ptr: int, count: int, dtype: int, peer: int, stream: int) -> None:
        assert self.pending is not None, "recv outside a group"
        assert count > 0, "zero-byte recv"
        self.pending.append((ptr, count * Fabric.SIZES[dtype], peer))
        self.log.append(("recv", peer, count * Fabric.SIZES[dtype]))

    def allGather(self, send: int, recv: int, count: int, dtype: int, stream: int) -> None:
        nbytes = count * Fabric.SIZES[dtype]
        parts = self.fabric.all_gather(self.rank, self.gathers, ctypes.string_at(send, nbytes))
        self.gathers += 1
        for r, part in enumerate(parts):
            ctypes.memmove(recv + r * nbytes, part, nbytes)
        self.log.append(("allGather", -1, nbytes))

    def check_async_error(self) -> None:
        pass

    def destroy(self) -> None:
        self.log.append(("destroy", -1, 0))

    def abort(self) -> None:
        self.log.append(("abort", -1, 0))


class FakeNccl:
    """``cupy.cuda.nccl`` as the backend uses it."""

    NCCL_UINT8, NCCL_INT32 = 1, 2

    class NcclError(RuntimeError):
        pass

    def __init__(self) -> None:
        self.comm: FabricComm | None = None

    def get_unique_id(self) -> bytes:
        return UID

    def groupStart(self) -> None:
        assert self.comm is not None
        self.comm.group_start()

    def groupEnd(self) -> None:
        assert self.comm is not None
        self.comm.group_end()


class LoggingComm:
    """A communicator that only logs ``abort``/``destroy`` (set-up error paths)."""

    def __init__(self, log: list[str], rank: int):
        self.log, self.rank = log, rank

    def abort(self) -> None:
        self.log.append(f"abort {self.rank}")

    def destroy(self) -> None:
        self.log.append(f"destroy {self.rank}")

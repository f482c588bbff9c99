"""Host-side groups: who the ranks are and how they exchange small binary records.

A :class:`HostGroup` gives ``rank``, ``size``, ``all_gather_bytes`` and ``barrier``
(every wait bounded). Implementations:

* :class:`TorchStoreGroup` over torch.distributed: records travel through the
  process group's key-value store, so NCCL-only groups need no extra gloo group
  and a missing peer raises within the timeout instead of hanging.
* :class:`ThreadGroup`: several ranks as threads of one process (one GPU, one
  stream each): tests, benchmarks and the single-GPU demo.

Collectives pair by ``(sequence number, what)``: the ``k``-th all-gather of every
rank must name the same step. When one rank's ``k``-th exchange is, say, "IPC
handle exchange" while another's is "config agreement", their set-up sequences
diverged; every rank raises :class:`~ipc_dpsample.errors.DpSampleError` naming
both steps instead of reading the other step's records.
"""

from __future__ import annotations

import datetime
import itertools
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from .errors import DpSampleError

__all__ = ["HostGroup", "ThreadGroup", "TorchStoreGroup", "resolve_group"]


@runtime_checkable
class HostGroup(Protocol):
    """What a communicator needs from its host-side group."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def same_process(self) -> bool:
        """True when every rank lives in this process (peers share raw pointers)."""
        ...

    def all_gather_bytes(self, data: bytes, *, timeout_s: float, what: str) -> list[bytes]:
        """Every rank's ``data``, indexed by rank."""
        ...

    def barrier(self, *, timeout_s: float, what: str) -> None: ...


_WHAT_LEN = struct.Struct("<H")


def _tag(what: str, data: bytes) -> bytes:
    """``what`` (length-prefixed UTF-8) in front of ``data``."""
    raw = what.encode(errors="replace")
    return _WHAT_LEN.pack(len(raw)) + raw + data


def _untag(record: bytes) -> tuple[str, bytes]:
    """Inverse of :func:`_tag`."""
    (n,) = _WHAT_LEN.unpack_from(record)
    end = _WHAT_LEN.size + n
    return record[_WHAT_LEN.size : end].decode(errors="replace"), record[end:]


def _check_steps(rank: int, seq: int, what: str, steps: Sequence[str], kind: str) -> None:
    """Raise when a peer's ``seq``-th exchange names another step than ``what``."""
    for peer, theirs in enumerate(steps):
        if theirs != what:
            raise DpSampleError(
                f"rank {rank}: host exchange #{seq} of the {kind} is '{what}' here but "
                f"'{theirs}' on rank {peer}: the ranks' set-up sequences diverged (one rank "
                "skipped or added a step); every rank of the group raises this error"
            )


_seq_lock = threading.Lock()
_group_seq: dict[tuple[int, ...], itertools.count] = {}


class TorchStoreGroup:
    """A torch.distributed group whose records travel through the c10d store.

    Parameters
    ----------
    ranks : tuple of int or None
        Global ranks of the members, or None for the whole world.
    process_group : torch.distributed.ProcessGroup or None
        The group collectives run on (for the torch backend); None to create one
        lazily from ``ranks`` when needed.
    """

    def __init__(self, ranks: tuple[int, ...] | None = None, process_group: Any = None):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise DpSampleError(
                "torch.distributed is not initialised; call "
                "ipc_dpsample.launch.init_distributed() (torchrun / mpirun / plain python) "
                "or pass a ThreadGroup"
            )
        world_rank = dist.get_rank()
        if ranks is None:
            ranks = tuple(range(dist.get_world_size()))
        self.global_ranks: tuple[int, ...] = tuple(int(r) for r in ranks)
        if world_rank not in self.global_ranks:
            raise ValueError(f"this process (global rank {world_rank}) is not in group {ranks}")
        self._rank = self.global_ranks.index(world_rank)
        self._pg = process_group
        self._member_pgs: dict[str, Any] = {}
        self._store = dist.distributed_c10d._get_default_store()
        with _seq_lock:
            counter = _group_seq.setdefault(self.global_ranks, itertools.count())
            instance = next(counter)
        key = (
            "-".join(map(str, self.global_ranks))
            if len(self.global_ranks) <= 16
            else (f"{len(self.global_ranks)}x{hash(self.global_ranks) & 0xFFFFFFFF:08x}")
        )
        self._prefix = f"ipc_dpsample/{key}/{instance}"
        self._op = itertools.count()
        self._dedicated = itertools.count()

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return len(self.global_ranks)

    @property
    def same_process(self) -> bool:
        return self.size == 1

    @property
    def process_group(self) -> Any:
        """The caller's ProcessGroup, or the world's when the group is the world;
        None for a tuple subgroup (use :meth:`members_process_group`)."""
        if self._pg is None:
            import torch.distributed as dist

            if self.global_ranks == tuple(range(dist.get_world_size())):
                self._pg = dist.group.WORLD
        return self._pg

    def members_process_group(self, device_type: str, timeout_s: float = 300.0) -> Any:
        """A process group of the members only, built directly on a prefix of the
        store (no ``dist.new_group``: members-only creation of overlapping subgroups
        hangs in torch's gloo). Call its ``_allgather_base``/``alltoall_base``
        directly; it is not registered with torch.distributed."""
        pg = self._member_pgs.get(device_type)
        if pg is None:
            pg = self._make_pg(f"{self._prefix}/pg/{device_type}", device_type, timeout_s)
            self._member_pgs[device_type] = pg
        return pg

    def dedicated_process_group(
        self, device_type: str, timeout_s: float, transport: str | None = None
    ) -> tuple[Any, str]:
        """A new members-only process group whose every collective fails after
        ``timeout_s``, and a store key prefix of its own.

        Collective: every member calls it in the same order. Unlike
        :meth:`members_process_group` it is never shared, so a communicator can
        abort its group after a failure without breaking another's.

        Returns
        -------
        (process group, str)
            The group (``transport``: ``"gloo"`` or ``"nccl"``; None: gloo for
            ``"cpu"``, NCCL otherwise; call its ``alltoall_base`` directly) and the
            key prefix for :meth:`post` and :meth:`collect`.
        """
        index = next(self._dedicated)
        prefix = f"{self._prefix}/dedicated{index}"
        kind = transport or ("gloo" if device_type == "cpu" else "nccl")
        return self._make_pg(
            f"{prefix}/pg/{kind}", "cpu" if kind == "gloo" else device_type, timeout_s
        ), prefix

    def _make_pg(self, prefix: str, device_type: str, timeout_s: float) -> Any:
        import torch.distributed as dist

        store = dist.PrefixStore(prefix, self._store)
        timeout = datetime.timedelta(seconds=timeout_s)
        if device_type == "cpu":  # gloo (also for CUDA tensors of ranks sharing a GPU)
            return dist.ProcessGroupGloo(store, self._rank, self.size, timeout)
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, self._rank, self.size, opts)

    @property
    def store_host(self) -> int:
        """This group's rank of the process that hosts the c10d store (global rank
        0), or -1 when it is not a member."""
        return self.global_ranks.index(0) if 0 in self.global_ranks else -1

    def post(self, key: str, data: bytes) -> None:
        """Publish this rank's record ``data`` under ``key`` (no wait)."""
        self._store.set(f"{key}/{self._rank}", data)

    def collect(self, key: str, wait_s: float) -> list[bytes | None]:
        """Every rank's record under ``key``, waiting at most ``wait_s`` for them (0:
        no wait); None for ranks that did not post within that time.

        Raises
        ------
        Exception
            Whatever the c10d store raises when it is unreachable (its host, global
            rank 0, exited).
        """
        keys = [f"{key}/{r}" for r in range(self.size)]
        if wait_s > 0:
            self._poll(keys, wait_s)  # ranks that did not post are reported as None
        return [bytes(self._store.get(k)) if self._store.check([k]) else None for k in keys]

    def _poll(self, keys: list[str], wait_s: float) -> bool:
        """Wait at most ``wait_s`` until every key exists: True when they all did.

        Polls ``store.check`` (backing off from 0.2 ms to 5 ms) instead of calling
        ``store.wait(keys, timeout)``: a TCPStore wait that runs out logs two c10d
        ``socket.cpp ... waitForInput`` warnings through torch's C++ logging (fd 2,
        not Python's ``warnings``) next to this package's own error, and a peer
        timeout is exactly when a wait runs out. Only this group's own waits change:
        torch's logging stays as the user set it (no ``TORCH_CPP_LOG_LEVEL`` change,
        which would be process-wide and read once at start-up anyway). A ready key
        costs one check; a late one at most 5 ms more than a blocking wait.

        Raises
        ------
        Exception
            Whatever the c10d store raises when it is unreachable.
        """
        deadline = time.monotonic() + wait_s
        pause = 2e-4
        while not self._store.check(keys):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, 5e-3)
        return True

    def all_gather_bytes(self, data: bytes, *, timeout_s: float, what: str) -> list[bytes]:
        op = next(self._op)
        base = f"{self._prefix}/{op}"
        self._store.set(f"{base}/{self._rank}", _tag(what, data))
        keys = [f"{base}/{r}" for r in range(self.size)]
        try:
            joined = self._poll(keys, timeout_s)
            missing = [r for r, k in enumerate(keys) if not joined and not self._store.check([k])]
        except Exception as exc:  # the store's host (global rank 0) exited
            raise DpSampleError(
                f"rank {self._rank}: the c10d store of group {self.global_ranks} became "
                f"unreachable during '{what}' ({type(exc).__name__}: {str(exc)[:200]}): its "
                "host, global rank 0, most likely exited"
            ) from None
        if missing:
            raise DpSampleError(
                f"rank {self._rank}: ranks {missing} of group {self.global_ranks} did not "
                f"join '{what}' within {timeout_s:.1f} s"
            )
        steps, records = zip(*(_untag(bytes(self._store.get(k))) for k in keys), strict=True)
        _check_steps(self._rank, op, what, steps, f"group {self.global_ranks}")
        return list(records)

    def barrier(self, *, timeout_s: float, what: str) -> None:
        self.all_gather_bytes(b"", timeout_s=timeout_s, what=what)


class _ThreadShared:
    def __init__(self, size: int):
        self.size = size
        self.cond = threading.Condition()
        self.slots: dict[int, dict[int, bytes]] = {}
        self.readers: dict[int, int] = {}
        self.streams: dict[tuple[Any, int], int] = {}
        self.failed: dict[int, str] = {}  # rank -> why it left (see ThreadGroup.abort)


class ThreadGroup:
    """One rank of a group whose ranks are threads of this process.

    Create all ranks at once with :meth:`create` and hand ``groups[r]`` to the
    thread that plays rank ``r``. Peers use each other's raw device pointers.
    """

    def __init__(self, shared: _ThreadShared, rank: int):
        self._shared = shared
        self._rank = rank
        self._op = 0

    @classmethod
    def create(cls, size: int) -> list[ThreadGroup]:
        """``size`` connected ranks."""
        if size < 1:
            raise ValueError(f"group size {size} < 1")
        shared = _ThreadShared(size)
        return [cls(shared, r) for r in range(size)]

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._shared.size

    @property
    def same_process(self) -> bool:
        return True

    def all_gather_bytes(self, data: bytes, *, timeout_s: float, what: str) -> list[bytes]:
        sh = self._shared
        op = self._op
        self._op += 1
        with sh.cond:
            slot = sh.slots.setdefault(op, {})
            slot[self._rank] = _tag(what, data)
            sh.cond.notify_all()
            ok = sh.cond.wait_for(lambda: len(slot) >= sh.size or sh.failed, timeout=timeout_s)
            if len(slot) < sh.size and sh.failed:
                first = min(sh.failed)
                sh.slots.pop(op, None)
                raise DpSampleError(
                    f"rank {self._rank}: rank {first} of the thread group failed "
                    f"({sh.failed[first]}); '{what}' abandoned instead of waiting {timeout_s:.1f} s"
                )
            if not ok:
                missing = sorted(set(range(sh.size)) - {k for k in slot if k >= 0})
                raise DpSampleError(
                    f"rank {self._rank}: ranks {missing} of the thread group did not join "
                    f"'{what}' within {timeout_s:.1f} s"
                )
            steps, result = zip(*(_untag(slot[r]) for r in range(sh.size)), strict=True)
            readers = sh.readers.get(op, 0) + 1
            if readers == sh.size:  # last reader frees the slot
                del sh.slots[op]
                sh.readers.pop(op, None)
            else:
                sh.readers[op] = readers
        _check_steps(self._rank, op, what, steps, "thread group")
        return list(result)

    def barrier(self, *, timeout_s: float, what: str) -> None:
        self.all_gather_bytes(b"", timeout_s=timeout_s, what=what)

    def abort(self, reason: str) -> None:
        """Declare that this rank left the group (it failed): every collective of the
        group that is still waiting for it, now or later, raises
        :class:`~ipc_dpsample.errors.DpSampleError` naming this rank and ``reason``
        at once instead of waiting out its timeout. :func:`ipc_dpsample.testing.run_threads`
        calls it for a rank whose body raised."""
        sh = self._shared
        with sh.cond:
            sh.failed.setdefault(self._rank, reason)
            sh.cond.notify_all()

    def claim_stream(self, owner: Any, stream: int) -> None:
        """Record that this rank issues ``owner``'s ops on ``stream``.

        Raises
        ------
        DpSampleError
            Another rank of this group already issues ops on the same stream: two
            ranks' kernels on one stream serialise, and each waits for the other.
        """
        sh = self._shared
        with sh.cond:
            holder = sh.streams.setdefault((owner, stream), self._rank)
        if holder != self._rank:
            raise DpSampleError(
                f"rank {self._rank} issues ops on stream {stream:#x}, which rank {holder} of "
                "the same thread group already uses: in-process ranks need one stream each "
                "(e.g. torch.cuda.Stream() per thread; the legacy default stream is shared)"
            )


def resolve_group(group: Any) -> HostGroup:
    """Turn the ``group`` argument of :class:`~ipc_dpsample.DpSamplingComm` into a
    :class:`HostGroup`.

    ``None`` is the torch.distributed world; a ProcessGroup is used as is; a tuple
    (or list) of global ranks makes a subgroup; a HostGroup is used as is.
    """
    if isinstance(group, (ThreadGroup, TorchStoreGroup)):
        return group
    if group is None:
        return TorchStoreGroup(None)
    if isinstance(group, Sequence) and not isinstance(group, (str, bytes)):
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in group):
            raise TypeError(f"group={group!r}: a tuple of group ranks must hold ints only")
        ranks = tuple(int(r) for r in group)
        if len(set(ranks)) != len(ranks) or not ranks:
            raise ValueError(f"group ranks {ranks} must be distinct and non-empty")
        return TorchStoreGroup(ranks)
    if type(group).__module__.startswith("torch"):
        import torch.distributed as dist

        ranks = tuple(dist.get_process_group_ranks(group))
        return TorchStoreGroup(ranks, process_group=group)
    if isinstance(group, HostGroup):
        return group
    raise TypeError(
        f"unsupported group {group!r}; expected None, a torch ProcessGroup, a tuple of "
        "global ranks or a HostGroup (e.g. ipc_dpsample.ThreadGroup)"
    )

"""Validated communicator configuration and the fixed-size record ranks agree on.

At construction every rank packs its :class:`CommConfig` plus its identity (pid,
host id, boot id, GPU UUID) into one :data:`RECORD_SIZE`-byte record, the records
are all-gathered over the host group (no pickles), and :func:`check_agreement`
raises :class:`~ipc_dpsample.errors.ConfigMismatchError` on every rank if any
field differs.
"""

from __future__ import annotations

import hashlib
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .errors import ConfigMismatchError, DpSampleError
from .protocol import LOGITS_DTYPES, FixedRecord

__all__ = [
    "BACKENDS",
    "RECORD_SIZE",
    "BackendName",
    "CommConfig",
    "PeerRecord",
    "check_agreement",
    "gpu_digest",
    "pack_record",
    "unpack_record",
]

BackendName = Literal["onesided", "nccl", "torch"]
RequestedBackend = Literal["auto", "onesided", "nccl", "torch"]
BACKENDS: tuple[str, ...] = ("auto", "onesided", "nccl", "torch")
_DTYPE_CODES = {None: 0, "bfloat16": 1, "float16": 2, "float32": 3}
_DTYPE_NAMES = {v: k for k, v in _DTYPE_CODES.items()}


@dataclass(frozen=True)
class CommConfig:
    """The parameters of a :class:`~ipc_dpsample.DpSamplingComm`, validated.

    Raises
    ------
    ValueError
        On any inconsistent value; the message names the expected value.
    """

    tp_size: int
    rank: int
    max_pad_bs: int
    num_tokens_per_req: int
    vocab_size: int
    logits_dtype: str | None = None
    backend: RequestedBackend = "auto"
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("tp_size", "rank", "max_pad_bs", "num_tokens_per_req", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size={self.tp_size} must be >= 1")
        if not 0 <= self.rank < self.tp_size:
            raise ValueError(f"rank={self.rank} out of range: expected 0 <= rank < {self.tp_size}")
        if self.num_tokens_per_req < 1:
            raise ValueError(f"num_tokens_per_req={self.num_tokens_per_req} must be >= 1")
        if self.max_pad_bs < self.tp_size or self.max_pad_bs % self.tp_size:
            suggestion = max(1, -(-self.max_pad_bs // self.tp_size)) * self.tp_size
            raise ValueError(
                f"max_pad_bs={self.max_pad_bs} must be a positive multiple of "
                f"tp_size={self.tp_size} (e.g. {suggestion})"
            )
        if self.vocab_size < self.tp_size or self.vocab_size % self.tp_size:
            raise ValueError(
                f"vocab_size={self.vocab_size} must be a positive multiple of "
                f"tp_size={self.tp_size}: pad the communication vocab to "
                f"{max(1, -(-self.vocab_size // self.tp_size)) * self.tp_size}"
            )
        if self.logits_dtype is not None and self.logits_dtype not in LOGITS_DTYPES:
            raise ValueError(
                f"logits_dtype={self.logits_dtype!r}; expected one of {LOGITS_DTYPES} or None"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}; expected one of {BACKENDS}")
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            raise TypeError(f"timeout_s must be a number of seconds, got {type(t).__name__} {t!r}")
        if not (t > 0) or t == float("inf"):
            raise ValueError(f"timeout_s={float(t)} must be > 0 (a finite number of seconds)")
        object.__setattr__(self, "timeout_s", float(t))
        if self.max_pad_bs * self.num_tokens_per_req >= 2**31:
            raise ValueError(
                f"max_pad_bs * num_tokens_per_req = {self.max_pad_bs * self.num_tokens_per_req}"
                " must be < 2**31"
            )

    def validate_pad_bs(self, pad_bs: Any) -> int:
        """``pad_bs`` as an int; raise unless it is an integer (any
        ``numbers.Integral``) with ``0 < pad_bs <= max_pad_bs`` and
        ``pad_bs % tp_size == 0``."""
        if isinstance(pad_bs, bool) or not isinstance(pad_bs, numbers.Integral):
            raise TypeError(f"pad_bs must be an int, got {type(pad_bs).__name__} {pad_bs!r}")
        pad_bs = int(pad_bs)
        if pad_bs <= 0 or pad_bs > self.max_pad_bs:
            raise ValueError(
                f"pad_bs={pad_bs} out of range: expected 0 < pad_bs <= max_pad_bs={self.max_pad_bs}"
            )
        if pad_bs % self.tp_size:
            raise ValueError(f"pad_bs={pad_bs} is not a multiple of tp_size={self.tp_size}")
        return pad_bs


@dataclass(frozen=True)
class PeerRecord:
    """One rank's configuration, identity and local facts as the group saw it.

    ``cupy_gpu``, ``nccl``, ``nccl_p2p_disable`` and the GPU digests feed
    :func:`ipc_dpsample.select.combine`; ``visible``/``reach`` hold 8-byte digests
    (:func:`gpu_digest`) of the GPUs this rank sees and of those it can access
    peer-to-peer (its own included).
    """

    tp_size: int
    rank: int
    max_pad_bs: int
    num_tokens_per_req: int
    vocab_size: int
    logits_dtype: str | None
    backend: str
    device_kind: str  # "cpu" | "cuda"
    version: str
    pid: int
    host_id: str
    boot_id: str
    gpu_uuid: str
    error: str = ""
    graph_swap: str = "barrier"
    cupy_gpu: bool = False
    nccl: bool = False
    nccl_p2p_disable: bool = False
    visible: tuple[bytes, ...] = ()
    reach: tuple[bytes, ...] = ()


MAX_GPUS = 16
_RECORD = FixedRecord(
    b"IPCDPCF1",
    3,
    [
        ("tp_size", "i"),
        ("rank", "i"),
        ("max_pad_bs", "i"),
        ("num_tokens_per_req", "i"),
        ("vocab_size", "q"),
        ("dtype", "B"),
        ("backend", "B"),
        ("device_kind", "B"),
        ("graph_swap", "B"),
        ("flags", "B"),  # cupy_gpu | nccl << 1 | nccl_p2p_disable << 2
        ("n_visible", "B"),
        ("n_reach", "B"),
        ("version", "32s"),
        ("pid", "q"),
        ("host_id", "64s"),
        ("boot_id", "40s"),
        ("gpu_uuid", "40s"),
        ("visible", f"{8 * MAX_GPUS}s"),
        ("reach", f"{8 * MAX_GPUS}s"),
        ("error", "160s"),
    ],
)
RECORD_SIZE = _RECORD.size
_GRAPH_SWAPS = ("barrier", "copy")


def gpu_digest(uuid: str) -> bytes:
    """8-byte digest of a GPU UUID (how records name GPUs compactly)."""
    return hashlib.sha256(uuid.encode()).digest()[:8]


def pack_record(rec: PeerRecord) -> bytes:
    """The fixed-size binary form of ``rec`` (:data:`RECORD_SIZE` bytes)."""
    visible, reach = rec.visible[:MAX_GPUS], rec.reach[:MAX_GPUS]
    text = FixedRecord.text
    return _RECORD.pack(
        tp_size=rec.tp_size,
        rank=rec.rank,
        max_pad_bs=rec.max_pad_bs,
        num_tokens_per_req=rec.num_tokens_per_req,
        vocab_size=rec.vocab_size,
        dtype=_DTYPE_CODES[rec.logits_dtype],
        backend=BACKENDS.index(rec.backend),
        device_kind=0 if rec.device_kind == "cpu" else 1,
        graph_swap=_GRAPH_SWAPS.index(rec.graph_swap),
        flags=int(rec.cupy_gpu) | int(rec.nccl) << 1 | int(rec.nccl_p2p_disable) << 2,
        n_visible=len(visible),
        n_reach=len(reach),
        version=text(rec.version, 32),
        pid=rec.pid,
        host_id=text(rec.host_id, 64),
        boot_id=text(rec.boot_id, 40),
        gpu_uuid=text(rec.gpu_uuid, 40),
        visible=b"".join(visible),
        reach=b"".join(reach),
        error=text(rec.error, 160),
    )


def unpack_record(raw: bytes) -> PeerRecord:
    """Parse and validate a record received from a peer.

    Raises
    ------
    DpSampleError
        Wrong size, magic, version or an out-of-range code: the peer runs another
        library version or the record was corrupted.
    """
    f = _RECORD.unpack(raw, "config record")
    if (
        f["dtype"] not in _DTYPE_NAMES
        or f["backend"] >= len(BACKENDS)
        or f["device_kind"] > 1
        or f["graph_swap"] >= len(_GRAPH_SWAPS)
        or f["n_visible"] > MAX_GPUS
        or f["n_reach"] > MAX_GPUS
    ):
        raise DpSampleError(
            f"config record has invalid codes dtype={f['dtype']} backend={f['backend']} "
            f"device_kind={f['device_kind']} graph_swap={f['graph_swap']}"
        )
    tp, rank, max_pad_bs, n, vocab, pid = (
        f[k] for k in ("tp_size", "rank", "max_pad_bs", "num_tokens_per_req", "vocab_size", "pid")
    )
    error = FixedRecord.untext(f["error"])
    problems = []
    if tp < 1:
        problems.append(f"tp_size={tp} < 1")
    elif not 0 <= rank < tp:
        problems.append(f"rank={rank} not in [0, {tp})")
    if tp >= 1 and (max_pad_bs < tp or max_pad_bs % tp):
        problems.append(f"max_pad_bs={max_pad_bs} not a positive multiple of tp_size={tp}")
    if n < 1:
        problems.append(f"num_tokens_per_req={n} < 1")
    if tp >= 1 and (vocab < tp or vocab % tp):
        problems.append(f"vocab_size={vocab} not a positive multiple of tp_size={tp}")
    if pid <= 0:
        problems.append(f"pid={pid} <= 0")
    if problems and not error:
        raise DpSampleError("invalid config record from a peer: " + "; ".join(problems))

    def digests(blob: bytes, count: int) -> tuple[bytes, ...]:
        return tuple(blob[8 * i : 8 * i + 8] for i in range(count))

    untext = FixedRecord.untext
    return PeerRecord(
        tp_size=tp,
        rank=rank,
        max_pad_bs=max_pad_bs,
        num_tokens_per_req=n,
        vocab_size=vocab,
        logits_dtype=_DTYPE_NAMES[f["dtype"]],
        backend=BACKENDS[f["backend"]],
        device_kind="cpu" if f["device_kind"] == 0 else "cuda",
        version=untext(f["version"]),
        pid=pid,
        host_id=untext(f["host_id"]),
        boot_id=untext(f["boot_id"]),
        gpu_uuid=untext(f["gpu_uuid"]),
        error=error,
        graph_swap=_GRAPH_SWAPS[f["graph_swap"]],
        cupy_gpu=bool(f["flags"] & 1),
        nccl=bool(f["flags"] & 2),
        nccl_p2p_disable=bool(f["flags"] & 4),
        visible=digests(f["visible"], f["n_visible"]),
        reach=digests(f["reach"], f["n_reach"]),
    )


#: Fields every rank must agree on.
AGREED_FIELDS = (
    "tp_size",
    "max_pad_bs",
    "num_tokens_per_req",
    "vocab_size",
    "logits_dtype",
    "backend",
    "device_kind",
    "version",
    "graph_swap",
)


def check_agreement(records: Sequence[PeerRecord], my_rank: int) -> None:
    """Raise :class:`ConfigMismatchError` if the ranks' records differ in any agreed
    field or do not carry ranks ``0..tp-1`` in order.

    Every rank calls this on the same records, so every rank raises the same error.
    """
    fields: dict[str, dict[int, object]] = {}
    errors = {r: rec.error for r, rec in enumerate(records) if rec.error}
    if errors:
        fields["invalid_arguments"] = dict(errors)
    for name in AGREED_FIELDS:
        values = {r: getattr(rec, name) for r, rec in enumerate(records)}
        if len(set(values.values())) > 1:
            fields[name] = values
    ranks = {i: rec.rank for i, rec in enumerate(records)}
    if any(i != r for i, r in ranks.items() if i not in errors):
        fields["rank"] = ranks
    if fields:
        detail = "; ".join(
            f"{name}: " + ", ".join(f"rank {r}={v!r}" for r, v in vals.items())
            for name, vals in fields.items()
        )
        raise ConfigMismatchError(
            f"rank {my_rank}: ranks were constructed with different configurations ({detail})",
            fields,
        )

"""Validated communicator configuration and the fixed-size record ranks agree on.

At construction every rank packs its :class:`CommConfig` plus its identity (pid,
host id, boot id, GPU UUID) into one :data:`RECORD_SIZE`-byte record, the records
are all-gathered over the host group (no pickles), and :func:`check_agreement`
raises :class:`~ipc_dpsample.errors.ConfigMismatchError` on every rank if any
field differs.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from .arrays import LOGITS_DTYPES
from .errors import ConfigMismatchError, DpSampleError

__all__ = [
    "BACKENDS",
    "RECORD_SIZE",
    "BackendName",
    "CommConfig",
    "PeerRecord",
    "check_agreement",
    "pack_record",
    "unpack_record",
]

BackendName = Literal["onesided", "nccl", "torch"]
RequestedBackend = Literal["auto", "onesided", "nccl", "torch"]
BACKENDS: tuple[str, ...] = ("auto", "onesided", "nccl", "torch")
_DTYPE_CODES = {None: 0, "bfloat16": 1, "float16": 2, "float32": 3}
_DTYPE_NAMES = {v: k for k, v in _DTYPE_CODES.items()}

RECORD_MAGIC = b"IPCDPCF1"
RECORD_VERSION = 2
# magic, version, tp, rank, max_pad_bs, N, V, dtype, backend, device kind,
# package version, pid, host id, boot id, GPU UUID, error ("" when the arguments were valid)
_FMT = "<8sHiiiiqBBB32sq64s40s40s160s"
RECORD_SIZE = struct.calcsize(_FMT)


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

    def validate_pad_bs(self, pad_bs: int) -> None:
        """Raise ``ValueError`` unless ``0 < pad_bs <= max_pad_bs`` and
        ``pad_bs % tp_size == 0``."""
        if isinstance(pad_bs, bool) or not isinstance(pad_bs, int):
            raise TypeError(f"pad_bs must be an int, got {type(pad_bs).__name__} {pad_bs!r}")
        if pad_bs <= 0 or pad_bs > self.max_pad_bs:
            raise ValueError(
                f"pad_bs={pad_bs} out of range: expected 0 < pad_bs <= max_pad_bs={self.max_pad_bs}"
            )
        if pad_bs % self.tp_size:
            raise ValueError(f"pad_bs={pad_bs} is not a multiple of tp_size={self.tp_size}")


@dataclass(frozen=True)
class PeerRecord:
    """One rank's configuration and identity as the group saw it."""

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


def _enc(s: str, n: int) -> bytes:
    raw = s.encode()
    if len(raw) > n:
        # keep a readable prefix and a digest of the whole value, so two long values
        # that differ only at the end still differ
        digest = hashlib.sha256(raw).hexdigest().encode()
        raw = raw[: n - 17] + b"#" + digest[:16]
    return raw


def pack_record(rec: PeerRecord) -> bytes:
    """The fixed-size binary form of ``rec`` (:data:`RECORD_SIZE` bytes)."""
    return struct.pack(
        _FMT,
        RECORD_MAGIC,
        RECORD_VERSION,
        rec.tp_size,
        rec.rank,
        rec.max_pad_bs,
        rec.num_tokens_per_req,
        rec.vocab_size,
        _DTYPE_CODES[rec.logits_dtype],
        BACKENDS.index(rec.backend),
        0 if rec.device_kind == "cpu" else 1,
        _enc(rec.version, 32),
        rec.pid,
        _enc(rec.host_id, 64),
        _enc(rec.boot_id, 40),
        _enc(rec.gpu_uuid, 40),
        _enc(rec.error, 160),
    )


def unpack_record(raw: bytes) -> PeerRecord:
    """Parse and validate a record received from a peer.

    Raises
    ------
    DpSampleError
        Wrong size, magic, version or an out-of-range code: the peer runs another
        library version or the record was corrupted.
    """
    if len(raw) != RECORD_SIZE:
        raise DpSampleError(f"config record of {len(raw)} bytes, expected {RECORD_SIZE}")
    f = struct.unpack(_FMT, raw)
    if f[0] != RECORD_MAGIC or f[1] != RECORD_VERSION:
        raise DpSampleError(
            f"config record magic/version {f[0]!r}/{f[1]} != expected "
            f"{RECORD_MAGIC!r}/{RECORD_VERSION}: peers run different ipc_dpsample versions"
        )
    if f[7] not in _DTYPE_NAMES or f[8] >= len(BACKENDS) or f[9] > 1:
        raise DpSampleError(f"config record has invalid codes dtype={f[7]} backend={f[8]}")

    tp, rank, max_pad_bs, n, vocab, pid = f[2], f[3], f[4], f[5], f[6], f[11]
    error = f[15].rstrip(b"\0").decode(errors="replace")
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

    def dec(b: bytes) -> str:
        return b.rstrip(b"\0").decode(errors="replace")

    return PeerRecord(
        tp_size=f[2],
        rank=f[3],
        max_pad_bs=f[4],
        num_tokens_per_req=f[5],
        vocab_size=f[6],
        logits_dtype=_DTYPE_NAMES[f[7]],
        backend=BACKENDS[f[8]],
        device_kind="cpu" if f[9] == 0 else "cuda",
        version=dec(f[10]),
        pid=f[11],
        host_id=dec(f[12]),
        boot_id=dec(f[13]),
        gpu_uuid=dec(f[14]),
        error=error,
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

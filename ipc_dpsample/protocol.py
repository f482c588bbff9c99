"""The wire protocol, defined once: op and dtype codes, the decoded description of
one collective call, the one divergence message every backend raises, and the
fixed-size record helper every set-up exchange uses.

Every backend checks that the ranks made the same call (op, dtype, ``pad_bs``,
``N``, ``bs``, sequence number) and, when they did not, raises
:class:`~ipc_dpsample.errors.DpSampleError` with :func:`divergence_message`, so the
user reads the same words whichever backend ran.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

from .errors import DpSampleError

__all__ = [
    "LOGITS_DTYPES",
    "Call",
    "Dtype",
    "FixedRecord",
    "Op",
    "divergence_message",
]


class Op(enum.IntEnum):
    """Op codes, carried in every header, signature and error block."""

    SWAP = 1
    GATHER_OUTPUTS = 2
    GATHER_LOGPROBS = 3
    ARGMAX = 4
    VERIFY = 5

    @property
    def api_name(self) -> str:
        """The communicator method's name, e.g. ``"swap_batch_vocab"``."""
        return _OP_API[self]

    @classmethod
    def describe_code(cls, code: int) -> str:
        """``api_name`` of a code received from a peer (``"op 9"`` when unknown)."""
        try:
            return cls(code).api_name
        except ValueError:
            return f"op {code}"


_OP_API = {
    Op.SWAP: "swap_batch_vocab",
    Op.GATHER_OUTPUTS: "gather_verify_outputs",
    Op.GATHER_LOGPROBS: "gather_verify_logprobs",
    Op.ARGMAX: "argmax_batch_vocab",
    Op.VERIFY: "verify_batch_vocab",
}

#: Ops whose header carries the logits dtype (the others move int32).
_LOGITS_OPS = (Op.SWAP, Op.ARGMAX, Op.VERIFY)


class Dtype(enum.IntEnum):
    """Element types the library moves; the code travels in headers and records."""

    INT32 = 0
    BFLOAT16 = 1
    FLOAT16 = 2
    FLOAT32 = 3

    @property
    def itemsize(self) -> int:
        return 4 if self in (Dtype.INT32, Dtype.FLOAT32) else 2

    @property
    def canonical(self) -> str:
        """Canonical name: ``"int32"``, ``"bfloat16"``, ``"float16"``, ``"float32"``."""
        return self.name.lower()

    @classmethod
    def of(cls, name: str) -> Dtype:
        """The member for a canonical name.

        Raises
        ------
        ValueError
            ``name`` is not a canonical dtype name.
        """
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(
                f"dtype {name!r}; expected one of {[d.canonical for d in cls]}"
            ) from None

    @classmethod
    def describe_code(cls, code: int) -> str:
        try:
            return cls(code).canonical
        except ValueError:
            return f"dtype {code}"


#: Logits dtypes a swap moves, by canonical name.
LOGITS_DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32")


class Call(NamedTuple):
    """One rank's collective call, as the protocol sees it.

    Attributes
    ----------
    op : int
        :class:`Op` code.
    dtype : int
        :class:`Dtype` code of the moved data (logits dtype for swap/argmax,
        ``INT32`` for the gathers).
    pad_bs : int
    n : int
        ``num_tokens_per_req``; -1 when the carrier does not hold it.
    bs : int
        Real requests, or -1 for "every row" / not carried.
    seq : int
        Ops this communicator issued before this one; -1 when not carried.
    graph : bool
        A swap issued in CUDA-graph mode (fixed output behind an entry barrier).
    """

    op: int
    dtype: int
    pad_bs: int
    n: int = -1
    bs: int = -1
    seq: int = -1
    graph: bool = False

    def describe(self) -> str:
        """E.g. ``swap_batch_vocab(pad_bs=8, bs=5, N=4, bfloat16) #3``."""
        parts = [f"pad_bs={self.pad_bs}"]
        if self.bs >= 0:
            parts.append(f"bs={self.bs}")
        if self.n >= 0:
            parts.append(f"N={self.n}")
        if self.op in _LOGITS_OPS or self.dtype != Dtype.INT32:
            parts.append(Dtype.describe_code(self.dtype))
        text = f"{Op.describe_code(self.op)}({', '.join(parts)})"
        if self.graph:
            text += " in CUDA-graph mode"
        if self.seq >= 0:
            text += f" #{self.seq}"
        return text

    # the 4-word int32 header of the NCCL and torch backends
    def header(self) -> tuple[int, int, int, int]:
        """``[op | dtype << 8 | graph << 16, pad_bs, bs, seq]`` (``N`` is agreed at
        construction, so it does not travel per call)."""
        tag = int(self.op) | int(self.dtype) << 8 | int(self.graph) << 16
        return (tag, self.pad_bs, self.bs, self.seq & 0x7FFFFFFF)

    @classmethod
    def from_header(cls, words: Sequence[int], n: int = -1) -> Call:
        """Inverse of :meth:`header`."""
        tag, pad_bs, bs, seq = (int(w) for w in words[:4])
        return cls(tag & 0xFF, (tag >> 8) & 0xFF, pad_bs, n, bs, seq, bool((tag >> 16) & 1))


def divergence_message(
    rank: int,
    peer: int,
    mine: Call,
    theirs: Call,
    backend: str,
    differs: Sequence[str] = (),
) -> str:
    """The one message every backend raises when ranks' call sequences diverge.

    ``differs`` names the arguments that differed when the calls themselves agree
    (``verify_batch_vocab``'s per-request parameters, compared by digest), e.g.
    ``("temperature", "seed")``.
    """
    if differs:
        what = (
            f"rank {peer} called {theirs.describe()} with different "
            f"{', '.join(differs)} than rank {rank} passed to {mine.describe()}"
        )
    else:
        what = f"rank {peer} called {theirs.describe()} while rank {rank} called {mine.describe()}"
    return (
        f"{what} ({backend} backend, seen by rank {rank}): the ranks' call sequences diverged. "
        "Every rank must call the same ops in the same order with the same pad_bs, bs and "
        "dtype (verify_batch_vocab: also the same candidates, per-request parameters, "
        "vocab_limit and return_logprobs; and start capturing CUDA graphs at the same op). "
        "The outputs of that call are undefined and this communicator is now unusable: every "
        "later call raises this error; close it and build a new one"
    )


class FixedRecord:
    """A fixed-size binary record: magic, version, then named fields.

    Every set-up exchange (config agreement, IPC handles, status rounds, NCCL ids)
    uses one of these, so a peer running another library version or a corrupted
    record is caught the same way everywhere.

    Parameters
    ----------
    magic : bytes
        8 bytes identifying the record kind.
    version : int
    fields : sequence of (name, struct code)
        ``"s"`` codes (e.g. ``"64s"``) hold text or raw bytes; text is truncated
        with a digest suffix (:meth:`text`).
    """

    def __init__(self, magic: bytes, version: int, fields: Sequence[tuple[str, str]]):
        if len(magic) != 8:
            raise ValueError(f"record magic {magic!r} must be 8 bytes")
        self.magic = magic
        self.version = version
        self.names = tuple(name for name, _ in fields)
        self._codes = tuple(code for _, code in fields)
        self._struct = struct.Struct("<8sH" + "".join(self._codes))
        self.size = self._struct.size

    def offset_of(self, name: str) -> int:
        """Byte offset of field ``name`` in the record."""
        i = self.names.index(name)
        return struct.calcsize("<8sH" + "".join(self._codes[:i]))

    def pack(self, **values: Any) -> bytes:
        """The record of ``values`` (one per field; ``str`` values are UTF-8)."""
        missing = set(self.names) - set(values)
        if missing:
            raise ValueError(f"record fields missing: {sorted(missing)}")
        items = [v.encode() if isinstance(v, str) else v for v in (values[n] for n in self.names)]
        return self._struct.pack(self.magic, self.version, *items)

    def unpack(self, raw: bytes, what: str = "record") -> dict[str, Any]:
        """Fields of a record received from a peer (``bytes`` fields keep their
        trailing NULs; see :meth:`text`).

        Raises
        ------
        DpSampleError
            Wrong size, magic or version: the peer runs another library version or
            the record was corrupted.
        """
        if len(raw) != self.size:
            raise DpSampleError(
                f"{what} of {len(raw)} bytes, expected {self.size}: peers run different "
                "ipc_dpsample versions"
            )
        magic, version, *fields = self._struct.unpack(raw)
        if magic != self.magic or version != self.version:
            raise DpSampleError(
                f"{what} magic/version {magic!r}/{version} != expected "
                f"{self.magic!r}/{self.version}: peers run different ipc_dpsample versions"
            )
        return dict(zip(self.names, fields, strict=True))

    @staticmethod
    def text(value: str, n: int) -> bytes:
        """``value`` encoded into at most ``n`` bytes; a longer value keeps a readable
        prefix and a digest of the whole, so two long values that differ only at the
        end still differ."""
        raw = value.encode(errors="replace")
        if len(raw) > n:
            digest = hashlib.sha256(raw).hexdigest().encode()
            raw = raw[: n - 17] + b"#" + digest[:16]
        return raw

    @staticmethod
    def untext(raw: bytes) -> str:
        return raw.rstrip(b"\0").decode(errors="replace")

"""What the NCCL backend exchanges outside NCCL: the unique id in every form CuPy
takes, the set-up and init records (built on :class:`~ipc_dpsample.protocol.FixedRecord`)
and the host-mapped error block the kernels fill.

Pure functions of bytes and words: tested without a GPU.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from typing import Any, Literal

from ...errors import BackendUnavailableError, DpSampleError
from ...protocol import Call, FixedRecord, divergence_message

__all__ = [
    "ERROR_BYTES",
    "ERROR_WORDS",
    "ERR_MISMATCH",
    "ERR_PARAMS",
    "ERR_VALUE",
    "HDR_BYTES",
    "HDR_WORDS",
    "INIT_RECORD",
    "NCCL_UNIQUE_ID_BYTES",
    "SEQ_DIVERGED",
    "SETUP_RECORD",
    "UniqueIdForm",
    "format_error_block",
    "installed_unique_id_form",
    "normalize_unique_id",
    "pack_init_record",
    "pack_setup_record",
    "parse_init_records",
    "parse_setup_records",
    "unique_id_for_cupy",
    "unique_id_form",
]

NCCL_UNIQUE_ID_BYTES = 128
#: int32 words of one per-rank header, ``protocol.Call.header()``.
HDR_WORDS = 4
HDR_BYTES = 4 * HDR_WORDS
#: int32 words of the host-mapped error block (``struct ErrorBlock`` in nccl.cu):
#: code, op, rank, peer, mine[4], theirs[4], reserved[4].
ERROR_WORDS = 16
ERROR_BYTES = 4 * ERROR_WORDS
ERR_MISMATCH = 1
#: ``nccl_verify_finish``: the verify combine saw a record whose digest (the call's and
#: its request's parameters) or candidate differs from this rank's (``peer`` = that
#: record's source rank).
ERR_PARAMS = 2
#: ``nccl_verify_finish``: ``dp_verify_records`` refused a parameter value (``peer`` =
#: the request, ``reserved[0]`` = verify.cuh's ``DV_BAD_*`` code).
ERR_VALUE = 3
#: Flipped in a rank's ``seq`` by ``nccl_verify_finish`` when its combine saw other
#: arguments, so that every peer's next header check (the same call's gathers) differs.
SEQ_DIVERGED = 1 << 30
#: verify.cuh's ``DV_BAD_*`` codes: the argument and the values the kernels accept.
_REFUSED = {
    1: ("temperature", "a finite value >= 0"),
    2: ("top_k", "0..128 or >= vocab_limit"),
    3: ("top_p", "0 < top_p <= 1"),
    4: ("min_p", "0 <= min_p < 1"),
    5: ("top_p / min_p", "top-k on for that request"),
}
#: What ``verify_batch_vocab``'s records compare besides the header.
_VERIFY_ARGS = (
    "verify_batch_vocab arguments (candidates, temperature, top_k, top_p, min_p, seed, "
    "offset, vocab_limit or return_logprobs)"
)

UniqueIdForm = Literal["bytes", "tuple"]

_ERROR_TEXT = 256
_UUID_TEXT = 40


# -- NCCL unique id -------------------------------------------------------------------
def normalize_unique_id(uid: Any) -> bytes:
    """The NCCL unique id as exactly :data:`NCCL_UNIQUE_ID_BYTES` raw bytes.

    Parameters
    ----------
    uid : bytes, bytearray, memoryview, or tuple/list of int
        What ``cupy.cuda.nccl.get_unique_id()`` returned: ``bytes`` (CuPy 14) or a
        tuple of 128 C ``char`` values, ``-128..127`` (CuPy 13; ``0..255`` accepted).

    Raises
    ------
    TypeError
        ``uid`` is of another type, or holds a non-integer.
    ValueError
        Wrong length or a value outside ``-128..255``.
    """
    if isinstance(uid, (bytes, bytearray, memoryview)):
        raw = bytes(uid)
    elif isinstance(uid, (tuple, list)):
        values = []
        for i, v in enumerate(uid):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"NCCL unique id element {i} is {v!r}; expected an int")
            if not -128 <= v <= 255:
                raise ValueError(f"NCCL unique id element {i} = {v}; expected -128 <= value <= 255")
            values.append(v & 0xFF)
        raw = bytes(values)
    else:
        raise TypeError(
            f"NCCL unique id of type {type(uid).__name__}; expected bytes (CuPy >= 14) or a "
            "tuple of ints (CuPy 13)"
        )
    if len(raw) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(f"NCCL unique id has {len(raw)} bytes; expected {NCCL_UNIQUE_ID_BYTES}")
    return raw


def unique_id_form(doc: str, cupy_version: str) -> UniqueIdForm:
    """Which form ``NcclCommunicator`` takes, from its signature text or CuPy's version.

    Parameters
    ----------
    doc : str
        ``NcclCommunicator``'s docstrings (Cython embeds ``bytes commId`` or
        ``tuple commId``).
    cupy_version : str
        ``cupy.__version__``; used when ``doc`` says nothing (CuPy 14 took bytes).
    """
    if re.search(r"\bbytes\s+commId\b", doc):
        return "bytes"
    if re.search(r"\btuple\s+commId\b", doc):
        return "tuple"
    m = re.match(r"\s*(\d+)", cupy_version)
    return "bytes" if m is not None and int(m.group(1)) >= 14 else "tuple"


def unique_id_for_cupy(raw: bytes, form: UniqueIdForm | None = None) -> bytes | tuple[int, ...]:
    """Convert raw unique-id bytes to what ``NcclCommunicator`` accepts.

    Parameters
    ----------
    raw : bytes
        :data:`NCCL_UNIQUE_ID_BYTES` bytes (see :func:`normalize_unique_id`).
    form : {"bytes", "tuple"} or None
        None: the installed CuPy's form (:func:`installed_unique_id_form`).

    Returns
    -------
    bytes, or tuple of 128 ints in ``-128..127`` (C ``char`` as CuPy 13 reads it)
    """
    raw = normalize_unique_id(raw)
    if form is None:
        form = installed_unique_id_form()
    if form == "bytes":
        return raw
    if form == "tuple":
        return tuple(b - 256 if b > 127 else b for b in raw)
    raise ValueError(f"form={form!r}; expected 'bytes', 'tuple' or None")


def installed_unique_id_form() -> UniqueIdForm:
    """:func:`unique_id_form` of the installed CuPy."""
    import cupy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CuPy warns when libnccl is missing
        from cupy.cuda import nccl

    cls = getattr(nccl, "NcclCommunicator", None)  # absent when libnccl did not load
    doc = "" if cls is None else (cls.__doc__ or "") + (getattr(cls.__init__, "__doc__", "") or "")
    return unique_id_form(doc, cupy.__version__)


# -- set-up records -------------------------------------------------------------------
#: One rank's set-up result: ok flag, unique id (rank 0), GPU UUID, error text.
SETUP_RECORD = FixedRecord(
    b"DPNCCLS2",
    1,
    (
        ("ok", "B"),
        ("uid", f"{NCCL_UNIQUE_ID_BYTES}s"),
        ("uuid", f"{_UUID_TEXT}s"),
        ("error", f"{_ERROR_TEXT}s"),
    ),
)
#: One rank's ``ncclCommInitRank`` result: ok flag, error text.
INIT_RECORD = FixedRecord(b"DPNCCLI2", 1, (("ok", "B"), ("error", f"{_ERROR_TEXT}s")))


def _fallback_hint() -> str:
    return "use backend='torch' (torch.distributed) or backend='auto', or fix the cause"


def pack_setup_record(*, ok: bool, uid: Any, uuid: str, error: str = "") -> bytes:
    """One rank's set-up record (``SETUP_RECORD.size`` bytes).

    Parameters
    ----------
    ok : bool
        Local preparation (import, compile, allocation, unique id) succeeded.
    uid : bytes, tuple of int, or None
        Rank 0's NCCL unique id (None on other ranks or on failure).
    uuid : str
        This rank's GPU UUID (``"GPU-..."``) or "" when unknown.
    error : str
        Why preparation failed (at most 256 bytes travel; see ``FixedRecord.text``).
    """
    raw_uid = bytes(NCCL_UNIQUE_ID_BYTES) if uid is None else normalize_unique_id(uid)
    return SETUP_RECORD.pack(
        ok=1 if ok else 0,
        uid=raw_uid,
        uuid=FixedRecord.text(uuid, _UUID_TEXT),
        error=FixedRecord.text(error, _ERROR_TEXT),
    )


def parse_setup_records(records: Sequence[bytes], rank: int) -> bytes:
    """Check every rank's set-up record and return rank 0's unique id.

    Every rank calls this on the same records and so raises the same error.

    Parameters
    ----------
    records : sequence of bytes, one per rank
    rank : int
        The calling rank (named in every message).

    Raises
    ------
    BackendUnavailableError
        A rank failed to prepare (the message names every failing rank and its
        error), or two ranks share one GPU.
    DpSampleError
        A malformed record (a peer runs another ipc_dpsample version), or an
        all-zero unique id from rank 0.
    """
    parsed = [
        SETUP_RECORD.unpack(raw, f"rank {rank}: NCCL set-up record of rank {r}")
        for r, raw in enumerate(records)
    ]
    failed = [(r, FixedRecord.untext(p["error"])) for r, p in enumerate(parsed) if not p["ok"]]
    if failed:
        detail = "; ".join(f"rank {r}: {err or 'unknown error'}" for r, err in failed)
        raise BackendUnavailableError(
            f"rank {rank}: the NCCL backend could not start ({detail}); {_fallback_hint()}"
        )
    owners: dict[str, list[int]] = {}
    for r, p in enumerate(parsed):
        uuid = FixedRecord.untext(p["uuid"])
        if uuid:
            owners.setdefault(uuid, []).append(r)
    shared = {u: rs for u, rs in owners.items() if len(rs) > 1}
    if shared:
        detail = "; ".join(f"ranks {rs} all use {u}" for u, rs in shared.items())
        raise BackendUnavailableError(
            f"rank {rank}: NCCL needs one GPU per rank but {detail} (NCCL refuses this: "
            "'Duplicate GPU detected'); give every rank its own GPU, or use "
            "backend='onesided' (several ranks may share a GPU) or backend='torch'"
        )
    uid = bytes(parsed[0]["uid"])
    if uid == bytes(NCCL_UNIQUE_ID_BYTES):
        raise DpSampleError(
            f"rank {rank}: rank 0 sent an all-zero NCCL unique id (expected the "
            f"{NCCL_UNIQUE_ID_BYTES} bytes of ncclGetUniqueId)"
        )
    return uid


def pack_init_record(*, ok: bool, error: str = "") -> bytes:
    """One rank's ``ncclCommInitRank`` result (``INIT_RECORD.size`` bytes)."""
    return INIT_RECORD.pack(ok=1 if ok else 0, error=FixedRecord.text(error, _ERROR_TEXT))


def parse_init_records(records: Sequence[bytes], rank: int) -> None:
    """Raise :class:`BackendUnavailableError` on every rank if any rank failed to
    create its NCCL communicator (the message names each failing rank and error).

    Raises
    ------
    DpSampleError
        A malformed record (a peer runs another ipc_dpsample version).
    """
    failed = []
    for r, raw in enumerate(records):
        p = INIT_RECORD.unpack(raw, f"rank {rank}: NCCL init record of rank {r}")
        if not p["ok"]:
            failed.append((r, FixedRecord.untext(p["error"])))
    if failed:
        detail = "; ".join(f"rank {r}: {err or 'unknown error'}" for r, err in failed)
        raise BackendUnavailableError(
            f"rank {rank}: creating the NCCL communicator failed ({detail}); {_fallback_hint()}"
        )


# -- the error block the kernels fill ---------------------------------------------------
def format_error_block(words: Sequence[int], n: int = -1) -> str:
    """The error message for a host-mapped error block.

    Parameters
    ----------
    words : sequence of :data:`ERROR_WORDS` int
        ``[code, op, rank, peer, mine[4], theirs[4], reserved[4]]``; ``mine`` and
        ``theirs`` are ``protocol.Call.header()`` words.
    n : int
        ``num_tokens_per_req`` (agreed at construction; shown in the message).

    Returns
    -------
    str
        :func:`ipc_dpsample.protocol.divergence_message`: for a header mismatch
        (:data:`ERR_MISMATCH`; a peer header whose ``seq`` differs by exactly
        :data:`SEQ_DIVERGED` names the verify arguments that peer found different), or
        for :data:`ERR_PARAMS` (the verify records of rank ``peer`` carried other
        arguments); for :data:`ERR_VALUE` the refused verify parameter.
    """
    code, op, rank, peer = (int(w) for w in words[:4])
    if code not in (ERR_MISMATCH, ERR_PARAMS, ERR_VALUE):
        return (
            f"rank {rank}: NCCL backend error code {code} (expected {ERR_MISMATCH}, a header "
            f"mismatch, {ERR_PARAMS}, different verify_batch_vocab arguments, or {ERR_VALUE}, "
            f"a refused verify_batch_vocab value; op {op}, peer {peer})"
        )
    mine = Call.from_header(words[4:8], n)
    theirs = Call.from_header(words[8:12], n)
    if code == ERR_PARAMS:
        return divergence_message(rank, peer, mine, theirs, "nccl", (_VERIFY_ARGS,))
    if code == ERR_VALUE:
        arg, expected = _REFUSED.get(int(words[12]), (f"parameter code {words[12]}", "valid"))
        return (
            f"rank {rank}: the verify kernels refused {arg} of request {peer} in "
            f"{mine.describe()} (expected {expected}; the host had validated every value, so "
            "this is a bug of ipc_dpsample: please report it). That call's results are "
            "undefined and this communicator is unusable: close it and build a new one"
        )
    if mine._replace(seq=0) == theirs._replace(seq=0) and mine.seq ^ theirs.seq == SEQ_DIVERGED:
        # the peer's verify (the op before this one) saw records with other arguments
        common = divergence_message(rank, peer, mine, theirs, "nccl")
        tail = common[common.index(" (nccl backend, seen by rank") :]
        return (
            f"rank {peer} found records with different {_VERIFY_ARGS} in its "
            f"verify_batch_vocab call #{mine.seq - 1} (the op before {mine.describe()}) and "
            f"marked its headers{tail}"
        )
    return divergence_message(rank, peer, mine, theirs, "nccl")

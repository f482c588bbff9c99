"""The NCCL backend: ``cupy.cuda.nccl`` moves the bytes, one small kernel puts them in place.

The scale-out engine (DESIGN.md "Choosing a backend"): it runs wherever NCCL does,
across hosts included, one GPU per rank.

Set-up (collective, every wait bounded by the host group's timeout)
--------------------------------------------------------------------
1. Every rank imports ``cupy.cuda.nccl``, compiles ``kernels/nccl.cu`` (NVRTC) and
   allocates every persistent buffer; rank 0 also creates the NCCL unique id.
2. One fixed-size record per rank travels over the host group
   (:func:`pack_setup_record`): ok flag, unique id (rank 0), GPU UUID, error text.
   A failure on any rank, or two ranks on one GPU (NCCL refuses that: "Duplicate
   GPU detected"), makes **every** rank raise
   :class:`~ipc_dpsample.errors.BackendUnavailableError` naming the rank and cause,
   before anyone blocks in ``ncclCommInitRank``.
3. ``NcclCommunicator(tp, uid, rank)`` with the CuPy device set; the unique id is
   converted to what the installed CuPy accepts (:func:`unique_id_for_cupy`:
   CuPy 13 takes a tuple of 128 signed chars, CuPy 14 ``bytes``). A second record
   round reports every rank's init result, so one failing rank fails all.

Per call (no allocation, no host sync, no DLPack or torch op: CUDA-graph capturable)
------------------------------------------------------------------------------------
* ``swap_batch_vocab``: ``groupStart``; per peer ``p`` one 16-byte header send/recv
  and one data send/recv of ``R*N*V/tp*itemsize`` bytes (``ncclUint8``: every dtype
  moves bit-exactly; the rows ``p*R*N ...`` of the input are contiguous, so the
  sends read the caller's array directly); ``groupEnd``; then ONE permute kernel
  writes ``out[i, s*Vs:(s+1)*Vs] = staging[s, i, :]`` into the persistent output,
  taking this rank's own block straight from the input (no self send). The kernel
  moves bytes with the widest vector (16, 8, 4, 2 or 1 bytes) that divides the row
  size and every base address, so ``V/tp = 13`` in float16 (26-byte rows) works.
* gathers: a pack kernel writes ``[header | payload]`` into this rank's slot of a
  ``[tp, W]`` int32 buffer, one in-place ``allGather`` of ``W`` words, an unpack
  kernel writes the persistent outputs. ``W = 4 + max_pad_bs/tp * (2N + 1)`` for
  *both* gathers, independent of ``pad_bs``: a rank that passes another ``pad_bs``,
  or calls the other gather, still moves the same number of bytes, so NCCL
  completes and the headers expose the mismatch instead of NCCL hanging.

Mismatch detection
------------------
Every op carries one header per rank, ``[op | dtype << 8, pad_bs, N, seq]``, where
``seq`` counts the ops this communicator completed (kept in device memory and
advanced by the kernels, so graph replays need no host). The kernel that ends the
op compares every rank's header with its own and writes the first difference into
a host-mapped error block; every rank that took part sees the difference, so every
rank raises :class:`~ipc_dpsample.errors.DpSampleError` at its next call or
:meth:`NcclBackend.check` (sticky: the communicator must be closed). The outputs of
the mismatched call are wrong.

The swap's header choice: its data is sent straight from the caller's array, so
the header cannot ride in the same buffer. Options were (a) a separate header
``allGather`` before the data (one more NCCL launch per swap: the latency of a tiny
collective, estimated 10-20 us on NVLink) or (b) one more 16-byte send/recv per peer
*inside the same NCCL group* (no extra launch; one more small p2p step per peer,
estimated at a few microseconds, nothing at tp=1; to be confirmed by the bench on
a multi-GPU host). This backend uses (b): the headers come
from a device table of prebuilt swap headers (one per ``R``) whose ``seq`` column
the kernels keep current, so no kernel runs before the sends. What it catches: a
``logits_dtype`` that differs between ranks with the same element size (bfloat16
vs float16) and a ``pad_bs``/dtype pair that happens to give the same byte count.

Limits (NCCL's, not fixable without a host sync per call): transfers whose sizes
differ between ranks (a swap with another ``pad_bs`` or element size, a swap on one
rank and a gather on another, a dead peer) make NCCL wait forever; NCCL has no
timeout of its own. Use ``check()`` (``ncclCommGetAsyncError``) from a watchdog,
and prefer the one-sided backend within one host, whose waits are bounded.

One op at a time per communicator (DESIGN.md point 9): the staging and gather
buffers are shared by all ops, so an op issued on another stream while this
communicator's previous op is still in flight raises
:class:`~ipc_dpsample.errors.DpSampleError` naming both streams, before anything is
launched. After every op an event is recorded on its stream; only when the stream
differs from the previous op's is the event queried (``cudaEventQuery``, no sync),
so ops on one stream cost one event record each. While a stream is being captured
into a CUDA graph nothing is queried or recorded (the captured op does not run
then, and querying an event recorded under capture is illegal); the first op after
that is still checked against the last op that ran eagerly. Synchronise the
streams (or use one communicator per stream) to move ops between streams; NCCL
itself also requires every rank to issue its ops in one order.

Lifetime: :meth:`NcclBackend.close` waits (bounded) for every rank at a host
barrier, then destroys the communicator; if a peer is gone it aborts instead and
warns. Outputs are views of persistent buffers, valid until the next op of the
same kind; call :meth:`NcclBackend.prepare` (a device sync) before any graph capture.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..arrays import (
    ITEMSIZE,
    ArrayInfo,
    ArrayKind,
    StreamHandle,
    cupy_stream,
    describe,
    make_view,
    resolve_stream,
)
from ..config import CommConfig
from ..errors import BackendUnavailableError, DpSampleError
from ..group import HostGroup
from ..identity import gpu_uuid
from .base import Backend

__all__ = [
    "ERROR_WORDS",
    "NCCL_UNIQUE_ID_BYTES",
    "NcclBackend",
    "PermuteLaunch",
    "describe_header",
    "format_mismatch",
    "normalize_unique_id",
    "pack_init_record",
    "pack_setup_record",
    "packed_width",
    "parse_init_records",
    "parse_setup_records",
    "permute_launch",
    "swap_tag",
    "unique_id_for_cupy",
    "unique_id_form",
    "vector_width",
]

SOURCE = "nccl.cu"
NCCL_UNIQUE_ID_BYTES = 128
HDR_WORDS = 4
HDR_BYTES = 4 * HDR_WORDS
OP_SWAP, OP_GATHER_OUTPUTS, OP_GATHER_LOGPROBS = 1, 2, 3
OP_NAMES = {
    OP_SWAP: "swap_batch_vocab",
    OP_GATHER_OUTPUTS: "gather_verify_outputs",
    OP_GATHER_LOGPROBS: "gather_verify_logprobs",
}
DTYPE_CODES = {"bfloat16": 1, "float16": 2, "float32": 3}
_DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}

#: int32 words of the host-mapped error block (``struct ErrorBlock`` in nccl.cu):
#: code, op, rank, peer, mine[4], theirs[4], reserved[4].
ERROR_WORDS = 16
ERROR_BYTES = 4 * ERROR_WORDS
ERR_MISMATCH = 1

PERMUTE_KERNELS = {
    16: "nccl_permute_w16",
    8: "nccl_permute_w8",
    4: "nccl_permute_w4",
    2: "nccl_permute_w2",
    1: "nccl_permute_w1",
}
KERNEL_NAMES = (*PERMUTE_KERNELS.values(), "nccl_pack", "nccl_unpack")
_BLOCK = 256
_MAX_GRID = 65535
_SETUP_TIMEOUT_S = 60.0
_MAX_CACHED_STREAMS = 64

UniqueIdForm = Literal["bytes", "tuple"]


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
        None: the installed CuPy's form (:func:`unique_id_form`).

    Returns
    -------
    bytes, or tuple of 128 ints in ``-128..127`` (C ``char`` as CuPy 13 reads it)
    """
    raw = normalize_unique_id(raw)
    if form is None:
        form = _installed_unique_id_form()
    if form == "bytes":
        return raw
    if form == "tuple":
        return tuple(b - 256 if b > 127 else b for b in raw)
    raise ValueError(f"form={form!r}; expected 'bytes', 'tuple' or None")


def _installed_unique_id_form() -> UniqueIdForm:
    import cupy

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CuPy warns when libnccl is missing
        from cupy.cuda import nccl

    cls = getattr(nccl, "NcclCommunicator", None)  # absent when libnccl did not load
    doc = "" if cls is None else (cls.__doc__ or "") + (getattr(cls.__init__, "__doc__", "") or "")
    return unique_id_form(doc, cupy.__version__)


# -- set-up records -------------------------------------------------------------------
_SETUP_MAGIC = b"DPNCCLS1"
_SETUP_FMT = "<8sB128s40s256s"  # magic, ok, unique id (rank 0), GPU UUID, error text
SETUP_RECORD_SIZE = struct.calcsize(_SETUP_FMT)
_INIT_MAGIC = b"DPNCCLI1"
_INIT_FMT = "<8sB256s"  # magic, ok, error text
INIT_RECORD_SIZE = struct.calcsize(_INIT_FMT)


def _text(s: str, n: int) -> bytes:
    return s.encode(errors="replace")[:n]


def _untext(b: bytes) -> str:
    return b.rstrip(b"\0").decode(errors="replace")


def pack_setup_record(*, ok: bool, uid: bytes | None, uuid: str, error: str = "") -> bytes:
    """One rank's set-up record (:data:`SETUP_RECORD_SIZE` bytes).

    Parameters
    ----------
    ok : bool
        Local preparation (import, compile, allocation, unique id) succeeded.
    uid : bytes or None
        Rank 0's NCCL unique id (None on other ranks or on failure).
    uuid : str
        This rank's GPU UUID (``"GPU-..."``) or "" when unknown.
    error : str
        Why preparation failed (truncated to 256 bytes).
    """
    raw_uid = bytes(NCCL_UNIQUE_ID_BYTES) if uid is None else normalize_unique_id(uid)
    return struct.pack(
        _SETUP_FMT, _SETUP_MAGIC, 1 if ok else 0, raw_uid, _text(uuid, 40), _text(error, 256)
    )


def _fallback_hint() -> str:
    return "use backend='torch' (torch.distributed) or backend='auto', or fix the cause"


def parse_setup_records(records: Sequence[bytes], rank: int) -> bytes:
    """Check every rank's set-up record and return rank 0's unique id.

    Every rank calls this on the same records and so raises the same error.

    Raises
    ------
    BackendUnavailableError
        A rank failed to prepare (the message names every failing rank and its
        error), or two ranks share one GPU.
    DpSampleError
        A malformed record (a peer runs another ipc_dpsample version).
    """
    parsed = []
    for r, raw in enumerate(records):
        if len(raw) != SETUP_RECORD_SIZE:
            raise DpSampleError(
                f"rank {rank}: NCCL set-up record of rank {r} has {len(raw)} bytes, expected "
                f"{SETUP_RECORD_SIZE}: peers run different ipc_dpsample versions"
            )
        magic, ok, uid, uuid, error = struct.unpack(_SETUP_FMT, raw)
        if magic != _SETUP_MAGIC:
            raise DpSampleError(
                f"rank {rank}: NCCL set-up record of rank {r} has magic {magic!r}, expected "
                f"{_SETUP_MAGIC!r}: peers run different ipc_dpsample versions"
            )
        parsed.append((bool(ok), uid, _untext(uuid), _untext(error)))
    failed = [(r, err) for r, (ok, _, _, err) in enumerate(parsed) if not ok]
    if failed:
        detail = "; ".join(f"rank {r}: {err or 'unknown error'}" for r, err in failed)
        raise BackendUnavailableError(
            f"rank {rank}: the NCCL backend could not start ({detail}); {_fallback_hint()}"
        )
    owners: dict[str, list[int]] = {}
    for r, (_, _, uuid, _) in enumerate(parsed):
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
    uid = parsed[0][1]
    if uid == bytes(NCCL_UNIQUE_ID_BYTES):
        raise DpSampleError(f"rank {rank}: rank 0 sent an all-zero NCCL unique id")
    return uid


def pack_init_record(*, ok: bool, error: str = "") -> bytes:
    """One rank's ``ncclCommInitRank`` result (:data:`INIT_RECORD_SIZE` bytes)."""
    return struct.pack(_INIT_FMT, _INIT_MAGIC, 1 if ok else 0, _text(error, 256))


def parse_init_records(records: Sequence[bytes], rank: int) -> None:
    """Raise :class:`BackendUnavailableError` on every rank if any rank failed to
    create its NCCL communicator (the message names each failing rank and error)."""
    failed = []
    for r, raw in enumerate(records):
        if len(raw) != INIT_RECORD_SIZE:
            raise DpSampleError(
                f"rank {rank}: NCCL init record of rank {r} has {len(raw)} bytes, expected "
                f"{INIT_RECORD_SIZE}: peers run different ipc_dpsample versions"
            )
        magic, ok, error = struct.unpack(_INIT_FMT, raw)
        if magic != _INIT_MAGIC:
            raise DpSampleError(
                f"rank {rank}: NCCL init record of rank {r} has magic {magic!r}, expected "
                f"{_INIT_MAGIC!r}: peers run different ipc_dpsample versions"
            )
        if not ok:
            failed.append((r, _untext(error)))
    if failed:
        detail = "; ".join(f"rank {r}: {err or 'unknown error'}" for r, err in failed)
        raise BackendUnavailableError(
            f"rank {rank}: creating the NCCL communicator failed ({detail}); {_fallback_hint()}"
        )


# -- headers and errors ---------------------------------------------------------------
def swap_tag(logits_dtype: str) -> int:
    """Header word 0 of a swap: ``OP_SWAP | dtype_code << 8``.

    Raises
    ------
    ValueError
        ``logits_dtype`` is not bfloat16, float16 or float32.
    """
    code = DTYPE_CODES.get(logits_dtype)
    if code is None:
        raise ValueError(f"logits_dtype={logits_dtype!r}; expected one of {tuple(DTYPE_CODES)}")
    return OP_SWAP | code << 8


def describe_header(words: Sequence[int]) -> str:
    """Human form of a 4-word header ``[op | dtype << 8, pad_bs, N, seq]``, e.g.
    ``swap_batch_vocab(pad_bs=8, N=4, bfloat16) #3``."""
    tag, pad_bs, n, seq = (int(w) for w in words[:HDR_WORDS])
    op, code = tag & 0xFF, (tag >> 8) & 0xFF
    name = OP_NAMES.get(op, f"op {op}")
    dtype = f", {_DTYPE_NAMES.get(code, f'dtype {code}')}" if code else ""
    return f"{name}(pad_bs={pad_bs}, N={n}{dtype}) #{seq}"


def format_mismatch(words: Sequence[int]) -> str:
    """The error message for a host-mapped error block.

    Parameters
    ----------
    words : sequence of :data:`ERROR_WORDS` int
        ``[code, op, rank, peer, mine[4], theirs[4], reserved[4]]``.
    """
    code, op, rank, peer = (int(w) for w in words[:4])
    if code != ERR_MISMATCH:
        return f"rank {rank}: NCCL backend error code {code} (op {op}, peer {peer})"
    mine, theirs = words[4:8], words[8:12]
    return (
        f"rank {rank}: {OP_NAMES.get(op, f'op {op}')} found rank {peer} in a different call: "
        f"this rank called {describe_header(mine)}, rank {peer} called "
        f"{describe_header(theirs)} (#: ops completed before it). The ranks' call sequences "
        "diverged (another op, pad_bs or logits dtype); the outputs of that call are wrong and "
        "this communicator must be closed"
    )


# -- launch geometry ------------------------------------------------------------------
def packed_width(max_pad_bs: int, tp: int, n: int) -> int:
    """Words (int32) per rank in the gather buffers: ``4 + max_pad_bs/tp * (2N + 1)``.

    Both gathers use it regardless of ``pad_bs`` so that mismatched calls still move
    equal byte counts (NCCL completes and the headers report the mismatch)."""
    return HDR_WORDS + max_pad_bs // tp * (2 * n + 1)


def vector_width(rowbytes: int, *addresses: int) -> int:
    """Widest of 16, 8, 4, 2, 1 bytes that divides ``rowbytes`` and every address."""
    for w in (16, 8, 4, 2):
        if rowbytes % w == 0 and all(a % w == 0 for a in addresses):
            return w
    return 1


@dataclass(frozen=True)
class PermuteLaunch:
    """Launch geometry of a permute kernel.

    Attributes
    ----------
    grid, block : int
    tps_log2 : int
        log2 of the threads that copy one (row, source) segment.
    """

    grid: int
    block: int
    tps_log2: int


def permute_launch(rows: int, tp: int, rowbytes: int, width: int) -> PermuteLaunch:
    """Geometry for ``rows * tp`` segments of ``rowbytes`` bytes in ``width``-byte vectors.

    Each segment gets the smallest power of two of threads covering its vectors (at
    most one block), so short rows share a block and long rows loop.
    """
    if rowbytes % width:
        raise ValueError(f"rowbytes={rowbytes} is not a multiple of width={width}")
    vecs = rowbytes // width
    tps_log2 = 0
    while (1 << tps_log2) < vecs and (1 << tps_log2) < _BLOCK:
        tps_log2 += 1
    segs_per_block = _BLOCK >> tps_log2
    segments = rows * tp
    grid = max(1, min(_MAX_GRID, -(-segments // segs_per_block)))
    return PermuteLaunch(grid, _BLOCK, tps_log2)


def _linear_grid(total: int) -> int:
    return max(1, min(1024, -(-total // _BLOCK)))


# -- small runtime helpers -------------------------------------------------------------
_StreamHandle = StreamHandle
_cupy_stream = cupy_stream


def _array_ptr(kind: ArrayKind, x: Any) -> int:
    if kind is ArrayKind.TORCH:
        return int(x.data_ptr())
    if kind is ArrayKind.CUPY:
        return int(x.data.ptr)
    return describe(x).ptr


@dataclass(frozen=True)
class _SwapPlan:
    rows: int
    rowbytes: int
    chunk: int  # bytes from one rank to one peer
    width: int  # vector width valid for the persistent buffers
    launch: PermuteLaunch
    my_hdr: int  # device address of this R's header row
    tail: tuple[int, ...]  # permute arguments after the per-call ones


@dataclass(frozen=True)
class _GatherPlan:
    pack_grid: int
    unpack_grid: int
    unpack_args: tuple[int, ...]


class NcclBackend(Backend):
    """NCCL backend through ``cupy.cuda.nccl`` (see the module docstring).

    Parameters
    ----------
    cfg : CommConfig
    group : HostGroup
        Carries the set-up records (unique id, GPU UUIDs, errors) and the close barrier.
    device : int
        CUDA ordinal; one GPU per rank (NCCL refuses two ranks on one GPU).
    route_self_through_nccl : bool
        Send this rank's own block to itself through NCCL instead of reading it from
        the input in the permute kernel. Slower; exists so that a single GPU (tp=1)
        exercises the whole send/recv + staging path in tests.

    Raises
    ------
    BackendUnavailableError
        On every rank, when any rank cannot load NCCL, compile the kernels, allocate
        the buffers or create the communicator, or when two ranks share a GPU.
    """

    name = "nccl"

    def __init__(
        self,
        cfg: CommConfig,
        group: HostGroup,
        device: int,
        *,
        route_self_through_nccl: bool = False,
    ) -> None:
        if device < 0:
            raise BackendUnavailableError(
                "the NCCL backend needs a CUDA device but this communicator is on the CPU; "
                "use backend='torch' (or 'auto')"
            )
        self.cfg = cfg
        self.group = group
        self.device = device
        self.rank = cfg.rank
        self.tp = cfg.tp_size
        self._route_self = route_self_through_nccl
        self._closed = False
        self._comm: Any = None
        self._err_host = 0
        self._bufs: dict[str, Any] = {}
        self._views: dict[Any, Any] = {}
        self._streams: dict[int, Any] = {}
        self._swap_plans: dict[int, _SwapPlan] = {}
        self._gather_plans: dict[tuple[int, int], _GatherPlan] = {}
        self._logits_dtype: str | None = None
        self._event: Any = None  # recorded after every op not under capture
        self._last_stream: int | None = None  # stream of the last op that recorded it
        n, tp = cfg.num_tokens_per_req, cfg.tp_size
        self._rmax = cfg.max_pad_bs // tp
        self._width = packed_width(cfg.max_pad_bs, tp, n)
        self._max_itemsize = ITEMSIZE[cfg.logits_dtype] if cfg.logits_dtype is not None else 4
        timeout = max(_SETUP_TIMEOUT_S, cfg.timeout_s)

        uid: bytes | None = None
        error = ""
        try:
            self._prepare_local()
            if self.rank == 0:
                uid = normalize_unique_id(self._nccl.get_unique_id())
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        try:
            records = group.all_gather_bytes(
                pack_setup_record(ok=not error, uid=uid, uuid=gpu_uuid(device), error=error),
                timeout_s=timeout,
                what="NCCL set-up",
            )
            raw_uid = parse_setup_records(records, self.rank)
        except BaseException:
            self._release()
            raise

        error = ""
        try:
            self._comm = self._create_communicator(raw_uid)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        try:
            records = group.all_gather_bytes(
                pack_init_record(ok=not error, error=error),
                timeout_s=timeout,
                what="NCCL communicator init",
            )
            parse_init_records(records, self.rank)
            if cfg.logits_dtype is not None:
                self.prepare(cfg.logits_dtype)
            self._synchronize()
        except BaseException:
            self._release(abort=True)
            raise

    # -- set-up -------------------------------------------------------------------------
    def _prepare_local(self) -> None:
        """Import NCCL, compile the kernels, allocate every persistent buffer."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # CuPy warns when libnccl is missing; we raise
            import cupy
            from cupy.cuda import nccl
        if not getattr(nccl, "available", False) or not hasattr(nccl, "NcclCommunicator"):
            raise BackendUnavailableError(
                "cupy.cuda.nccl could not load libnccl (install NCCL, e.g. "
                "pip install nvidia-nccl-cu12 or nvidia-nccl-cu13)"
            )
        count = cupy.cuda.runtime.getDeviceCount()
        if self.device >= count:
            raise BackendUnavailableError(
                f"device cuda:{self.device} does not exist ({count} GPUs)"
            )
        self._cupy = cupy
        self._nccl = nccl
        self._runtime = cupy.cuda.runtime
        from ..kernel_cache import get_kernel

        with cupy.cuda.Device(self.device):
            self._kernels = {name: get_kernel(SOURCE, name, self.device) for name in KERNEL_NAMES}
            self._allocate()
            self._event = cupy.cuda.Event(block=False, disable_timing=True)

    def _allocate(self) -> None:
        """Every persistent buffer (zeroed) and the host-mapped error block."""
        cfg, tp, n = self.cfg, self.tp, self.cfg.num_tokens_per_req
        swap_bytes = self._rmax * n * cfg.vocab_size * self._max_itemsize
        if tp > 1 or self._route_self:
            self._alloc("staging", swap_bytes)  # [tp, R*N, V/tp] bytes
        self._alloc("out_swap", swap_bytes)  # [R*N, V]
        self._alloc("hdr_recv", tp * HDR_BYTES)  # [tp, 4] int32
        # ctrl: int32 op counter (padded to 16 bytes), then the swap-header table
        # [rmax, 4] int32: row R-1 = [OP_SWAP | dtype << 8, R * tp, N, seq].
        self._alloc("ctrl", HDR_BYTES + self._rmax * HDR_BYTES)
        self._alloc("grecv", tp * self._width * 4)  # [tp, W] int32
        self._alloc("predict", cfg.max_pad_bs * n * 4)
        self._alloc("accept_index", cfg.max_pad_bs * n * 4)
        self._alloc("accept_length", cfg.max_pad_bs * 4)
        self._alloc("logprobs", cfg.max_pad_bs * n * 4)
        for buf in self._bufs.values():
            buf.fill(0)
        self._err_host, self._err_dev = self._alloc_error_block()
        ctypes.memset(self._err_host, 0, ERROR_BYTES)
        self._err_code = ctypes.c_int32.from_address(self._err_host)
        self._runtime.deviceSynchronize()
        self._ptr = {name: int(buf.data.ptr) for name, buf in self._bufs.items()}
        self._ptr.setdefault("staging", 0)
        self._counter = self._ptr["ctrl"]
        self._table = self._ptr["ctrl"] + HDR_BYTES

    def _alloc_error_block(self) -> tuple[int, int]:
        """Mapped pinned host memory for the error block: (host address, device address)."""
        rt = self._runtime
        host = int(rt.hostAlloc(ERROR_BYTES, rt.hostAllocMapped | rt.hostAllocPortable))
        # under UVA (every 64-bit platform CUDA supports) the two addresses are equal
        attrs = rt.pointerGetAttributes(host)
        return host, int(getattr(attrs, "devicePointer", 0) or host)

    def _alloc(self, name: str, nbytes: int) -> None:
        """A dedicated ``cudaMalloc`` (not pooled), freed when the last view drops it."""
        cupy = self._cupy
        mem = cupy.cuda.Memory(max(1, nbytes))
        self._bufs[name] = cupy.ndarray(
            (nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0)
        )

    def _create_communicator(self, raw_uid: bytes) -> Any:
        nccl = self._nccl
        preferred = _installed_unique_id_form()
        other: UniqueIdForm = "tuple" if preferred == "bytes" else "bytes"
        with self._cupy.cuda.Device(self.device):
            try:
                return nccl.NcclCommunicator(
                    self.tp, unique_id_for_cupy(raw_uid, preferred), self.rank
                )
            except TypeError as first:
                # the argument conversion failed before ncclCommInitRank ran: retry
                try:
                    return nccl.NcclCommunicator(
                        self.tp, unique_id_for_cupy(raw_uid, other), self.rank
                    )
                except TypeError:
                    raise first from None

    def _synchronize(self) -> None:
        with self._cupy.cuda.Device(self.device):
            self._runtime.deviceSynchronize()

    def prepare(self, logits_dtype: str) -> None:
        """Build the swap-header table for ``logits_dtype`` (synchronises the device:
        call it before capturing a CUDA graph, never inside one).

        Raises
        ------
        ValueError
            ``logits_dtype`` needs larger elements than the buffers were sized for.
        """
        if logits_dtype == self._logits_dtype:
            return
        if ITEMSIZE[logits_dtype] > self._max_itemsize:
            raise ValueError(
                f"logits_dtype={logits_dtype} needs {ITEMSIZE[logits_dtype]}-byte elements; the "
                f"NCCL buffers were sized for {self._max_itemsize}"
            )
        import numpy as np

        tag = swap_tag(logits_dtype)
        cupy = self._cupy
        with cupy.cuda.Device(self.device):
            self._runtime.deviceSynchronize()  # ops in flight advance the counter
            ctrl = self._bufs["ctrl"].view(np.int32)
            seq = int(ctrl[:1].get()[0])
            table = np.empty((self._rmax, HDR_WORDS), dtype=np.int32)
            table[:, 0] = tag
            table[:, 1] = np.arange(1, self._rmax + 1, dtype=np.int32) * self.tp
            table[:, 2] = self.cfg.num_tokens_per_req
            table[:, 3] = seq
            ctrl[HDR_WORDS:].set(table.reshape(-1))
            self._runtime.deviceSynchronize()
        self._logits_dtype = logits_dtype
        self._swap_plans.clear()
        self._views = {k: v for k, v in self._views.items() if k[1] != "swap"}

    # -- per-call plumbing --------------------------------------------------------------
    def _raise_if_error(self) -> None:
        if self._err_code.value:
            words = struct.unpack(f"<{ERROR_WORDS}i", ctypes.string_at(self._err_host, ERROR_BYTES))
            raise DpSampleError(format_mismatch(words))

    def _stream(self, handle: int) -> Any:
        s = self._streams.get(handle)
        if s is None:
            if len(self._streams) >= _MAX_CACHED_STREAMS:
                self._streams.clear()
            s = _cupy_stream(handle, self.device)
            self._streams[handle] = s
        return s

    def _begin(self, handle: int) -> bool:
        """Refuse an op on another stream while the previous op is in flight; return
        True when ``handle`` is being captured into a CUDA graph."""
        capturing = self._runtime.streamIsCapturing(handle) != 0
        last = self._last_stream
        if last != handle and last is not None and not capturing and not self._event.done:
            raise DpSampleError(
                f"rank {self.rank}: op issued on stream {handle:#x} while this communicator's "
                f"previous op on stream {last:#x} is still in flight: one op at a time per "
                "communicator (synchronise the streams, or use one communicator per stream)"
            )
        return capturing

    def _end(self, handle: int, cstream: Any, capturing: bool) -> None:
        if not capturing:
            self._event.record(cstream)
            self._last_stream = handle

    def _view(
        self, kind: ArrayKind, key: str, pad_bs: int, shape: tuple[int, ...], dtype: str
    ) -> Any:
        k = (kind, key, pad_bs)
        v = self._views.get(k)
        if v is None:
            name = "out_swap" if key == "swap" else key
            v = make_view(kind, self._ptr[name], shape, dtype, self.device, owner=self._bufs[name])
            self._views[k] = v
        return v

    def _swap_plan(self, pad_bs: int) -> _SwapPlan:
        plan = self._swap_plans.get(pad_bs)
        if plan is not None:
            return plan
        assert self._logits_dtype is not None
        cfg = self.cfg
        r = pad_bs // self.tp
        rows = r * cfg.num_tokens_per_req
        rowbytes = cfg.vocab_size // self.tp * ITEMSIZE[self._logits_dtype]
        width = vector_width(rowbytes, self._ptr["out_swap"], self._ptr["staging"])
        my_hdr = self._table + (r - 1) * HDR_BYTES
        self_rank = -1 if self._route_self else self.rank
        launch = permute_launch(rows, self.tp, rowbytes, width)
        tail = (
            self_rank,
            self.tp,
            rows,
            rowbytes,
            launch.tps_log2,
            self._ptr["hdr_recv"],
            my_hdr,
            self._table,
            self._rmax,
            self._counter,
            self._err_dev,
            self.rank,
        )
        plan = _SwapPlan(rows, rowbytes, rows * rowbytes, width, launch, my_hdr, tail)
        self._swap_plans[pad_bs] = plan
        return plan

    def _gather_plan(self, op: int, pad_bs: int) -> _GatherPlan:
        key = (op, pad_bs)
        plan = self._gather_plans.get(key)
        if plan is not None:
            return plan
        r = pad_bs // self.tp
        rn = r * self.cfg.num_tokens_per_req
        p = self._ptr
        if op == OP_GATHER_OUTPUTS:
            dsts = (p["predict"], rn, p["accept_index"], rn, p["accept_length"], r)
            per = 2 * rn + r
        else:
            dsts = (p["logprobs"], rn, 0, 0, 0, 0)
            per = rn
        unpack_args = (
            p["grecv"],
            self._width,
            self.tp,
            self.rank,
            *dsts,
            self._table,
            self._rmax,
            self._counter,
            self._err_dev,
        )
        plan = _GatherPlan(_linear_grid(per), _linear_grid(self.tp * per), unpack_args)
        self._gather_plans[key] = plan
        return plan

    def _nccl_error(self, what: str, exc: BaseException) -> DpSampleError:
        return DpSampleError(f"rank {self.rank}: NCCL {what} failed: {exc}")

    # -- collectives -----------------------------------------------------------------------
    def swap_batch_vocab(
        self, x: Any, info: ArrayInfo, *, pad_bs: int, bs: Any = None, stream: Any
    ) -> Any:
        self._raise_if_error()
        handle = resolve_stream(info.kind, stream, self.device)
        capturing = self._begin(handle)
        plan = self._swap_plan(pad_bs)
        cstream = self._stream(handle)
        x_ptr = info.ptr
        tp, rank, chunk = self.tp, self.rank, plan.chunk
        rt = self._runtime
        prev = rt.getDevice()
        if prev != self.device:
            rt.setDevice(self.device)
        try:
            if tp > 1 or self._route_self:
                nccl, comm = self._nccl, self._comm
                u8 = nccl.NCCL_UINT8
                staging, hdr_recv = self._ptr["staging"], self._ptr["hdr_recv"]
                try:
                    nccl.groupStart()
                    try:
                        for k in range(0 if self._route_self else 1, tp):
                            dst, src = (rank + k) % tp, (rank - k) % tp
                            comm.send(plan.my_hdr, HDR_BYTES, u8, dst, handle)
                            comm.recv(hdr_recv + src * HDR_BYTES, HDR_BYTES, u8, src, handle)
                            comm.send(x_ptr + dst * chunk, chunk, u8, dst, handle)
                            comm.recv(staging + src * chunk, chunk, u8, src, handle)
                    finally:
                        nccl.groupEnd()
                except nccl.NcclError as exc:
                    raise self._nccl_error("grouped send/recv of swap_batch_vocab", exc) from exc
            self_src = 0 if self._route_self else x_ptr + rank * chunk
            width, launch = plan.width, plan.launch
            if self_src % width:
                width = vector_width(
                    plan.rowbytes, self_src, self._ptr["out_swap"], self._ptr["staging"]
                )
                launch = permute_launch(plan.rows, tp, plan.rowbytes, width)
                tail = (*plan.tail[:4], launch.tps_log2, *plan.tail[5:])
            else:
                tail = plan.tail
            self._kernels[PERMUTE_KERNELS[width]](
                (launch.grid,),
                (launch.block,),
                (self._ptr["out_swap"], self._ptr["staging"], self_src, *tail),
                stream=cstream,
            )
            self._end(handle, cstream, capturing)
        finally:
            if prev != self.device:
                rt.setDevice(prev)
        dtype = self._logits_dtype
        assert dtype is not None
        return self._view(info.kind, "swap", pad_bs, (plan.rows, self.cfg.vocab_size), dtype)

    def _gather(
        self,
        op: int,
        kind: ArrayKind,
        srcs: tuple[int, int, int, int, int, int],
        pad_bs: int,
        stream: Any,
    ) -> None:
        self._raise_if_error()
        handle = resolve_stream(kind, stream, self.device)
        capturing = self._begin(handle)
        plan = self._gather_plan(op, pad_bs)
        cstream = self._stream(handle)
        slot = self._ptr["grecv"] + self.rank * self._width * 4
        rt = self._runtime
        prev = rt.getDevice()
        if prev != self.device:
            rt.setDevice(self.device)
        try:
            k = self._kernels
            k["nccl_pack"](
                (plan.pack_grid,),
                (_BLOCK,),
                (slot, *srcs, op, pad_bs, self.cfg.num_tokens_per_req, self._counter),
                stream=cstream,
            )
            nccl = self._nccl
            try:
                self._comm.allGather(slot, self._ptr["grecv"], self._width, nccl.NCCL_INT32, handle)
            except nccl.NcclError as exc:
                raise self._nccl_error(f"allGather of {OP_NAMES[op]}", exc) from exc
            k["nccl_unpack"]((plan.unpack_grid,), (_BLOCK,), plan.unpack_args, stream=cstream)
            self._end(handle, cstream, capturing)
        finally:
            if prev != self.device:
                rt.setDevice(prev)

    def gather_verify_outputs(
        self,
        predict: Any,
        accept_index: Any,
        accept_length: Any,
        info: ArrayInfo,
        *,
        pad_bs: int,
        bs: Any = None,
        stream: Any,
    ) -> tuple[Any, Any, Any]:
        kind = info.kind
        r = pad_bs // self.tp
        rn = r * self.cfg.num_tokens_per_req
        srcs = (
            info.ptr,
            rn,
            _array_ptr(kind, accept_index),
            rn,
            _array_ptr(kind, accept_length),
            r,
        )
        self._gather(OP_GATHER_OUTPUTS, kind, srcs, pad_bs, stream)
        shape = (pad_bs, self.cfg.num_tokens_per_req)
        return (
            self._view(kind, "predict", pad_bs, shape, "int32"),
            self._view(kind, "accept_index", pad_bs, shape, "int32"),
            self._view(kind, "accept_length", pad_bs, (pad_bs,), "int32"),
        )

    def gather_verify_logprobs(
        self, logprobs: Any, info: ArrayInfo, *, pad_bs: int, bs: Any = None, stream: Any
    ) -> Any:
        rn = pad_bs // self.tp * self.cfg.num_tokens_per_req
        self._gather(OP_GATHER_LOGPROBS, info.kind, (info.ptr, rn, 0, 0, 0, 0), pad_bs, stream)
        shape = (pad_bs, self.cfg.num_tokens_per_req)
        return self._view(info.kind, "logprobs", pad_bs, shape, "float32")

    def check(self) -> None:
        """Raise the first header mismatch any kernel reported, then any asynchronous
        NCCL error (``ncclCommGetAsyncError``), as :class:`DpSampleError`.

        Synchronise the ops' stream first to see the latest op's result."""
        if self._closed:
            raise DpSampleError("this NCCL backend is closed")
        self._raise_if_error()
        try:
            self._comm.check_async_error()
        except Exception as exc:
            raise DpSampleError(
                f"rank {self.rank}: NCCL reported an asynchronous error: {exc}; this "
                "communicator must be closed"
            ) from exc

    # -- teardown ---------------------------------------------------------------------------
    def close(self) -> None:
        """Host barrier (bounded by ``timeout_s``), then destroy the NCCL communicator;
        abort it instead, with a ``RuntimeWarning``, if a peer does not arrive."""
        if self._closed:
            return
        self._closed = True
        abort = False
        try:
            self.group.barrier(timeout_s=self.cfg.timeout_s, what="NCCL backend close")
        except DpSampleError as exc:
            abort = True
            warnings.warn(
                f"ipc_dpsample: aborting the NCCL communicator instead of destroying it: {exc}",
                RuntimeWarning,
                stacklevel=2,
            )
        self._release(abort=abort)

    def _release(self, abort: bool = False) -> None:
        """Destroy (or abort) the communicator and free every buffer; idempotent."""
        self._closed = True
        comm, self._comm = self._comm, None
        cupy = getattr(self, "_cupy", None)
        if comm is not None:
            ctx = cupy.cuda.Device(self.device) if cupy is not None else contextlib.nullcontext()
            with ctx:
                if abort:
                    comm.abort()
                else:
                    comm.destroy()
        self._views.clear()
        self._streams.clear()
        self._swap_plans.clear()
        self._gather_plans.clear()
        self._bufs.clear()
        if self._err_host and cupy is not None:
            self._err_code = ctypes.c_int32(0)  # never read freed host memory
            cupy.cuda.runtime.freeHost(self._err_host)
            self._err_host = 0

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"NcclBackend(rank={self.rank}/{self.tp}, device=cuda:{self.device}, "
            f"dtype={self._logits_dtype}, {state})"
        )

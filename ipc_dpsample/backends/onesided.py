"""The one-sided backend: CUDA IPC arena, device peer table, one kernel launch per op.

Protocol (see ``kernels/onesided.cu`` and DESIGN.md "The one-sided protocol"):

* op ``e`` (epochs start at 1, kept and advanced in device memory) uses receive
  region and flag parity ``e & 1``; a peer can be at most one op ahead, so the
  output of op ``e`` stays intact until this rank issues its next op;
* swap: every CTA pushes its tile into the destination's region (16-byte vectors
  where the relative alignment allows), fences and bumps a counter; the last CTA
  writes ``flags[e&1][rank] = e << 32 | signature`` on every peer with release
  semantics and waits (acquire) for every peer's flag;
* gathers: one CTA; each 4-byte value travels with its epoch in one 8-byte LL
  packet; the receiver spins until every slot shows the epoch and unpacks into
  persistent outputs;
* every spin is bounded by ``%globaltimer``; a timeout or a signature mismatch
  (different op, ``pad_bs`` or dtype on a peer) is written to a host-mapped error
  block, marks the communicator broken, and is raised by the host at the next call
  or :meth:`check` as :class:`PeerTimeoutError` / :class:`DpSampleError`.

Swap outputs: eagerly issued swaps return a view of the region the op wrote (no
extra copy). Once any op has been captured into a CUDA graph the host can no
longer know the device epoch's parity, and a captured consumer reads one fixed
address; from then on every swap is two launches: an entry barrier
(``dp_swap_enter``: each rank tells its peers it has consumed the previous output,
then waits for theirs) and the push straight into one fixed output region. That
moves the same bytes as an eager swap; the barrier costs one flag round trip.
"""

from __future__ import annotations

import os
import struct
import warnings
from typing import Any

from ..arrays import ITEMSIZE, ArrayInfo, ArrayKind, make_view, resolve_stream
from ..config import CommConfig, PeerRecord
from ..errors import DpSampleError, PeerTimeoutError
from ..group import HostGroup
from ..ipc import (
    IpcRecord,
    close_peer,
    injected_failure,
    open_peer,
    pack_ipc_record,
    unpack_ipc_record,
    validate_peer_record,
)
from ..kernel_cache import get_kernel
from ..symmetric import (
    MAX_SIG_PAD_BS,
    OP_NAMES,
    Arena,
    ArenaLayout,
    pack_signature,
    signature_mode,
    unpack_signature,
    upload_u64_table,
)
from .base import Backend

__all__ = ["OnesidedBackend", "setup_onesided"]

SOURCE = "onesided.cu"
SWAP_BLOCK = int(os.environ.get("IPC_DPSAMPLE_SWAP_BLOCK", "512"))
SWAP_CHUNK = int(os.environ.get("IPC_DPSAMPLE_SWAP_CHUNK", "32768"))
#: swap CTAs per SM (the kernel strides over its tiles, so this caps the grid). On
#: one H200 (tp=8 ranks sharing it, fitted CTAs) 1, 2 and 3 gave 0.901-0.904 of the
#: copy limit, 4 and 8 less; see BENCHMARKS.md
SWAP_CTAS_PER_SM = int(os.environ.get("IPC_DPSAMPLE_SWAP_CTAS_PER_SM", "3"))
#: 16-byte loads each thread issues before its stores (compile-time, DP_SWAP_UNROLL)
SWAP_UNROLL = int(os.environ.get("IPC_DPSAMPLE_SWAP_UNROLL", "4"))
#: 1: size the swap's CTAs to its chunk (a CTA moves a chunk in one round of loads,
#: with few idle lanes); 0: always IPC_DPSAMPLE_SWAP_BLOCK threads
SWAP_FIT = os.environ.get("IPC_DPSAMPLE_SWAP_FIT", "1") != "0"
GATHER_BLOCK = 512
_EPOCH_LIMIT = 2**32 - 4  # epochs are 32-bit in the flags and LL packets
if SWAP_BLOCK < 32 or SWAP_BLOCK % 32 or SWAP_BLOCK > 1024:
    raise ValueError(f"IPC_DPSAMPLE_SWAP_BLOCK={SWAP_BLOCK} must be a multiple of 32 in [32, 1024]")
if SWAP_CHUNK < 16 or SWAP_CHUNK % 16:
    raise ValueError(f"IPC_DPSAMPLE_SWAP_CHUNK={SWAP_CHUNK} must be a positive multiple of 16")
if not 1 <= SWAP_CTAS_PER_SM <= 32:
    raise ValueError(f"IPC_DPSAMPLE_SWAP_CTAS_PER_SM={SWAP_CTAS_PER_SM} must be in [1, 32]")
if SWAP_UNROLL not in (1, 2, 4, 8, 16):
    raise ValueError(f"IPC_DPSAMPLE_SWAP_UNROLL={SWAP_UNROLL} must be one of 1, 2, 4, 8, 16")
#: 1: the swap's 16-byte moves use streaming cache hints (compile-time,
#: DP_SWAP_STREAMING). Off: on one H200 it moved the tp=8 swap from 0.90 to 0.81-0.84
#: of the copy limit
SWAP_STREAMING = os.environ.get("IPC_DPSAMPLE_SWAP_STREAMING", "0") != "0"
_OPTIONS = (f"-DDP_SWAP_UNROLL={SWAP_UNROLL}", f"-DDP_SWAP_STREAMING={int(SWAP_STREAMING)}")
#: How a swap runs once ops are captured in CUDA graphs: ``barrier`` (default: an
#: entry barrier, then the push straight into one fixed output) or ``copy`` (the
#: eager push, then a local copy of the finished region into the fixed output: no
#: barrier, one more pass over the output's bytes). Every rank must use the same.
GRAPH_SWAP = os.environ.get("IPC_DPSAMPLE_GRAPH_SWAP", "barrier")
if GRAPH_SWAP not in ("barrier", "copy"):
    raise ValueError(f"IPC_DPSAMPLE_GRAPH_SWAP={GRAPH_SWAP!r} must be 'barrier' or 'copy'")
#: Test hook: IPC_DPSAMPLE_TEST_SINGLE_BUFFER=1 makes every op use one data region
#: (the original design's race); tests use it to prove the race is real and absent.
ENV_SINGLE_BUFFER = "IPC_DPSAMPLE_TEST_SINGLE_BUFFER"
_SETUP_TIMEOUT_S = 60.0
_STATUS = struct.Struct("<B159s")  # 0 ok, 1 soft failure (fall back), 2 hard failure (raise)


def _launch_kernel(*args: int) -> None:
    """``cuLaunchKernel`` (CuPy's binding), bound on first use."""
    global _launch_kernel
    from cupy.cuda import driver

    _launch_kernel = driver.launchKernel
    driver.launchKernel(*args)


class _Launch:
    """One kernel launch with its argument block packed once.

    Every kernel argument here is 64 bits wide. The values live in a ctypes array
    and the ``void**`` parameter block points into it, so an eager call rewrites
    the first ``n_var`` values (the caller's input pointers) and makes one
    ``cuLaunchKernel`` call: no per-argument conversion on the hot path.
    """

    __slots__ = ("_block", "_device", "_func", "_grid", "_params", "_ptrs", "_vals", "n_var")

    def __init__(
        self, kernel: Any, device: int, grid: int, block: int, args: tuple[int, ...], n_var: int
    ):
        import ctypes

        import cupy

        with cupy.cuda.Device(device):
            self._func = int(kernel.kernel.ptr)  # the CUfunction loaded on `device`
        n = len(args)
        self._vals = (ctypes.c_uint64 * n)(*[int(a) & 0xFFFF_FFFF_FFFF_FFFF for a in args])
        base = ctypes.addressof(self._vals)
        self._ptrs = (ctypes.c_void_p * n)(*[base + 8 * i for i in range(n)])
        self._params = ctypes.addressof(self._ptrs)
        self._grid, self._block, self.n_var, self._device = grid, block, n_var, device

    def __call__(self, stream: int, *var: int) -> None:
        vals = self._vals
        for i, v in enumerate(var):
            vals[i] = v
        try:
            _launch_kernel(
                self._func, self._grid, 1, 1, self._block, 1, 1, 0, stream, self._params, 0
            )
        except Exception as exc:
            import cupy
            from cupy.cuda import driver

            if not isinstance(exc, driver.CUDADriverError):
                raise
            # the calling thread's current context is another device's (or none):
            # make this device's primary context current and try once more
            with cupy.cuda.Device(self._device):
                driver.launchKernel(
                    self._func, self._grid, 1, 1, self._block, 1, 1, 0, stream, self._params, 0
                )


def swap_block(chunk_bytes: int, tp: int) -> int:
    """Threads per swap CTA: the fewest warps that move a ``chunk_bytes`` chunk in one
    round of ``SWAP_UNROLL`` 16-byte loads per thread (at most ``SWAP_BLOCK``, at least
    ``tp``: thread t signals peer t). A 512-thread CTA moves 32 KiB per round; a chunk
    of 25 KiB (V/tp fp32 rows at tp=8, V=152064, cut in three) would leave a quarter
    of its lanes idle in every round."""
    per_warp = 32 * 16 * SWAP_UNROLL
    warps = -(-chunk_bytes // per_warp)
    return max(32 * -(-tp // 32), min(SWAP_BLOCK, 32 * warps))


def probe_value(src: int, dst: int, pid: int) -> int:
    """The word rank ``src`` writes into rank ``dst``'s probe slot at init (never 0)."""
    return (0xD5 << 56) | ((src & 0xFFFF) << 40) | ((dst & 0xFFFF) << 24) | (pid & 0xFFFFFF)


def _exchange_status(group: HostGroup, code: int, reason: str, what: str) -> tuple[int, str]:
    raw = group.all_gather_bytes(
        _STATUS.pack(code, reason.encode()[:159]), timeout_s=_SETUP_TIMEOUT_S, what=what
    )
    worst, why = 0, ""
    for r, item in enumerate(raw):
        c, msg = _STATUS.unpack(item)
        if c > worst or (c and not why):
            worst = max(worst, c)
            text = msg.rstrip(b"\0").decode(errors="replace")
            why = f"rank {r}: {text}"
    return worst, why


def setup_onesided(
    cfg: CommConfig, group: HostGroup, device: int, records: list[PeerRecord]
) -> tuple[OnesidedBackend | None, str]:
    """Build the one-sided backend collectively, or agree on every rank that it
    cannot run.

    Every rank allocates and exports its arena, opens every peer's arena, writes a
    probe word into every peer through the mapping with a kernel, and checks the
    words it received. A failure on any rank vetoes the fast path on all ranks.

    Returns
    -------
    (backend, detail)
        ``backend`` is None when the fast path is vetoed; ``detail`` names the rank
        and the cause.

    Raises
    ------
    DpSampleError
        A peer sent a malformed or inconsistent record (raised on every rank).
    """
    import cupy
    from cupy.cuda import runtime

    tp, rank = cfg.tp_size, cfg.rank
    if tp > min(SWAP_BLOCK, GATHER_BLOCK):
        # thread t signals and waits for peer t: a CTA needs at least tp threads
        return None, f"tp_size={tp} exceeds the kernels' {min(SWAP_BLOCK, GATHER_BLOCK)} threads"
    if cfg.max_pad_bs > MAX_SIG_PAD_BS:
        return None, f"max_pad_bs={cfg.max_pad_bs} exceeds the op signature's {MAX_SIG_PAD_BS}"
    itemsize = ITEMSIZE[cfg.logits_dtype] if cfg.logits_dtype else 4
    layout = ArenaLayout(tp, cfg.max_pad_bs, cfg.num_tokens_per_req, cfg.vocab_size, itemsize)
    me = records[rank]
    arena: Arena | None = None
    code, reason = 0, ""
    with cupy.cuda.Device(device):
        try:
            # compile before anything is shared
            get_kernel(SOURCE, "dp_swap_push", device, _OPTIONS)
            arena = Arena(layout, device)
            handle = arena.ipc_handle()
        except Exception as exc:
            code, reason, handle = 1, f"arena setup failed: {type(exc).__name__}: {exc}", b""
        rec = IpcRecord(
            ok=code == 0,
            rank=rank,
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
        raw = group.all_gather_bytes(
            pack_ipc_record(rec), timeout_s=_SETUP_TIMEOUT_S, what="IPC handle exchange"
        )
        peer_recs: list[IpcRecord] = []
        if code == 0:
            try:
                for src, item in enumerate(raw):
                    prec = unpack_ipc_record(item)
                    if prec.ok:
                        validate_peer_record(prec, src, records[src], layout.total_bytes)
                    peer_recs.append(prec)
            except DpSampleError as exc:
                code, reason = 2, str(exc)
        worst, why = _exchange_status(group, code, reason, "IPC record validation")
        if worst == 0 and not all(p.ok for p in peer_recs):
            bad = next(p for p in peer_recs if not p.ok)
            worst, why = 1, f"rank {bad.rank}: {bad.reason}"
        if worst:
            _teardown(group, arena, [], [], cfg.timeout_s)
            if worst == 2:
                raise DpSampleError(f"one-sided setup refused a peer record: {why}")
            return None, why

        # open every peer and write a probe word through each mapping
        assert arena is not None
        opened: list[int] = []
        try:
            for prec in peer_recs:
                opened.append(open_peer(prec, rank, device))
            table = upload_u64_table(opened, device)
            probe = get_kernel(SOURCE, "dp_probe_write", device, _OPTIONS)
            for dst, base in enumerate(opened):
                value = probe_value(rank, dst, os.getpid())
                probe((1,), (32,), (base + layout.probe_off + 8 * rank, value))
            runtime.deviceSynchronize()
        except Exception as exc:
            code, reason = 1, f"opening peer arenas failed: {type(exc).__name__}: {exc}"
            table = None
        worst, why = _exchange_status(group, code, reason, "IPC open")
        if worst == 0:
            import numpy as np

            got = np.empty(tp, dtype=np.uint64)
            runtime.memcpy(got.ctypes.data, arena.ptr + layout.probe_off, 8 * tp, 2)
            expect = [probe_value(src, rank, records[src].pid) for src in range(tp)]
            if injected_failure("verify", rank):
                expect[(rank + 1) % tp] ^= 1
            bad = [s for s in range(tp) if int(got[s]) != expect[s]]
            if bad:
                code = 1
                reason = (
                    f"write/read-back through CUDA IPC failed: probe words from ranks {bad} "
                    f"read {[hex(int(got[s])) for s in bad]}, expected "
                    f"{[hex(expect[s]) for s in bad]}"
                )
            worst, why = _exchange_status(group, code, reason, "IPC verification")
        if worst:
            _teardown(group, arena, opened, peer_recs, cfg.timeout_s)
            return None, why
        assert table is not None
        backend = OnesidedBackend(cfg, group, device, layout, arena, opened, peer_recs, table)
    return backend, "verified"


def _teardown(
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


class OnesidedBackend(Backend):
    """One-sided CUDA IPC backend (built by :func:`setup_onesided`)."""

    name = "onesided"

    def __init__(
        self,
        cfg: CommConfig,
        group: HostGroup,
        device: int,
        layout: ArenaLayout,
        arena: Arena,
        opened: list[int],
        peer_recs: list[IpcRecord],
        table: Any,
    ):
        import cupy

        self.cfg = cfg
        self.group = group
        self.device = device
        self.layout = layout
        self.arena = arena
        self._opened = opened
        self._peer_recs = peer_recs
        self._table = table  # device uint64[tp], kept alive here
        self._swap = get_kernel(SOURCE, "dp_swap_push", device, _OPTIONS)
        self._gather = get_kernel(SOURCE, "dp_gather_ll", device, _OPTIONS)
        self._enter = get_kernel(SOURCE, "dp_swap_enter", device, _OPTIONS)
        self._copy_out = get_kernel(SOURCE, "dp_swap_copy_out", device, _OPTIONS)
        self._logits_dtype: str | None = None
        self._timeout_ns = int(cfg.timeout_s * 1e9)
        self._parity_mask = 0 if os.environ.get(ENV_SINGLE_BUFFER) == "1" else 1
        self._host_epoch = 0
        self._graphed = False
        self._views: dict[Any, Any] = {}
        self._swap_plans: dict[int, tuple[_Launch, _Launch, _Launch]] = {}
        self._gather_plans: dict[tuple[int, int], _Launch] = {}
        self._sm_count = int(cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"])
        self._error: DpSampleError | None = None
        self._last_stream: int | None = None
        # ranks that are threads of one process must not share a stream
        self._claim_stream = getattr(group, "claim_stream", None) if cfg.tp_size > 1 else None
        self._stream_owner = device
        with cupy.cuda.Device(device):
            self._event = cupy.cuda.Event(block=False, disable_timing=True)
        self._event_ptr = int(self._event.ptr)
        self._event_recorded = False
        self._runtime = cupy.cuda.runtime
        # cuFuncGetAttribute forces the (lazy) load now: never inside a stream capture
        for kernel in (self._swap, self._gather, self._enter, self._copy_out):
            _ = kernel.max_threads_per_block
        if cfg.logits_dtype is not None:
            self.prepare(cfg.logits_dtype)

    # -- plumbing -----------------------------------------------------------------
    def prepare(self, logits_dtype: str) -> None:
        if ITEMSIZE[logits_dtype] > self.layout.itemsize:
            raise ValueError(
                f"logits_dtype={logits_dtype} needs {ITEMSIZE[logits_dtype]}-byte elements; the "
                f"arena was sized for {self.layout.itemsize}"
            )
        if logits_dtype != self._logits_dtype:
            self._logits_dtype = logits_dtype
            self._swap_plans.clear()
            self._views = {k: v for k, v in self._views.items() if k[0][0] != "swap"}

    def _begin(self, handle: int) -> bool:
        """Refuse a second stream while an op is in flight; return True when the
        stream is being captured into a CUDA graph."""
        if self._error is not None:
            raise self._error
        if self.arena.error_code():
            self.check()
        if self._host_epoch >= _EPOCH_LIMIT:
            self._error = DpSampleError(
                f"this communicator issued {self._host_epoch} ops; its 32-bit epoch would wrap "
                "into stale packets: close it and build a new one"
            )
            raise self._error
        capturing = self._runtime.streamIsCapturing(handle) != 0
        if capturing:
            self._graphed = True
        last = self._last_stream
        if last != handle and self._claim_stream is not None:
            self._claim_stream(self._stream_owner, handle)
        if last is not None and last != handle and self._event_recorded and not capturing:
            if not self._event.done:
                raise DpSampleError(
                    f"op issued on stream {handle:#x} while this communicator's previous op on "
                    f"stream {last:#x} is still in flight: one op at a time per communicator "
                    "(synchronise the streams, or use one communicator per stream)"
                )
        return capturing

    def _end(self, handle: int, capturing: bool) -> None:
        # a captured op runs later, at replay: it must not change which stream (and
        # which in-flight event) the next eager op is compared with
        if not capturing:
            self._last_stream = handle
            self._runtime.eventRecord(self._event_ptr, handle)
            self._event_recorded = True

    def _view(self, kind: ArrayKind, key: Any, ptr: int, shape: tuple[int, ...], dtype: str) -> Any:
        k = (key, kind)
        v = self._views.get(k)
        if v is None:
            v = make_view(kind, ptr, shape, dtype, self.device, owner=self)
            self._views[k] = v
        return v

    def _sig(self, op: str, dtype: str, pad_bs: int, fixed_output: bool = False) -> int:
        return pack_signature(op, dtype, pad_bs, fixed_output)

    # -- swap ---------------------------------------------------------------------
    def _swap_plan(self, pad_bs: int) -> tuple[_Launch, _Launch, _Launch]:
        """Launches for ``pad_bs``: (eager push into the ping-pong regions, graph-mode
        entry barrier, graph-mode push into the fixed output); with
        ``IPC_DPSAMPLE_GRAPH_SWAP=copy`` the second is the copy into the fixed output
        and the third is unused."""
        plan = self._swap_plans.get(pad_bs)
        if plan is None:
            cfg, lay = self.cfg, self.layout
            assert self._logits_dtype is not None
            itemsize = ITEMSIZE[self._logits_dtype]
            rows = pad_bs // cfg.tp_size * cfg.num_tokens_per_req
            shard_bytes = cfg.vocab_size // cfg.tp_size * itemsize
            chunks = max(1, -(-shard_bytes // SWAP_CHUNK))
            chunk_bytes = max(16, (-(-shard_bytes // chunks) + 15) // 16 * 16)
            tiles = cfg.tp_size * rows * chunks
            grid = max(1, min(tiles, self._sm_count * SWAP_CTAS_PER_SM))
            block = swap_block(chunk_bytes, cfg.tp_size) if SWAP_FIT else SWAP_BLOCK
            sigs = [
                self._sig("swap_batch_vocab", self._logits_dtype, pad_bs, fixed)
                for fixed in (False, True)
            ]
            table, ctrl, err = (
                int(self._table.data.ptr),
                self.arena.ptr + lay.ctrl_off,
                self.arena.err_host,
            )

            def push(region_off: int, parity_mask: int, sig: int) -> _Launch:
                return _Launch(
                    self._swap,
                    self.device,
                    grid,
                    block,
                    (
                        0,  # the input pointer, set per call
                        table,
                        ctrl,
                        err,
                        region_off,
                        lay.swap_region_bytes,
                        lay.flags_off,
                        cfg.rank,
                        cfg.tp_size,
                        rows,
                        shard_bytes,
                        cfg.vocab_size * itemsize,
                        chunks,
                        chunk_bytes,
                        sig,
                        self._timeout_ns,
                        parity_mask,
                    ),
                    n_var=1,
                )

            enter = _Launch(
                self._enter,
                self.device,
                1,
                32 * -(-cfg.tp_size // 32),
                (
                    table,
                    ctrl,
                    err,
                    lay.ready_off,
                    lay.flags_off,
                    cfg.rank,
                    cfg.tp_size,
                    sigs[1],
                    self._timeout_ns,
                ),
                n_var=0,
            )
            eager = push(lay.swap_off, self._parity_mask, sigs[0])
            if GRAPH_SWAP == "copy":
                nbytes = rows * cfg.vocab_size * itemsize
                copy_out = _Launch(
                    self._copy_out,
                    self.device,
                    max(1, min(1024, nbytes // 65536)),
                    SWAP_BLOCK,
                    (
                        ctrl,
                        self.arena.ptr + lay.swap_off,
                        lay.swap_region_bytes,
                        self.arena.ptr + lay.swap_fixed_off,
                        nbytes,
                        self._parity_mask,
                    ),
                    n_var=0,
                )
                plan = (eager, copy_out, eager)  # graphed: push, then copy out
            else:
                plan = (eager, enter, push(lay.swap_fixed_off, 0, sigs[1]))
            self._swap_plans[pad_bs] = plan
        return plan

    def swap_batch_vocab(self, x: Any, info: ArrayInfo, *, pad_bs: int, stream: Any) -> Any:
        handle = resolve_stream(info.kind, stream, self.device)
        capturing = self._begin(handle)
        push, enter, push_fixed = self._swap_plan(pad_bs)
        try:
            if self._graphed and GRAPH_SWAP == "copy":
                push(handle, info.ptr)
                enter(handle)  # the copy into the fixed output
            elif self._graphed:
                enter(handle)
                push_fixed(handle, info.ptr)
            else:
                push(handle, info.ptr)
        except Exception as exc:
            self._error = DpSampleError(f"swap launch failed ({exc}); close this communicator")
            raise self._error from exc
        cfg, lay = self.cfg, self.layout
        dtype = self._logits_dtype
        assert dtype is not None
        shape = (pad_bs // cfg.tp_size * cfg.num_tokens_per_req, cfg.vocab_size)
        if self._graphed:
            fixed = self.arena.ptr + lay.swap_fixed_off
            out = self._view(info.kind, ("swap", pad_bs, "fixed"), fixed, shape, dtype)
        else:
            self._host_epoch += 1
            parity = self._host_epoch & self._parity_mask
            ptr = self.arena.ptr + lay.swap_off + parity * lay.swap_region_bytes
            out = self._view(info.kind, ("swap", pad_bs, parity), ptr, shape, dtype)
        self._end(handle, capturing)
        return out

    # -- gathers ------------------------------------------------------------------
    def _gather_plan(self, kind: int, pad_bs: int) -> _Launch:
        key = (kind, pad_bs)
        plan = self._gather_plans.get(key)
        if plan is None:
            cfg, lay, base = self.cfg, self.layout, self.arena.ptr
            if kind == 0:
                outs = (
                    base + lay.out_predict_off,
                    base + lay.out_accept_index_off,
                    base + lay.out_accept_length_off,
                )
                sig = self._sig("gather_verify_outputs", "int32", pad_bs)
            else:
                outs = (base + lay.out_logprobs_off, 0, 0)
                sig = self._sig("gather_verify_logprobs", "int32", pad_bs)
            args = (
                *(0, 0, 0),  # the input pointers, set per call
                *outs,
                int(self._table.data.ptr),
                base + lay.ctrl_off,
                self.arena.err_host,
                lay.ll_off,
                lay.ll_region_bytes,
                lay.ll_slots,
                lay.flags_off,
                cfg.rank,
                cfg.tp_size,
                pad_bs // cfg.tp_size,
                cfg.num_tokens_per_req,
                kind,
                sig,
                self._timeout_ns,
                self._parity_mask,
            )
            plan = _Launch(self._gather, self.device, 1, GATHER_BLOCK, args, n_var=3)
            self._gather_plans[key] = plan
        return plan

    def _launch_gather(
        self, kind: int, ptrs: tuple[int, int, int], info: ArrayInfo, pad_bs: int, stream: Any
    ) -> bool:
        handle = resolve_stream(info.kind, stream, self.device)
        capturing = self._begin(handle)
        launch = self._gather_plan(kind, pad_bs)
        try:
            launch(handle, *ptrs)
        except Exception as exc:
            self._error = DpSampleError(f"gather launch failed ({exc}); close this communicator")
            raise self._error from exc
        if not self._graphed:
            self._host_epoch += 1
        self._end(handle, capturing)
        return capturing

    def gather_verify_outputs(
        self,
        predict: Any,
        accept_index: Any,
        accept_length: Any,
        info: ArrayInfo,
        *,
        pad_bs: int,
        stream: Any,
    ) -> tuple[Any, Any, Any]:
        ptrs = (info.ptr, _ptr(accept_index, info.kind), _ptr(accept_length, info.kind))
        self._launch_gather(0, ptrs, info, pad_bs, stream)
        k = info.kind
        outs = self._views.get((("verify_outputs", pad_bs), k))
        if outs is None:  # the three views, built once per (pad_bs, array type)
            lay, base, n = self.layout, self.arena.ptr, self.cfg.num_tokens_per_req
            outs = (
                self._view(
                    k, ("predict", pad_bs), base + lay.out_predict_off, (pad_bs, n), "int32"
                ),
                self._view(
                    k,
                    ("accept_index", pad_bs),
                    base + lay.out_accept_index_off,
                    (pad_bs, n),
                    "int32",
                ),
                self._view(
                    k,
                    ("accept_length", pad_bs),
                    base + lay.out_accept_length_off,
                    (pad_bs,),
                    "int32",
                ),
            )
            self._views[(("verify_outputs", pad_bs), k)] = outs
        return outs

    def gather_verify_logprobs(
        self, logprobs: Any, info: ArrayInfo, *, pad_bs: int, stream: Any
    ) -> Any:
        self._launch_gather(1, (info.ptr, 0, 0), info, pad_bs, stream)
        lay, n = self.layout, self.cfg.num_tokens_per_req
        return self._view(
            info.kind,
            ("logprobs", pad_bs),
            self.arena.ptr + lay.out_logprobs_off,
            (pad_bs, n),
            "float32",
        )

    def poison_for_testing(self, byte: int = 0xFF) -> None:
        """Fill every swap region and gather output with ``byte`` (tests call this
        between ops, after a group barrier, to prove every output element is
        written). Synchronous."""
        lay = self.layout
        rt = self._runtime
        rt.memset(self.arena.ptr + lay.swap_off, byte, 3 * lay.swap_region_bytes)
        rt.memset(self.arena.ptr + lay.out_predict_off, byte, lay.total_bytes - lay.out_predict_off)
        rt.deviceSynchronize()

    # -- errors and lifetime ------------------------------------------------------
    def check(self) -> None:
        if self._error is not None:
            raise self._error
        code, rank, peer, op, expected, seen_sig, seen = self.arena.read_error()
        if code == 0:
            return
        op_name = OP_NAMES.get(op, f"op {op}")
        seen_epoch = seen >> 32
        if code == 1:
            self._error = PeerTimeoutError(
                f"rank {rank}: peer rank {peer} did not take part in {op_name} (epoch "
                f"{expected}) within {self.cfg.timeout_s:g} s; last word seen from it: epoch "
                f"{seen_epoch}. The peer died, stalled, or skipped the op; this communicator is "
                "unusable: close it and build a new one"
                + (
                    " (ranks here are threads of one process: a rank that allocated, memset or "
                    "copied GPU memory while a peer's op was in flight can stall it until this "
                    "timeout; see ipc_dpsample.testing.run_threads)"
                    if self._claim_stream is not None
                    else ""
                ),
                rank=rank,
                peer=peer,
                op=op_name,
                expected_epoch=expected,
                seen_epoch=seen_epoch,
            )
        else:
            p_op, p_dtype, p_pad = unpack_signature(seen_sig)
            peer_mode = " in CUDA-graph mode" if signature_mode(seen_sig) == "graph" else ""
            own_mode = " in CUDA-graph mode" if self._graphed and op == 1 else ""
            self._error = DpSampleError(
                f"rank {rank}: peer rank {peer} called {p_op}(pad_bs={p_pad}, dtype={p_dtype})"
                f"{peer_mode} while this rank called {op_name}{own_mode} at epoch {expected}: "
                "the ranks' call sequences diverged (every rank must call the same ops with the "
                "same pad_bs, and start capturing CUDA graphs at the same op). This "
                "communicator is unusable: close it and build a new one"
            )
        raise self._error

    def close(self) -> None:
        self._views.clear()
        _teardown(self.group, self.arena, self._opened, self._peer_recs, self.cfg.timeout_s)
        self._table = None


def _ptr(x: Any, kind: ArrayKind) -> int:
    if kind is ArrayKind.TORCH:
        return int(x.data_ptr())
    if kind is ArrayKind.CUPY:
        return int(x.data.ptr)
    return int(x.__cuda_array_interface__["data"][0])

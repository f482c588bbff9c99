"""The one-sided backend: ops as prepared kernel launches on the arena.

Protocol (``kernels/onesided.cu``, DESIGN.md "The one-sided protocol"):

* op ``e`` (epochs start at 1, kept and advanced in device memory) uses receive
  region and flag parity ``e & 1``; a peer can be at most one op ahead, so the
  output of op ``e`` stays intact until this rank issues its next op;
* swap: every CTA pushes its tiles of real rows into the destination's region,
  fences and bumps a counter; the last CTA writes ``flags[e&1][rank] = e << 32 |
  signature`` on every peer with release semantics and waits (acquire) for every
  peer's flag;
* gathers: one CTA; each 4-byte value of a real request travels with its epoch in
  one 8-byte LL packet; the receiver spins until every real slot shows the epoch
  and unpacks into persistent outputs;
* argmax: every rank reduces its shard's real rows to (max, index, sum of exp)
  partials and sends them as LL packets to the rows' owner, which combines them;
* the signature carries op, dtype, ``pad_bs``, ``bs`` and the graph mode; every
  spin is bounded by ``%globaltimer``; a timeout or a signature mismatch is
  written to a host-mapped error block, marks the communicator broken, and is
  raised by the host at the next call or :meth:`check`.

Swap outputs: eagerly issued swaps return a view of the region the op wrote (no
extra copy). Once any op has been captured into a CUDA graph the host can no
longer know the device epoch's parity, and a captured consumer reads one fixed
address; from then on every swap runs its ``graphed`` launches: an entry barrier
(``dp_swap_enter``) and the push straight into one fixed output region, or with
``IPC_DPSAMPLE_GRAPH_SWAP=copy`` the eager push and a copy into it.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

from ...arrays import ArrayInfo, resolve_stream
from ...config import CommConfig
from ...envs import OnesidedTuning
from ...errors import DpSampleError, PeerTimeoutError
from ...group import HostGroup
from ...kernel_cache import get_kernel
from ...layout import VerifyParams
from ...protocol import Call, Dtype, Op, divergence_message
from ..base import Backend, DeviceVerifyParams, RealRows
from ..common import InFlightGuard, PreparedLaunch, ViewCache, array_ptr
from ..verify_plan import (
    DV_MAX_N,
    DV_MERGE_MAX,
    VERIFY_BLOCK_FEW_ROWS,
    VERIFY_BLOCK_MANY_ROWS,
    call_digest,
    device_list_cap,
    kernel_path_refusal,
    list_cap,
    pack_params,
    param_bytes,
    param_offsets,
    verify_block,
    verify_broadcast,
    verify_splits,
)
from ..verify_swap import verify_by_swap
from .arena import SOURCE, Connection, teardown
from .contract import (
    ERR_PARAMS,
    ERR_TIMEOUT,
    ERR_VALUE,
    DpErrorBlock,
    pack_signature,
    unpack_signature,
)

__all__ = ["OnesidedBackend", "SwapPlan", "swap_block"]

GATHER_BLOCK = 512
_EPOCH_LIMIT = 2**32 - 4  # epochs are 32-bit in the flags and LL packets
_KERNELS = (
    "dp_swap_push",
    "dp_gather_ll",
    "dp_swap_enter",
    "dp_swap_copy_out",
    "dp_argmax",
    "dp_verify_push",
    "dp_verify_push_nolist",
    "dp_verify_finish",
)
VERIFY_BLOCK = 256  # DV_BLOCK in verify.cuh: the most threads of a verify CTA
#: DP_ERR_VALUE reasons (verify.cuh DV_BAD_*): (argument, expected, int or float bits)
VALUE_ERRORS = {
    1: ("temperature", "a finite value >= 0 (0 = greedy)", "f"),
    2: ("top_k", "1..128, or 0 / >= vocab_limit (incl. 1 << 30) for off", "i"),
    3: ("top_p", "0 < top_p <= 1 (1 = off)", "f"),
    4: ("min_p", "0 <= min_p < 1 (0 = off)", "f"),
    5: (
        "top_p / min_p",
        "top-k on for that request (the kernels decide top-p and min-p only within "
        "top-k; without top-k pass the parameters as host arrays, which moves the logits)",
        "f",
    ),
}
ARGMAX_BLOCK = 256  # DP_ARGMAX_BLOCK in onesided.cu
#: argmax CTAs per SM: one CTA reduces one row at a time, and several ranks' CTAs
#: share the SMs when ranks share a GPU
ARGMAX_CTAS_PER_SM = 4


def _resident_ctas(kernel: Any, block: int) -> int:
    """CTAs of ``block`` threads of ``kernel`` (a loaded ``cupy.RawKernel``) that fit on
    one SM at once, by the driver's occupancy calculator (its registers and static shared
    memory); ``ARGMAX_CTAS_PER_SM`` when the driver cannot say."""
    import cupy

    try:
        func = getattr(kernel, "kernel", kernel)  # RawKernel -> its cuda.function.Function
        n = int(cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(func.ptr, block, 0))
    except Exception:  # an old driver or CuPy without the call: the fixed guess
        return ARGMAX_CTAS_PER_SM
    return n if n > 0 else ARGMAX_CTAS_PER_SM


def swap_block(chunk_bytes: int, tp: int, tuning: OnesidedTuning) -> int:
    """Threads per swap CTA: the fewest warps that move a ``chunk_bytes`` chunk in one
    round of ``unroll`` 16-byte loads per thread (at most ``tuning.block``, at least
    ``tp``: thread t signals peer t). A 512-thread CTA moves 32 KiB per round; a
    chunk of 25 KiB (V/tp fp32 rows at tp=8, V=152064, cut in three) would leave a
    quarter of its lanes idle in every round."""
    if not tuning.fit:
        return max(tuning.block, 32 * -(-tp // 32))
    warps = -(-chunk_bytes // (32 * 16 * tuning.unroll))
    return max(32 * -(-tp // 32), min(tuning.block, 32 * warps))


class SwapPlan(NamedTuple):
    """The launches of one swap shape, each run in order on the op's stream.

    ``eager``: the push into the ping-pong regions. ``graphed``: what a swap runs
    once ops are captured in CUDA graphs (entry barrier + push into the fixed
    output, or push + copy into it). Every launch takes a suffix of the per-call
    values ``(input, bs_ptr, bs_host)``. ``pushes`` are the launches whose grid
    follows the real rows (:meth:`grid`); the others keep theirs.
    """

    eager: tuple[PreparedLaunch, ...]
    graphed: tuple[PreparedLaunch, ...]
    pushes: tuple[PreparedLaunch, ...]
    tiles_per_req: int  # tiles of one request: N rows x chunks per row
    max_grid: int  # SMs x IPC_DPSAMPLE_SWAP_CTAS_PER_SM

    def grid(self, bs: int) -> int:
        """The push's grid for ``bs`` requests: a CTA per tile up to the cap. A host
        ``bs`` launches no CTA without a tile; a device ``bs`` (``RealRows.bs`` is
        then ``pad_bs``) gets the padded batch's grid, whose extra CTAs leave at
        once (``dp_swap_push``)."""
        return max(1, min(self.max_grid, bs * self.tiles_per_req))


def _run(
    launches: tuple[PreparedLaunch, ...],
    handle: int,
    values: tuple[int, ...],
    resized: tuple[PreparedLaunch, ...] = (),
    grid: int = 0,
) -> None:
    for launch in launches:
        var = values[len(values) - launch.n_var :]
        launch(handle, *var, grid=grid if launch in resized else 0)


class OnesidedBackend(Backend):
    """One-sided CUDA IPC backend on a verified :class:`Connection`."""

    name = "onesided"
    device_verify_params = True

    def __init__(
        self,
        cfg: CommConfig,
        group: HostGroup,
        device: int,
        conn: Connection,
        tuning: OnesidedTuning,
        single_buffer: bool = False,
    ):
        import cupy

        self.cfg, self.group, self.device, self.tuning = cfg, group, device, tuning
        self.conn = conn
        self.arena = conn.arena
        self.layout = lay = conn.arena.layout
        self._parity_mask = 0 if single_buffer else 1
        self._desc = bytes(
            lay.descriptor(
                peers=int(conn.table.data.ptr),
                base=self.arena.ptr,
                err=self.arena.err_host,
                timeout_ns=int(cfg.timeout_s * 1e9),
                rank=cfg.rank,
                parity_mask=self._parity_mask,
            )
        )
        opts = tuning.compile_options
        self._kernels = {k: get_kernel(SOURCE, k, device, opts) for k in _KERNELS}
        # cuFuncGetAttribute forces the (lazy) load now: never inside a stream capture,
        # and never while a peer's kernel spins (loading may synchronise the context)
        for kernel in self._kernels.values():
            _ = kernel.max_threads_per_block
        self._sm_count = int(cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"])
        self._max_argmax_grid = self._sm_count * ARGMAX_CTAS_PER_SM
        # the most ranks of the group on one GPU (every rank sees the same records)
        uuids = Counter(r.gpu_uuid for r in conn.peer_recs if r.gpu_uuid)
        self._gpu_sharing = max(uuids.values()) if uuids else 1
        # the record kernels loop over rows: as many CTAs as fit on the GPU at once (their
        # registers and shared memory decide how many), so no CTA waits for a second wave
        self._resident_grid = {
            (name, block): self._sm_count * _resident_ctas(self._kernels[name], block)
            for name in ("dp_verify_push", "dp_verify_push_nolist")
            for block in (VERIFY_BLOCK_FEW_ROWS, VERIFY_BLOCK_MANY_ROWS)
        }
        self._err = DpErrorBlock.from_address(self.arena.err_host)
        self._err_code = ctypes.c_uint32.from_address(self.arena.err_host)
        self._error: DpSampleError | None = None
        self._logits_dtype: str | None = None
        self._host_epoch = 0
        self._graphed = False
        self._views = ViewCache(device, owner=self)
        self._swap_plans: dict[int, SwapPlan] = {}
        self._gather_plans: dict[tuple[int, int], PreparedLaunch] = {}
        self._argmax_plans: dict[tuple[int, int], PreparedLaunch] = {}
        self._verify_plans: dict[
            tuple[int, int, bool, bool], tuple[PreparedLaunch, PreparedLaunch, int]
        ] = {}
        self._verify_bufs: Any = None  # this rank's results and host parameters (below)
        #: "kernels" or "swap: <why>": how the last verify_batch_vocab ran (tests, bench)
        self.last_verify_path = ""
        #: whether the last verify_batch_vocab on the kernels broadcast its records
        #: (verify_plan.verify_broadcast; tests, bench)
        self.last_verify_broadcast = False
        #: the last op issued was verify_batch_vocab on its kernels (check()'s hint)
        self._verify_last = False
        # ranks that are threads of one process must not share a stream
        claim = getattr(group, "claim_stream", None) if cfg.tp_size > 1 else None
        self._threads = claim is not None
        self._guard = InFlightGuard(
            device, cfg.rank, None if claim is None else (lambda h: claim(device, h))
        )
        self._runtime = cupy.cuda.runtime
        self._verify_buffers()  # at construction, with the kernels: never behind a peer's op
        if cfg.logits_dtype is not None:
            self.prepare(cfg.logits_dtype)

    # -- plumbing -----------------------------------------------------------------
    def prepare(self, logits_dtype: str) -> None:
        if Dtype.of(logits_dtype).itemsize > self.layout.itemsize:
            raise ValueError(
                f"logits_dtype={logits_dtype} needs {Dtype.of(logits_dtype).itemsize}-byte "
                f"elements; the arena was sized for {self.layout.itemsize}"
            )
        if logits_dtype != self._logits_dtype:
            self._logits_dtype = logits_dtype
            self._swap_plans.clear()
            self._argmax_plans.clear()
            self._verify_plans.clear()
            self._views.drop(lambda key: isinstance(key, tuple) and key[0] == "swap")

    def _begin(self, handle: int) -> bool:
        """Raise a pending error, refuse a second stream while an op is in flight;
        return True when the stream is being captured into a CUDA graph."""
        if self._error is not None:
            raise self._error
        if self._err_code.value:
            self.check()
        if self._host_epoch >= _EPOCH_LIMIT:
            self._error = DpSampleError(
                f"this communicator issued {self._host_epoch} ops; its 32-bit epoch would wrap "
                "into stale packets: close it and build a new one"
            )
            raise self._error
        capturing = self._guard.begin(handle)
        if capturing:
            self._graphed = True
        self._verify_last = False
        return capturing

    def _issue(
        self,
        launches: tuple[PreparedLaunch, ...],
        handle: int,
        values: tuple[int, ...],
        op: Op,
        resized: tuple[PreparedLaunch, ...] = (),
        grid: int = 0,
    ) -> None:
        try:
            _run(launches, handle, values, resized, grid)
        except Exception as exc:
            self._error = DpSampleError(
                f"{op.api_name} launch failed ({exc}); close this communicator"
            )
            raise self._error from exc

    def _sig(self, op: Op, dtype: str, pad_bs: int, graph: bool = False) -> int:
        return pack_signature(op, Dtype.of(dtype), pad_bs, graph)

    def _launch(self, name: str, grid: int, block: int, args: tuple[int | bytes, ...], n_var: int):
        return PreparedLaunch(self._kernels[name], self.device, grid, block, args, n_var)

    # -- swap ---------------------------------------------------------------------
    def _swap_plan(self, pad_bs: int) -> SwapPlan:
        plan = self._swap_plans.get(pad_bs)
        if plan is not None:
            return plan
        cfg, lay, tun, desc = self.cfg, self.layout, self.tuning, self._desc
        dtype = self._logits_dtype
        assert dtype is not None
        itemsize = Dtype.of(dtype).itemsize
        rows = pad_bs // cfg.tp_size * cfg.num_tokens_per_req
        shard_bytes = cfg.vocab_size // cfg.tp_size * itemsize
        chunks = max(1, -(-shard_bytes // tun.chunk))
        chunk_bytes = max(16, (-(-shard_bytes // chunks) + 15) // 16 * 16)
        max_grid = self._sm_count * tun.ctas_per_sm
        grid = max(1, min(cfg.tp_size * rows * chunks, max_grid))
        block = swap_block(chunk_bytes, cfg.tp_size, tun)

        def push(region_off: int, parity_mask: int, graph: bool) -> PreparedLaunch:
            sig = self._sig(Op.SWAP, dtype, pad_bs, graph)
            args = (0, 0, 0, desc, pad_bs, shard_bytes, chunks, chunk_bytes, sig)
            return self._launch("dp_swap_push", grid, block, (*args, region_off, parity_mask), 3)

        eager = push(lay.swap_off, self._parity_mask, False)
        if tun.graph_swap == "copy":
            nbytes = rows * cfg.vocab_size * itemsize
            copy_out = self._launch(
                "dp_swap_copy_out",
                max(1, min(1024, nbytes // 65536)),
                tun.block,
                (0, 0, desc, pad_bs, cfg.vocab_size * itemsize, self._parity_mask),
                2,
            )
            graphed: tuple[PreparedLaunch, ...] = (eager, copy_out)
            pushes: tuple[PreparedLaunch, ...] = (eager,)
        else:
            sig = self._sig(Op.SWAP, dtype, pad_bs, True)
            tp_threads = 32 * -(-cfg.tp_size // 32)
            enter = self._launch("dp_swap_enter", 1, tp_threads, (0, 0, desc, pad_bs, sig), 2)
            graphed = (enter, push(lay.swap_fixed_off, 0, True))
            pushes = (eager, graphed[1])
        tiles_per_req = cfg.num_tokens_per_req * chunks
        plan = self._swap_plans[pad_bs] = SwapPlan(
            (eager,), graphed, pushes, tiles_per_req, max_grid
        )
        return plan

    def swap_batch_vocab(
        self, x: Any, info: ArrayInfo, *, pad_bs: int, bs: RealRows, stream: Any
    ) -> Any:
        handle = resolve_stream(info.kind, stream, self.device)
        capturing = self._begin(handle)
        plan = self._swap_plan(pad_bs)
        graphed = self._graphed
        launches = plan.graphed if graphed else plan.eager
        values = (info.ptr, bs.ptr, bs.bs)
        self._issue(launches, handle, values, Op.SWAP, plan.pushes, plan.grid(bs.bs))
        cfg, lay = self.cfg, self.layout
        dtype = self._logits_dtype
        assert dtype is not None
        shape = (pad_bs // cfg.tp_size * cfg.num_tokens_per_req, cfg.vocab_size)
        if graphed:
            ptr, key = self.arena.ptr + lay.swap_fixed_off, ("swap", pad_bs, "fixed")
        else:
            self._host_epoch += 1
            parity = self._host_epoch & self._parity_mask
            ptr = self.arena.ptr + lay.swap_off + parity * lay.swap_region_bytes
            key = ("swap", pad_bs, parity)
        out = self._views.get(info.kind, key, ptr, shape, dtype)
        self._guard.end(handle, capturing)
        return out

    # -- gathers ------------------------------------------------------------------
    def _gather(
        self,
        kind: int,
        ptrs: tuple[int, int, int],
        info: ArrayInfo,
        pad_bs: int,
        bs: RealRows,
        stream: Any,
    ) -> None:
        handle = resolve_stream(info.kind, stream, self.device)
        capturing = self._begin(handle)
        op = Op.GATHER_OUTPUTS if kind == 0 else Op.GATHER_LOGPROBS
        launch = self._gather_plans.get((kind, pad_bs))
        if launch is None:
            sig = self._sig(op, "int32", pad_bs)
            args = (0, 0, 0, 0, 0, self._desc, pad_bs, kind, sig)
            launch = self._launch("dp_gather_ll", 1, GATHER_BLOCK, args, 5)
            self._gather_plans[(kind, pad_bs)] = launch
        self._issue((launch,), handle, (*ptrs, bs.ptr, bs.bs), op)
        if not self._graphed:
            self._host_epoch += 1
        self._guard.end(handle, capturing)

    def gather_verify_outputs(
        self,
        predict: Any,
        accept_index: Any,
        accept_length: Any,
        info: ArrayInfo,
        *,
        pad_bs: int,
        bs: RealRows,
        stream: Any,
    ) -> tuple[Any, Any, Any]:
        k = info.kind
        ptrs = (info.ptr, array_ptr(accept_index, k), array_ptr(accept_length, k))
        self._gather(0, ptrs, info, pad_bs, bs, stream)
        base, lay, n = self.arena.ptr, self.layout, self.cfg.num_tokens_per_req
        specs = (
            (base + lay.out_off("predict"), (pad_bs, n), "int32"),
            (base + lay.out_off("accept_index"), (pad_bs, n), "int32"),
            (base + lay.out_off("accept_length"), (pad_bs,), "int32"),
        )
        return self._views.get_many(k, ("verify_outputs", pad_bs), specs)  # type: ignore[return-value]

    def gather_verify_logprobs(
        self, logprobs: Any, info: ArrayInfo, *, pad_bs: int, bs: RealRows, stream: Any
    ) -> Any:
        self._gather(1, (info.ptr, 0, 0), info, pad_bs, bs, stream)
        ptr = self.arena.ptr + self.layout.out_off("logprobs")
        shape = (pad_bs, self.cfg.num_tokens_per_req)
        return self._views.get(info.kind, ("logprobs", pad_bs), ptr, shape, "float32")

    # -- argmax -------------------------------------------------------------------
    def argmax_batch_vocab(
        self,
        x: Any,
        info: ArrayInfo,
        *,
        pad_bs: int,
        vocab_limit: int,
        bs: RealRows,
        stream: Any,
    ) -> tuple[Any, Any]:
        handle = resolve_stream(info.kind, stream, self.device)
        capturing = self._begin(handle)
        cfg = self.cfg
        dtype = self._logits_dtype
        assert dtype is not None
        launch = self._argmax_plans.get((pad_bs, vocab_limit))
        if launch is None:
            sig = self._sig(Op.ARGMAX, dtype, pad_bs)
            rows = pad_bs * cfg.num_tokens_per_req
            grid = max(1, min(rows, self._max_argmax_grid))
            vs = cfg.vocab_size // cfg.tp_size
            args = (0, 0, 0, self._desc, pad_bs, vs, vocab_limit, int(Dtype.of(dtype)), sig)
            launch = self._launch("dp_argmax", grid, ARGMAX_BLOCK, args, 3)
            self._argmax_plans[(pad_bs, vocab_limit)] = launch
        # a CTA per real row up to the cap (a device bs: pad_bs's grid, as for the swap)
        grid = max(1, min(bs.bs * cfg.num_tokens_per_req, self._max_argmax_grid))
        self._issue((launch,), handle, (info.ptr, bs.ptr, bs.bs), Op.ARGMAX, (launch,), grid)
        if not self._graphed:
            self._host_epoch += 1
        self._guard.end(handle, capturing)
        base, lay = self.arena.ptr, self.layout
        shape = (pad_bs // cfg.tp_size * cfg.num_tokens_per_req,)
        specs = (
            (base + lay.out_off("argmax_ids"), shape, "int32"),
            (base + lay.out_off("argmax_logprobs"), shape, "float32"),
        )
        return self._views.get_many(info.kind, ("argmax", pad_bs), specs)  # type: ignore[return-value]

    # -- verify -------------------------------------------------------------------
    def _thread_barrier(self, what: str) -> Callable[[], None] | None:
        """A host barrier of the rank threads (None when ranks are processes): see
        :func:`~ipc_dpsample.backends.verify_swap.verify_by_swap`."""
        if not self._threads:
            return None
        group, timeout = self.group, self.cfg.timeout_s
        return lambda: group.barrier(timeout_s=timeout, what=what)

    def _verify_buffers(self) -> Any:
        """This rank's results (int32 predict and accept_index ``[R_max, N]``,
        accept_length ``[R_max]``, float32 logprobs ``[R_max, N]``), which the gathers
        read, and the device copy of host parameters (:func:`~ipc_dpsample.backends.
        verify_plan.pack_params`). Allocated on first use."""
        if self._verify_bufs is None:
            import cupy

            cfg = self.cfg
            r, n = cfg.max_pad_bs // cfg.tp_size, cfg.num_tokens_per_req
            # cupy.empty: an allocation, no kernel (a rank thread that loads or launches
            # a kernel while a peer's op spins can stall it; see the constructor)
            with cupy.cuda.Device(self.device):
                self._verify_bufs = (
                    cupy.empty((r, n), cupy.int32),
                    cupy.empty((r, n), cupy.int32),
                    cupy.empty(r, cupy.int32),
                    cupy.empty((r, n), cupy.float32),
                    cupy.empty(param_bytes(cfg.max_pad_bs), cupy.uint8),
                )
        return self._verify_bufs

    def _verify_plan(
        self, pad_bs: int, vocab_limit: int, lists: bool, broadcast: bool
    ) -> tuple[PreparedLaunch, PreparedLaunch, int]:
        """``(push, finish, push grid limit)``; ``lists``: some row may have top-k (the
        push with the selection's shared memory), else ``dp_verify_push_nolist``;
        ``broadcast``: every record to every rank, the finish writing every request's
        results into the arena's outputs (else this rank's into its own buffers, which
        the gathers send)."""
        key = (pad_bs, vocab_limit, lists, broadcast)
        plan = self._verify_plans.get(key)
        if plan is not None:
            return plan
        cfg, lay, desc = self.cfg, self.layout, self._desc
        dtype = self._logits_dtype
        assert dtype is not None
        if broadcast:
            names = ("predict", "accept_index", "accept_length", "logprobs")
            outs = tuple(self.arena.ptr + lay.out_off(name) for name in names)
        else:
            outs = tuple(int(a.data.ptr) for a in self._verify_buffers()[:4])
        sig = self._sig(Op.VERIFY, dtype, pad_bs)
        vs = cfg.vocab_size // cfg.tp_size
        region = (lay.verify_off, lay.verify_region_bytes)
        rows = pad_bs * cfg.num_tokens_per_req
        name = "dp_verify_push" if lists else "dp_verify_push_nolist"
        block = self.tuning.verify_block or verify_block(
            rows=rows,
            gpu_sharing=self._gpu_sharing,
            resident_ctas=self._resident_grid[(name, VERIFY_BLOCK_FEW_ROWS)],
        )
        push_grid = self._resident_grid[(name, block)]
        bcast = int(broadcast)
        push = self._launch(
            name,
            max(1, min(rows, push_grid)),  # the grid of each call: its blocks, at most this
            block,
            (0,) * 14 + (desc, pad_bs, vs, vocab_limit, int(Dtype.of(dtype)), sig, *region, bcast),
            14,
        )
        finish = self._launch(
            "dp_verify_finish",
            max(1, pad_bs if broadcast else pad_bs // cfg.tp_size),
            VERIFY_BLOCK,
            (0,) * 13 + (desc, pad_bs, vocab_limit, sig, *region, *outs, bcast),
            13,
        )
        plan = self._verify_plans[key] = (push, finish, push_grid)
        return plan

    def _host_param_pointers(self, params: VerifyParams, handle: int) -> tuple[int, ...]:
        """Copy the normalised host parameters to the device (in stream order) and
        return the six array addresses the kernels read."""
        buf = self._verify_buffers()[4]
        packed = pack_params(params)
        # a pageable source: the call returns once the bytes are staged
        self._runtime.memcpyAsync(int(buf.data.ptr), packed.ctypes.data, packed.nbytes, 1, handle)
        base = int(buf.data.ptr)
        return tuple(base + off for off in param_offsets(params.pad_bs))

    def verify_batch_vocab(
        self,
        x: Any,
        info: ArrayInfo,
        candidates: Any,
        candidates_info: ArrayInfo,
        *,
        pad_bs: int,
        params: VerifyParams | DeviceVerifyParams,
        return_logprobs: bool,
        bs: RealRows,
        stream: Any,
    ) -> tuple[Any, ...]:
        """Two launches (``dp_verify_push``: records into the owners' arenas, one
        signal round; ``dp_verify_finish``: the owners' combine and accept chain), then
        ``dp_gather_ll`` of the results (and of the logprobs). Small batches
        (:func:`~ipc_dpsample.backends.verify_plan.verify_broadcast`) broadcast the
        records instead: every rank's finish combines every request and writes the
        results in place, and no gather runs (one round between the ranks, not two).

        Host parameters (:class:`~ipc_dpsample.layout.VerifyParams`) are copied to the
        device; a batch the kernels cannot decide (top-p or min-p without top-k) takes
        :func:`~ipc_dpsample.backends.verify_swap.verify_by_swap` instead. Device
        parameters (:class:`~ipc_dpsample.backends.base.DeviceVerifyParams`) are read
        by the kernels when they run: nothing is read on the host, so a CUDA graph can
        capture the call; a refused value (out of range, or top-p / min-p without
        top-k) is reported by the kernels and raised at the next call or ``check()``."""
        cfg = self.cfg
        tp = cfg.tp_size
        if isinstance(params, VerifyParams):
            refusal = kernel_path_refusal(params, tp)
            if refusal is not None:
                self.last_verify_path = f"swap: {refusal}"
                self.last_verify_broadcast = False
                return verify_by_swap(
                    self, x, info, candidates, candidates_info, pad_bs=pad_bs, params=params,
                    return_logprobs=return_logprobs, bs=bs, stream=stream, tp=tp,
                    rank=cfg.rank, device=self.device, before_gather=self._thread_barrier(
                        "verify_batch_vocab (swap route): every rank's sampler issued"),
                )  # fmt: skip
            cap = list_cap(params)
        else:
            cap = device_list_cap(params.top_k != 0)
            if cfg.num_tokens_per_req > DV_MAX_N:
                raise DpSampleError(
                    f"verify_batch_vocab with parameters on the device needs N <= {DV_MAX_N} "
                    f"rows per request (the owners' combine holds them), got "
                    f"N={cfg.num_tokens_per_req}; pass the parameters as host arrays"
                )
            if tp * cap > DV_MERGE_MAX:
                raise DpSampleError(
                    f"verify_batch_vocab with top_k on the device at tp={tp}: every request may "
                    f"have top-k up to 128 and the owners' merge holds {DV_MERGE_MAX} entries "
                    f"(tp * 128 <= {DV_MERGE_MAX}); pass the parameters as host arrays"
                )
        handle = resolve_stream(info.kind, stream, self.device)
        if isinstance(params, VerifyParams) and self._runtime.streamIsCapturing(handle) != 0:
            raise DpSampleError(
                "verify_batch_vocab cannot be captured in a CUDA graph with host parameters "
                "(they are copied when the call is made): pass temperature, top_k, top_p, "
                "min_p, seed and offset as arrays on this communicator's device"
            )
        capturing = self._begin(handle)
        n = cfg.num_tokens_per_req
        region_words = self.layout.verify_region_bytes // 4
        broadcast = verify_broadcast(
            rows=pad_bs * n,
            tp=tp,
            cap=cap,
            region_words=region_words,
            mode=self.tuning.verify_broadcast,
        )
        push, finish, push_grid = self._verify_plan(pad_bs, params.vocab_limit, cap > 0, broadcast)
        pred, aidx, alen, lp = self._verify_buffers()[:4]
        if isinstance(params, VerifyParams):
            ptrs = self._host_param_pointers(params, handle)
        else:
            ptrs = params.pointers
        splits = verify_splits(
            rows=pad_bs * n,
            tp=tp,
            vocab_shard=cfg.vocab_size // tp,
            cap=cap,
            # broadcast: every rank's region holds the records of every row
            region_words=region_words // tp if broadcast else region_words,
            gpu_sharing=self._gpu_sharing,
            want=self.tuning.verify_splits,
        )
        digest = call_digest(params.vocab_limit, cap, return_logprobs, n, splits, broadcast)
        cand = candidates_info.ptr
        values = (info.ptr, cand, *ptrs, cap, int(return_logprobs), digest, bs.ptr, bs.bs, splits)
        units = max(1, bs.bs * n * splits)
        self._issue((push,), handle, values, Op.VERIFY, (push,), min(units, push_grid))
        reqs = pad_bs if broadcast else pad_bs // tp
        self._issue((finish,), handle, values[1:], Op.VERIFY, (finish,), max(1, min(reqs, bs.bs)))
        if not self._graphed:
            self._host_epoch += 1
        self._guard.end(handle, capturing)
        self.last_verify_path = "kernels"
        self.last_verify_broadcast = broadcast
        base, lay = self.arena.ptr, self.layout
        specs = [
            (base + lay.out_off("predict"), (pad_bs, n), "int32"),
            (base + lay.out_off("accept_index"), (pad_bs, n), "int32"),
            (base + lay.out_off("accept_length"), (pad_bs,), "int32"),
        ]
        if return_logprobs:
            specs.append((base + lay.out_off("logprobs"), (pad_bs, n), "float32"))
        if not broadcast:  # the owners' results to every rank
            linfo = ArrayInfo(info.kind, int(pred.data.ptr), pred.shape, "int32", self.device, True)
            ptrs3 = (int(pred.data.ptr), int(aidx.data.ptr), int(alen.data.ptr))
            self._gather(0, ptrs3, linfo, pad_bs, bs, stream)
            if return_logprobs:
                self._gather(1, (int(lp.data.ptr), 0, 0), linfo, pad_bs, bs, stream)
        self._verify_last = True
        key = ("verify", pad_bs, return_logprobs)
        return self._views.get_many(info.kind, key, specs)  # type: ignore[return-value]

    # -- tests --------------------------------------------------------------------
    def poison_for_testing(self, byte: int = 0xFF) -> None:
        """Fill every swap region and output with ``byte`` (tests call this between
        ops, after a group barrier, to prove which output elements are written).
        Synchronous."""
        lay, rt, base = self.layout, self._runtime, self.arena.ptr
        rt.memset(base + lay.swap_off, byte, 3 * lay.swap_region_bytes)
        first = lay.out_offsets[0]
        rt.memset(base + first, byte, lay.total_bytes - first)
        rt.deviceSynchronize()

    # -- errors and lifetime ------------------------------------------------------
    def check(self) -> None:
        if self._error is not None:
            raise self._error
        e = self._err
        if self._err_code.value == 0:
            return
        n = self.cfg.num_tokens_per_req
        mine = unpack_signature(e.mine, n)
        seen_epoch = e.seen >> 32
        if e.code == ERR_TIMEOUT:
            hint = (
                " (ranks here are threads of one process: a rank that allocated, memset or "
                "copied GPU memory, or first launched a not yet loaded kernel, while a peer's "
                "op was in flight can stall it until this timeout; see "
                "ipc_dpsample.testing.run_threads)"
                if self._threads
                else ""
            )
            if self._verify_last:
                hint += (
                    ". The last op issued here was verify_batch_vocab: a rank that finds "
                    "that the ranks passed it different arguments (parameters, candidates, "
                    "vocab_limit, bs, return_logprobs) raises that and skips the gathers, "
                    f"which its peers then wait for; see rank {e.peer}'s error"
                )
            self._error = PeerTimeoutError(
                f"rank {e.rank}: peer rank {e.peer} did not take part in {mine.describe()} "
                f"(epoch {e.expected}) within {self.cfg.timeout_s:g} s; last word seen from it: "
                f"epoch {seen_epoch}. The peer died, stalled, or skipped the op; this "
                "communicator is unusable: close it and build a new one" + hint,
                rank=e.rank,
                peer=e.peer,
                op=Op.describe_code(mine.op),
                expected_epoch=e.expected,
                seen_epoch=seen_epoch,
            )
        elif e.code == ERR_VALUE:
            what = VALUE_ERRORS.get(e.expected, ("a parameter", "a valid value", "f"))
            bits = e.seen & 0xFFFFFFFF
            if what[2] == "i":
                shown = str(ctypes.c_int32(bits).value)
            else:
                shown = f"{ctypes.c_float.from_buffer_copy(ctypes.c_uint32(bits)).value:g}"
            self._error = DpSampleError(
                f"rank {e.rank}: verify_batch_vocab read {what[0]}[{e.peer}]={shown} on the "
                f"device; expected {what[1]}. That call's results are undefined and this "
                "communicator is unusable: close it and build a new one"
            )
        elif e.code == ERR_PARAMS:
            self._error = DpSampleError(
                f"rank {e.rank}: peer rank {e.peer} called verify_batch_vocab with different "
                "arguments (per-request parameters, candidates, vocab_limit, bs or "
                f"return_logprobs; its candidate {e.seen >> 32} / digest "
                f"{e.seen & 0xFFFFFFFF:#x} at the first differing row). Every rank must pass "
                "the same values; this communicator is unusable: close it and build a new one"
            )
        else:
            theirs: Call = unpack_signature(e.seen & 0xFFFFFFFF, n)
            self._error = DpSampleError(
                divergence_message(e.rank, e.peer, mine, theirs, "onesided")
            )
        raise self._error

    def close(self) -> None:
        self._views.clear()
        c = self.conn
        teardown(self.group, c.arena, c.opened, c.peer_recs, self.cfg.timeout_s)
        c.table = None

"""What one rank times: a runner per backend (:class:`CommRunner`, through
:class:`~ipc_dpsample.DpSamplingComm`) and per baseline (the copy limit, raw
torch.distributed, raw NCCL through CuPy), with the seeded data and bit-exact
checks they use, and the per-rank context they share (:class:`RankCtx`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...layout import real_reqs
from ..common import OPS, logprobs_close
from .config import BACKEND_CHOICES, LOGITS_OPS, BenchConfig, LaunchPlan, op_bytes

__all__ = [
    "CommRunner",
    "Prepared",
    "RankCtx",
    "Runner",
    "argmax_expected",
    "close_logprobs",
    "make_runner",
    "rand_block",
    "same_bits",
    "swap_expected",
    "swap_input",
]

# -- data ---------------------------------------------------------------------------
_TORCH_NAMES = {"bfloat16", "float16", "float32", "int32"}


def _seed_of(*idx: int) -> int:
    return int(np.random.SeedSequence(list(idx)).generate_state(1, np.uint64)[0] >> 1)


def rand_block(shape: tuple[int, ...], dtype: str, device: Any, *idx: int) -> Any:
    """A seeded random torch tensor: the same on every rank for the same ``idx``."""
    import torch

    assert dtype in _TORCH_NAMES
    g = torch.Generator(device=device)
    g.manual_seed(_seed_of(*idx))
    if dtype == "int32":
        return torch.randint(1, 1 << 20, shape, generator=g, device=device, dtype=torch.int32)
    t = torch.randn(shape, generator=g, device=device, dtype=getattr(torch, dtype))
    return t * 4 if dtype != "float32" else t * 4 - 1e-3


def swap_input(
    seed: int, src: int, tp: int, pad_bs: int, n: int, vocab: int, dtype: str, device: Any
) -> Any:
    """Rank ``src``'s ``local_logits [pad_bs*N, V/tp]``: row block ``dst`` is
    ``rand_block(seed, src, dst)``."""
    import torch

    rows, vs = pad_bs // tp * n, vocab // tp
    return torch.cat(
        [rand_block((rows, vs), dtype, device, seed, 1, src, dst) for dst in range(tp)]
    )


def swap_expected(
    seed: int, dst: int, tp: int, pad_bs: int, n: int, vocab: int, dtype: str, device: Any
) -> Any:
    """What rank ``dst`` must receive from :func:`swap_input` of every rank (column
    block ``s`` is rank ``s``'s row block ``dst``: the layout contract)."""
    import torch

    rows, vs = pad_bs // tp * n, vocab // tp
    return torch.cat(
        [rand_block((rows, vs), dtype, device, seed, 1, src, dst) for src in range(tp)], dim=1
    )


def same_bits(a: Any, b: Any) -> str:
    import torch

    if tuple(a.shape) != tuple(b.shape):
        return f"shape {tuple(a.shape)} != expected {tuple(b.shape)}"
    view = torch.int16 if a.element_size() == 2 else torch.int32
    diff = a.contiguous().view(view) != b.contiguous().view(view)
    bad = int(diff.sum().item())
    return f"{bad} of {a.numel()} elements differ" if bad else ""


def close_logprobs(got: Any, exp: Any, vocab: int) -> str:
    """``""`` when the float32 logprobs ``got`` agree with the float64 reference
    ``exp`` (:func:`argmax_expected`) within the float32 tolerance for rows of
    ``vocab`` counted columns (:func:`~ipc_dpsample.tools.common.logprob_atol`;
    NaN matches NaN), else how many differ and the largest difference."""
    import torch

    g = got.detach().to("cpu", torch.float64).numpy()
    e = exp.detach().to("cpu", torch.float64).numpy()
    return logprobs_close(g, e, vocab)


#: Elements of float64 logits the reference holds at once (256 MB).
_REFERENCE_CHUNK = 1 << 25


def argmax_expected(full: Any, limit: int) -> tuple[Any, Any]:
    """``torch.argmax`` (int32) of every row of ``full [rows, V]`` trimmed to
    ``limit`` columns, and the log-softmax at it computed in float64 (what
    ``argmax_batch_vocab`` returns in float32; a float32 ``log_softmax`` is less
    accurate than the library). Rows go through float64 in chunks of
    ``_REFERENCE_CHUNK`` elements."""
    import torch

    rows = full[:, :limit]
    ids = torch.argmax(rows.float(), dim=1)
    lps = torch.empty(rows.shape[0], dtype=torch.float64, device=rows.device)
    step = max(1, _REFERENCE_CHUNK // max(1, limit))
    for i in range(0, rows.shape[0], step):
        x = rows[i : i + step].double()
        lps[i : i + step] = torch.log_softmax(x, dim=1).gather(1, ids[i : i + step, None])[:, 0]
    return ids.to(torch.int32), lps


# -- rank body ----------------------------------------------------------------------
@dataclass
class Prepared:
    """What one point times.

    Attributes
    ----------
    fn : callable
        One call of the op; returns its output.
    check : callable or None
        ``check(output of fn) -> ""`` when right, else what differs (after a sync).
    graph_key : tuple or None
        Points with the same key replay one captured CUDA graph (the ``bs`` is a
        device value written before the replay); None: a graph of its own.
    bs_arg : {"host", "device", "none"}
        How the op got ``bs``.
    """

    fn: Callable[[], Any]
    check: Callable[[Any], str] | None = None
    graph_key: tuple[Any, ...] | None = None
    bs_arg: str = "none"


class Runner:
    """One backend or baseline on one rank: ``prepare(op, dtype, pad_bs, bs, mode)``
    returns the call to time and an optional check (:class:`Prepared`)."""

    resolved: str | None = None

    def prepare(self, op: str, dtype: str, pad_bs: int, bs: int, mode: str) -> Prepared:
        raise NotImplementedError

    def close(self) -> None:
        return None


class CommRunner(Runner):
    """The package's ops on one communicator per logits dtype (a communicator's dtype
    is fixed once; every rank asks for the dtypes in the same order, so the lazily
    built communicators are built collectively), and the argmax's baselines
    (:data:`~.config.ARGMAX_BASELINES`) on the same data.

    ``bs`` reaches the ops as a host int, except at CUDA-graph points of the
    package's ops with ``--bs``: a device int32 scalar written before the replay,
    so one graph per (op, dtype, pad_bs) serves every ``bs``. The inputs stay the
    same tensors across the ``bs`` of a point for that."""

    def __init__(self, ctx: RankCtx, backend: str) -> None:
        self.ctx = ctx
        self.backend = backend
        self.comms: dict[str | None, Any] = {}
        self.comm = self._comm(None)
        self.resolved = self.comm.backend
        self._data: dict[tuple[Any, ...], Any] = {}
        self._bs_dev: Any = None

    def _comm(self, dtype: str | None) -> Any:
        comm = self.comms.get(dtype)
        if comm is None:
            from ...comm import DpSamplingComm

            cfg, lp, ctx = self.ctx.cfg, self.ctx.lp, self.ctx
            comm = self.comms[dtype] = DpSamplingComm(
                tp_size=lp.tp,
                rank=ctx.rank,
                group=ctx.group,
                max_pad_bs=max(lp.pad_bs),
                num_tokens_per_req=cfg.num_tokens,
                vocab_size=cfg.vocab,
                logits_dtype=dtype,
                backend=self.backend,
                device=ctx.device,
                timeout_s=30.0,
            )
        return comm

    def _cached(self, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
        """One point's data, kept while the next points use it (one entry)."""
        if key not in self._data:
            self._data = {key: make()}
        return self._data[key]

    def _bs_kw(self, op: str, bs: int, mode: str) -> tuple[dict[str, Any], str]:
        import torch

        if not self.ctx.cfg.bs:
            return {}, "none"
        if mode != "graph" or op not in OPS:
            return {"bs": bs}, "host"
        if self._bs_dev is None:
            self._bs_dev = torch.zeros(1, dtype=torch.int32, device=self.ctx.device)
        self._bs_dev.fill_(bs)  # on the rank's stream, before any replay
        return {"bs": self._bs_dev}, "device"

    def prepare(self, op: str, dtype: str, pad_bs: int, bs: int, mode: str) -> Prepared:
        kw, how = self._bs_kw(op, bs, mode)
        key = (op, dtype, pad_bs) if how == "device" else None
        if op in LOGITS_OPS:
            fn, check = self._logits_op(op, dtype, pad_bs, bs, kw)
        else:
            fn, check = self._gather_op(op, pad_bs, bs, kw)
        return Prepared(fn, check, key, how)

    def _logits_op(
        self, op: str, dtype: str, pad_bs: int, bs: int, kw: dict[str, Any]
    ) -> tuple[Callable[[], Any], Callable[[Any], str] | None]:
        import torch

        cfg, r, tp, dev = self.ctx.cfg, self.ctx.rank, self.ctx.lp.tp, self.ctx.device
        n, s, limit = cfg.num_tokens, cfg.seed, cfg.limit
        c = self._comm(dtype)
        x, exp = self._cached(
            (dtype, pad_bs),
            lambda: (
                swap_input(s, r, tp, pad_bs, n, cfg.vocab, dtype, dev),
                swap_expected(s, r, tp, pad_bs, n, cfg.vocab, dtype, dev),
            ),
        )
        real = real_reqs(pad_bs // tp, bs, r) * n  # rows of this rank's real requests
        if op == "read_once":
            shard = x[: bs * n]
            return (lambda: torch.amax(shard, dim=1)), None
        if op == "swap_batch_vocab":
            return (lambda: c.swap_batch_vocab(x, pad_bs=pad_bs, **kw)), (
                lambda got: same_bits(got[:real], exp[:real])
            )
        ids, lps = argmax_expected(exp[:real], limit)
        if op == "swap_argmax":
            # load torch's argmax kernel for this dtype now, locally: loaded lazily
            # behind a spinning swap it would stall the device until the timeout
            torch.argmax(exp[:real, :limit], dim=1)

            def swap_argmax() -> Any:
                y = c.swap_batch_vocab(x, pad_bs=pad_bs, **kw)
                return torch.argmax(y[:real, :limit], dim=1)

            return swap_argmax, (lambda got: same_bits(got.to(torch.int32), ids))

        def argmax() -> Any:
            return c.argmax_batch_vocab(x, pad_bs=pad_bs, vocab_limit=cfg.vocab_limit, **kw)

        def check_argmax(got: Any) -> str:
            bad = same_bits(got[0][:real], ids)
            return f"token ids: {bad}" if bad else close_logprobs(got[1][:real], lps, limit)

        return argmax, check_argmax

    def _gather_op(
        self, op: str, pad_bs: int, bs: int, kw: dict[str, Any]
    ) -> tuple[Callable[[], Any], Callable[[Any], str]]:
        import torch

        c, cfg, r, tp, dev = self.comm, self.ctx.cfg, self.ctx.rank, self.ctx.lp.tp, self.ctx.device
        n, s, rq = cfg.num_tokens, cfg.seed, pad_bs // tp
        if op == "gather_verify_outputs":
            parts = self._cached(
                (op, pad_bs),
                lambda: [
                    [rand_block(shape, "int32", dev, s, 2, k, src) for src in range(tp)]
                    for k, shape in enumerate(((rq, n), (rq, n), (rq,)))
                ],
            )

            def gather() -> Any:
                return c.gather_verify_outputs(
                    parts[0][r], parts[1][r], parts[2][r], pad_bs=pad_bs, **kw
                )

            def check_gather(outs: Any) -> str:
                return "; ".join(
                    d
                    for o, p in zip(outs, parts, strict=True)
                    if (d := same_bits(o[:bs], torch.cat(p)[:bs]))
                )

            return gather, check_gather
        lps = self._cached(
            (op, pad_bs), lambda: [rand_block((rq, n), "float32", dev, s, 3, k) for k in range(tp)]
        )

        def logprobs() -> Any:
            return c.gather_verify_logprobs(lps[r], pad_bs=pad_bs, **kw)

        return logprobs, (lambda got: same_bits(got[:bs], torch.cat(lps)[:bs]))

    def close(self) -> None:
        self._data = {}
        for comm in self.comms.values():
            comm.close()


class _CopyRunner(Runner):
    """The copy limit: one ``copy_`` of the op's bytes per rank (to the next GPU when
    each rank has its own)."""

    def __init__(self, ctx: RankCtx) -> None:
        import torch

        self.ctx = ctx
        dev = ctx.device
        if ctx.lp.device == "cuda" and ctx.lp.launch == "processes" and ctx.lp.tp > 1:
            self.dst_device = torch.device("cuda", (dev.index + 1) % torch.cuda.device_count())
            self.resolved = "peer copy"
        else:
            self.dst_device = dev
            self.resolved = "memcpy" if ctx.lp.device == "cpu" else "device copy"

    def prepare(self, op: str, dtype: str, pad_bs: int, bs: int, mode: str) -> Prepared:
        import torch

        cfg = self.ctx.cfg
        nbytes = op_bytes(op, dtype, pad_bs, self.ctx.lp.tp, cfg.num_tokens, cfg.vocab, bs)
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=self.ctx.device)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=self.dst_device)

        def copy() -> Any:
            return dst.copy_(src, non_blocking=True)

        return Prepared(copy)


class _TorchDistRunner(Runner):
    """Raw torch.distributed collectives on the world group."""

    resolved = "torch.distributed"

    def __init__(self, ctx: RankCtx) -> None:
        import torch.distributed as dist

        self.ctx = ctx
        self.dist = dist

    def prepare(self, op: str, dtype: str, pad_bs: int, bs: int, mode: str) -> Prepared:
        import torch

        dist, cfg, tp, dev = self.dist, self.ctx.cfg, self.ctx.lp.tp, self.ctx.device
        if op == "swap_batch_vocab":
            nbytes = _split_bytes(op, dtype, pad_bs, tp, cfg, bs)
            src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            return Prepared(lambda: dist.all_to_all_single(dst, src))
        words = _gather_bytes(op, tp, cfg.num_tokens, bs) // 4
        src = torch.randint(1, 1000, (words,), dtype=torch.int32, device=dev)
        dst = torch.empty(tp * words, dtype=torch.int32, device=dev)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return Prepared(lambda: gather(dst, src))


class _NcclCupyRunner(Runner):
    """Raw NCCL through ``cupy.cuda.nccl`` on the rank's stream."""

    resolved = "cupy.cuda.nccl"

    def __init__(self, ctx: RankCtx) -> None:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from cupy.cuda import nccl
        import cupy

        from ...backends.nccl import normalize_unique_id, unique_id_for_cupy

        self.ctx = ctx
        self.nccl = nccl
        mine = normalize_unique_id(nccl.get_unique_id()) if ctx.rank == 0 else b""
        raw = ctx.host.all_gather_bytes(mine, timeout_s=120, what="nccl unique id")[0]
        with cupy.cuda.Device(ctx.device.index):
            try:
                self.comm = nccl.NcclCommunicator(ctx.lp.tp, unique_id_for_cupy(raw), ctx.rank)
            except TypeError:  # the other unique-id form (CuPy 13 tuple / CuPy 14 bytes)
                form = "tuple" if isinstance(unique_id_for_cupy(raw), bytes) else "bytes"
                self.comm = nccl.NcclCommunicator(
                    ctx.lp.tp, unique_id_for_cupy(raw, form), ctx.rank
                )
        self.u8 = int(getattr(nccl, "NCCL_UINT8", 1))

    def prepare(self, op: str, dtype: str, pad_bs: int, bs: int, mode: str) -> Prepared:
        import torch

        nccl, comm, u8 = self.nccl, self.comm, self.u8
        cfg, tp, dev = self.ctx.cfg, self.ctx.lp.tp, self.ctx.device

        def stream() -> int:
            return int(torch.cuda.current_stream(dev).cuda_stream)

        if op == "swap_batch_vocab":
            nbytes = _split_bytes(op, dtype, pad_bs, tp, cfg, bs)
            chunk = nbytes // tp
            src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            self._alive = (src, dst)  # raw pointers below; keep the tensors alive
            sp, dp = src.data_ptr(), dst.data_ptr()

            def all_to_all() -> None:
                s = stream()
                nccl.groupStart()
                for peer in range(tp):
                    comm.send(sp + peer * chunk, chunk, u8, peer, s)
                    comm.recv(dp + peer * chunk, chunk, u8, peer, s)
                nccl.groupEnd()

            return Prepared(all_to_all)
        nbytes = _gather_bytes(op, tp, cfg.num_tokens, bs)
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
        dst = torch.empty(tp * nbytes, dtype=torch.uint8, device=dev)
        self._alive = (src, dst)
        sp, dp = src.data_ptr(), dst.data_ptr()

        def all_gather() -> None:
            comm.allGather(sp, dp, nbytes, u8, stream())

        return Prepared(all_gather)

    def close(self) -> None:
        self.comm.destroy()


def _split_bytes(op: str, dtype: str, pad_bs: int, tp: int, cfg: BenchConfig, bs: int) -> int:
    """The op's bytes per rank rounded down to ``tp`` equal chunks (an all-to-all)."""
    return op_bytes(op, dtype, pad_bs, tp, cfg.num_tokens, cfg.vocab, bs) // tp * tp


def _gather_bytes(op: str, tp: int, n: int, bs: int) -> int:
    """Bytes each rank contributes to a raw all-gather of ``bs`` real rows."""
    rows = -(-bs // tp)
    return 4 * rows * (2 * n + 1 if op == "gather_verify_outputs" else n)


@dataclass
class RankCtx:
    rank: int
    group: Any  # what DpSamplingComm gets: None (world) or a ThreadGroup
    host: Any  # HostGroup for barriers and agreement
    device: Any  # torch.device
    stream: Any  # torch.cuda.Stream or None
    cfg: BenchConfig
    lp: LaunchPlan
    keep: Any = None  # the CUDA graph being timed
    gate: Any = None  # measure.Gate of a gated launch

    def sync(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def sync_all(self) -> None:
        """Collective sync: rank threads sharing a GPU first agree that every rank
        has issued its ops, then block (see ipc_dpsample.testing.run_threads)."""
        if self.stream is not None and self.group is not None:
            self.host.barrier(timeout_s=self.cfg.timeout_s, what="ops issued")
        self.sync()

    def quiesce(self, what: str) -> None:
        """Before rank threads sharing a GPU issue ops: this rank's own work done,
        then every rank's (sync, then barrier). A rank still allocating, copying or
        loading a kernel while a peer's op spins for it can block that peer until
        the timeout (see ipc_dpsample.testing.run_threads)."""
        self.sync()
        if self.stream is not None and self.group is not None:
            self.host.barrier(timeout_s=self.cfg.timeout_s, what=what)

    def settle(self, out: Any) -> Any:
        self.sync_all()
        return out

    def agree(self, ok: bool, what: str) -> bool:
        flags = self.host.all_gather_bytes(
            b"\1" if ok else b"\0", timeout_s=self.cfg.timeout_s, what=what
        )
        return all(f == b"\1" for f in flags)


def make_runner(ctx: RankCtx, impl: str) -> Runner:
    if impl in BACKEND_CHOICES:
        return CommRunner(ctx, impl)
    if impl == "copy":
        return _CopyRunner(ctx)
    if impl == "torch_dist":
        return _TorchDistRunner(ctx)
    return _NcclCupyRunner(ctx)

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

from .config import BACKEND_CHOICES, BenchConfig, LaunchPlan, op_bytes

__all__ = [
    "CommRunner",
    "RankCtx",
    "Runner",
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


# -- rank body ----------------------------------------------------------------------
class Runner:
    """One backend or baseline on one rank: ``prepare(op, dtype, pad_bs)`` returns
    the call to time and an optional bit-exact check."""

    resolved: str | None = None

    def prepare(self, op: str, dtype: str, pad_bs: int) -> tuple[Callable[[], Any], Any]:
        raise NotImplementedError

    def close(self) -> None:
        return None


class CommRunner(Runner):
    """The package's ops on one communicator per logits dtype (a communicator's dtype
    is fixed once; every rank asks for the dtypes in the same order, so the lazily
    built communicators are built collectively)."""

    def __init__(self, ctx: RankCtx, backend: str) -> None:
        self.ctx = ctx
        self.backend = backend
        self.comms: dict[str | None, Any] = {}
        self.comm = self._comm(None)
        self.resolved = self.comm.backend

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

    def prepare(self, op: str, dtype: str, pad_bs: int) -> tuple[Callable[[], Any], Any]:
        import torch

        c, cfg, r, tp, dev = self.comm, self.ctx.cfg, self.ctx.rank, self.ctx.lp.tp, self.ctx.device
        n, s = cfg.num_tokens, cfg.seed
        bs = cfg.real_bs(pad_bs)
        kw: dict[str, int] = {} if bs is None else {"bs": bs}  # only when --bs is given
        if op == "swap_batch_vocab":
            c = self._comm(dtype)
            x = swap_input(s, r, tp, pad_bs, n, cfg.vocab, dtype, dev)

            def swap() -> Any:
                return c.swap_batch_vocab(x, pad_bs=pad_bs, **kw)

            def check_swap() -> str:
                exp = swap_expected(s, r, tp, pad_bs, n, cfg.vocab, dtype, dev)
                got = self.ctx.settle(swap())
                if bs is None:
                    return same_bits(got, exp)
                # rows of real requests only: global request r*R + i is real when < bs
                real = max(0, min(pad_bs // tp, bs - r * (pad_bs // tp))) * n
                return same_bits(got[:real], exp[:real])

            return swap, check_swap
        rq = pad_bs // tp
        if op == "gather_verify_outputs":
            parts = [
                [rand_block(shape, "int32", dev, s, 2, k, src) for src in range(tp)]
                for k, shape in enumerate(((rq, n), (rq, n), (rq,)))
            ]

            def gather() -> Any:
                return c.gather_verify_outputs(parts[0][r], parts[1][r], parts[2][r], pad_bs=pad_bs)

            def check_gather() -> str:
                outs = self.ctx.settle(gather())
                return "; ".join(
                    d for o, p in zip(outs, parts, strict=True) if (d := same_bits(o, torch.cat(p)))
                )

            return gather, check_gather
        lps = [rand_block((rq, n), "float32", dev, s, 3, src) for src in range(tp)]

        def logprobs() -> Any:
            return c.gather_verify_logprobs(lps[r], pad_bs=pad_bs)

        def check_lp() -> str:
            return same_bits(self.ctx.settle(logprobs()), torch.cat(lps))

        return logprobs, check_lp

    def close(self) -> None:
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

    def prepare(self, op: str, dtype: str, pad_bs: int) -> tuple[Callable[[], Any], Any]:
        import torch

        cfg = self.ctx.cfg
        nbytes = op_bytes(op, dtype, pad_bs, self.ctx.lp.tp, cfg.num_tokens, cfg.vocab)
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=self.ctx.device)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=self.dst_device)

        def copy() -> Any:
            return dst.copy_(src, non_blocking=True)

        return copy, None


class _TorchDistRunner(Runner):
    """Raw torch.distributed collectives on the world group."""

    resolved = "torch.distributed"

    def __init__(self, ctx: RankCtx) -> None:
        import torch.distributed as dist

        self.ctx = ctx
        self.dist = dist

    def prepare(self, op: str, dtype: str, pad_bs: int) -> tuple[Callable[[], Any], Any]:
        import torch

        dist, cfg, tp, dev = self.dist, self.ctx.cfg, self.ctx.lp.tp, self.ctx.device
        if op == "swap_batch_vocab":
            nbytes = op_bytes(op, dtype, pad_bs, tp, cfg.num_tokens, cfg.vocab)
            src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            return (lambda: dist.all_to_all_single(dst, src)), None
        rq, n = pad_bs // tp, cfg.num_tokens
        words = rq * (2 * n + 1) if op == "gather_verify_outputs" else rq * n
        src = torch.randint(1, 1000, (words,), dtype=torch.int32, device=dev)
        dst = torch.empty(tp * words, dtype=torch.int32, device=dev)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return (lambda: gather(dst, src)), None


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

    def prepare(self, op: str, dtype: str, pad_bs: int) -> tuple[Callable[[], Any], Any]:
        import torch

        nccl, comm, u8 = self.nccl, self.comm, self.u8
        cfg, tp, dev = self.ctx.cfg, self.ctx.lp.tp, self.ctx.device

        def stream() -> int:
            return int(torch.cuda.current_stream(dev).cuda_stream)

        if op == "swap_batch_vocab":
            nbytes = op_bytes(op, dtype, pad_bs, tp, cfg.num_tokens, cfg.vocab)
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

            return all_to_all, None
        rq, n = pad_bs // tp, cfg.num_tokens
        nbytes = 4 * (rq * (2 * n + 1) if op == "gather_verify_outputs" else rq * n)
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
        dst = torch.empty(tp * nbytes, dtype=torch.uint8, device=dev)
        self._alive = (src, dst)
        sp, dp = src.data_ptr(), dst.data_ptr()

        def all_gather() -> None:
            comm.allGather(sp, dp, nbytes, u8, stream())

        return all_gather, None

    def close(self) -> None:
        self.comm.destroy()


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

"""What one rank times: a runner per backend (:class:`CommRunner`, through
:class:`~ipc_dpsample.DpSamplingComm`) and per baseline (the copy limit, raw
torch.distributed, raw NCCL through CuPy), with the seeded data and bit-exact
checks they use, and the per-rank context they share (:class:`RankCtx`).

A point a runner cannot measure raises :class:`PointSkipped` from ``prepare`` (it is
reported skipped with the reason, not failed): ``verify_batch_vocab`` on a backend
without it (:class:`~ipc_dpsample.errors.BackendUnavailableError`), or CUDA-graph
points of its host path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import BackendUnavailableError
from ...layout import real_reqs
from ..common import OPS, VERIFY, logprobs_close, to_numpy
from ..verify_case import VERIFY_MIXES, VerifyCase, make_verify_case
from .config import (
    BACKEND_CHOICES,
    FULL_ROW_SAMPLER,
    LOGITS_OPS,
    BenchConfig,
    LaunchPlan,
    op_bytes,
)

__all__ = [
    "CAPTURE_LOCK",
    "FULL_ROW_SAMPLER",
    "CommRunner",
    "PointSkipped",
    "Prepared",
    "RankCtx",
    "Runner",
    "argmax_expected",
    "bench_verify_case",
    "close_logprobs",
    "make_runner",
    "rand_block",
    "same_bits",
    "swap_expected",
    "swap_input",
]


class PointSkipped(Exception):
    """A point this runner cannot measure; the message says why (reported skipped)."""


#: CUDA graphs are captured one rank thread at a time: ``torch.cuda.graph`` synchronises
#: the device on entry (capturing launches nothing).
CAPTURE_LOCK = threading.Lock()
#: Elements per chunk of the baseline's full-row sampler on a GPU
#: (``sampling.verify_rows(chunk_elems=...)``; its default, 2**21, bounds the
#: temporaries of a serving process): 8x fewer launches, the same tokens.
SAMPLER_CHUNK_ELEMS_GPU = 1 << 24


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


_CASES: dict[tuple[Any, ...], VerifyCase] = {}
_CASES_LOCK = threading.Lock()


def bench_verify_case(ctx: RankCtx, dtype: str, pad_bs: int, mix: str) -> VerifyCase:
    """``verify_batch_vocab``'s case at a point: every rank's :func:`swap_input`
    (made on this rank's device, copied to the host), parameters of ``mix``,
    candidates and the NumPy reference's outputs (:func:`~ipc_dpsample.tools.
    verify_case.make_verify_case`). The same on every rank; built once per process
    and point data (rank threads share it: the first builds it, the others wait), for
    every backend, mode and ``bs`` of the point (the outputs of real requests do not
    depend on ``bs``)."""
    cfg, tp = ctx.cfg, ctx.lp.tp
    n, v, seed = cfg.num_tokens, cfg.vocab, cfg.seed
    key = (seed, tp, pad_bs, n, v, dtype, mix, cfg.vocab_limit, str(ctx.device))
    with _CASES_LOCK:
        case = _CASES.get(key)
        if case is None:
            inputs = [
                to_numpy(swap_input(seed, s, tp, pad_bs, n, v, dtype, ctx.device))
                for s in range(tp)
            ]
            rng = np.random.default_rng([seed, 4, pad_bs, VERIFY_MIXES.index(mix)])
            case = _CASES[key] = make_verify_case(
                inputs,
                tp=tp,
                pad_bs=pad_bs,
                dtype=dtype,
                mix=mix,
                rng=rng,
                vocab_limit=cfg.vocab_limit,
            )
        return case


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
    """One backend or baseline on one rank: ``prepare(op, dtype, pad_bs, bs, mode,
    mix)`` returns the call to time and an optional check (:class:`Prepared`), or
    raises :class:`PointSkipped`."""

    resolved: str | None = None

    def prepare(
        self, op: str, dtype: str, pad_bs: int, bs: int, mode: str, mix: str = ""
    ) -> Prepared:
        raise NotImplementedError

    def close(self) -> None:
        return None


class CommRunner(Runner):
    """The package's ops on one communicator per logits dtype (a communicator's dtype
    is fixed once; every rank asks for the dtypes in the same order, so the lazily
    built communicators are built collectively), and the baselines of the argmax
    (:data:`~.config.ARGMAX_BASELINES`) and of the verify
    (:data:`~.config.VERIFY_BASELINES`) on the same data.

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
        self._verify_data: dict[tuple[Any, ...], Any] = {}
        #: Per logits dtype: "" when its communicator runs verify_batch_vocab, else why not.
        self._verify_missing: dict[str, str] = {}
        #: "" once the full-row sampler was captured in a CUDA graph, else why it was not.
        self._sampler_graph: str | None = None
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

    def prepare(
        self, op: str, dtype: str, pad_bs: int, bs: int, mode: str, mix: str = ""
    ) -> Prepared:
        kw, how = self._bs_kw(op, bs, mode)
        key = (op, dtype, pad_bs, mix) if how == "device" else None
        if op in (VERIFY, "swap_sample_gather"):
            fn, check = self._verify_op(op, dtype, pad_bs, bs, mode, mix, kw)
        elif op in LOGITS_OPS:
            fn, check = self._logits_op(op, dtype, pad_bs, bs, kw)
        else:
            fn, check = self._gather_op(op, pad_bs, bs, kw)
        return Prepared(fn, check, key, how)

    def _logits(self, dtype: str, pad_bs: int) -> tuple[Any, Any]:
        """This rank's ``local_logits`` at a point and its expected swap output."""
        cfg, r, tp, dev = self.ctx.cfg, self.ctx.rank, self.ctx.lp.tp, self.ctx.device
        n, s = cfg.num_tokens, cfg.seed
        return self._cached(
            (dtype, pad_bs),
            lambda: (
                swap_input(s, r, tp, pad_bs, n, cfg.vocab, dtype, dev),
                swap_expected(s, r, tp, pad_bs, n, cfg.vocab, dtype, dev),
            ),
        )

    def _logits_op(
        self, op: str, dtype: str, pad_bs: int, bs: int, kw: dict[str, Any]
    ) -> tuple[Callable[[], Any], Callable[[Any], str] | None]:
        import torch

        cfg, r, tp = self.ctx.cfg, self.ctx.rank, self.ctx.lp.tp
        n, limit = cfg.num_tokens, cfg.limit
        c = self._comm(dtype)
        x, exp = self._logits(dtype, pad_bs)
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

    def _verify_tensors(self, dtype: str, pad_bs: int, mix: str) -> dict[str, Any]:
        """The case of a point (:func:`bench_verify_case`) as tensors on this rank's
        device: ``candidates``, ``params`` (keywords of the op; None = off) and
        ``expected`` (predict, accept_index, accept_length of the whole batch)."""
        import torch

        def make() -> dict[str, Any]:
            case = bench_verify_case(self.ctx, dtype, pad_bs, mix)
            dev = self.ctx.device
            p = case.params
            # top-p / min-p without top-k: host parameters, which a GPU backend routes
            # to its swap (its kernels refuse those requests as device parameters)
            host = p["top_k"] is None and (p["top_p"] is not None or p["min_p"] is not None)
            on_dev = {k: None if v is None else torch.from_numpy(v).to(dev) for k, v in p.items()}
            return {
                "candidates": torch.from_numpy(case.candidates).to(dev),
                "params": on_dev,  # the baseline's sampler takes tensors
                "verify_params": p if host else on_dev,
                "host_params": host,
                "expected": [torch.from_numpy(e).to(dev) for e in case.expected],
            }

        key = (dtype, pad_bs, mix)
        if key not in self._verify_data:
            self._verify_data = {key: make()}
        return self._verify_data[key]

    def _verify_op(
        self, op: str, dtype: str, pad_bs: int, bs: int, mode: str, mix: str, kw: dict[str, Any]
    ) -> tuple[Callable[[], Any], Callable[[Any], str]]:
        """``verify_batch_vocab`` at a point, or its ``swap_sample_gather`` baseline;
        both checked bit for bit against the reference on the real requests."""
        cfg, r, tp = self.ctx.cfg, self.ctx.rank, self.ctx.lp.tp
        c = self._comm(dtype)
        x, exp = self._logits(dtype, pad_bs)
        t = self._verify_tensors(dtype, pad_bs, mix)
        if op == VERIFY and mode == "graph":
            backend = c.explain().split(":")[0]
            if backend != "onesided" or t["host_params"]:
                raise PointSkipped(
                    f"{VERIFY} on {backend} with mix {mix} reads its per-request parameters "
                    "on the host: not capturable in a CUDA graph (onesided captures it with "
                    "every parameter on the device and top-k on for top-p / min-p requests)"
                )
        cand, params, expected = t["candidates"], t["params"], t["expected"]

        def check(got: Any) -> str:
            names = ("predict", "accept_index", "accept_length")
            return "; ".join(
                f"{name}: {diff}"
                for name, g, e in zip(names, got, expected, strict=True)
                if (diff := same_bits(g[:bs], e[:bs]))
            )

        if op == VERIFY:
            vparams = t["verify_params"]
            missing = self._verify_unavailable(c, dtype, x, cand, pad_bs, vparams)
            if missing:
                raise PointSkipped(missing)

            def verify() -> Any:
                return c.verify_batch_vocab(
                    x, cand, pad_bs=pad_bs, **vparams, vocab_limit=cfg.vocab_limit, **kw
                )

            return verify, check
        from ...sampling import plan_rows, row_params, verify_rows

        rq = pad_bs // tp
        mine = slice(r * rq, (r + 1) * rq)
        my_cand = cand[mine]
        my_params = {k: None if v is None else v[mine] for k, v in params.items()}
        real = real_reqs(rq, bs, r)
        rows = row_params(
            num_tokens_per_req=cfg.num_tokens, vocab_limit=cfg.limit, bs=real, **my_params
        )
        plan = plan_rows(rows.top_k, rows.top_p, rows.greedy)  # no host sync when timed
        sample: dict[str, Any] = {
            "reqs_per_rank": rq,
            "vocab_limit": cfg.limit,
            "bs": real,
            "plan": plan,
        }
        if exp.is_cuda:
            sample["chunk_elems"] = SAMPLER_CHUNK_ELEMS_GPU
        # load the sampler's kernels now, locally: loaded lazily behind a spinning swap
        # they would stall the device until the timeout
        verify_rows(exp, my_cand, **my_params, **sample, check=False)
        if mode == "graph":
            why = self._sampler_capture_error(
                lambda: verify_rows(exp, my_cand, **my_params, **sample, check=False)
            )
            if why:
                raise PointSkipped(why)

        def swap_sample_gather() -> Any:
            y = c.swap_batch_vocab(x, pad_bs=pad_bs, **kw)
            out = verify_rows(y, my_cand, **my_params, **sample, check=False)
            return c.gather_verify_outputs(*out, pad_bs=pad_bs, **kw)

        return swap_sample_gather, check

    def _sampler_capture_error(self, call: Callable[[], Any]) -> str:
        """``""`` when ``call`` (the full-row sampler alone, no communication) can be
        captured in a CUDA graph on this rank's stream, else why not; tried once per
        runner, locally (a sampler that synchronises with the host cannot be)."""
        if self._sampler_graph is None:
            import torch

            try:
                graph = torch.cuda.CUDAGraph()
                with (
                    CAPTURE_LOCK,
                    torch.cuda.graph(
                        graph, stream=self.ctx.stream, capture_error_mode="thread_local"
                    ),
                ):
                    call()
                del graph
                self._sampler_graph = ""
            except Exception as exc:
                text = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
                self._sampler_graph = (
                    f"{FULL_ROW_SAMPLER} could not be captured in a CUDA graph ({text})"
                )
        return self._sampler_graph

    def _verify_unavailable(
        self, c: Any, dtype: str, x: Any, cand: Any, pad_bs: int, params: dict[str, Any]
    ) -> str:
        """``""`` when the communicator of ``dtype`` runs ``verify_batch_vocab``, else
        why not. Asked once per communicator with one call (a backend without the op
        raises before anything moves; the others run it, on every rank alike)."""
        if dtype not in self._verify_missing:
            why = ""
            try:
                c.verify_batch_vocab(
                    x, cand, pad_bs=pad_bs, **params, vocab_limit=self.ctx.cfg.vocab_limit
                )
            except BackendUnavailableError as exc:
                text = str(exc).split(". ")[0]
                detail = text.split("here: ", 1)[1] if "here: " in text else text
                why = f"{VERIFY} not available on {c.backend} in this version ({detail})"
            self._verify_missing[dtype] = why
        return self._verify_missing[dtype]

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
        self._verify_data = {}
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

    def prepare(
        self, op: str, dtype: str, pad_bs: int, bs: int, mode: str, mix: str = ""
    ) -> Prepared:
        import torch

        cfg = self.ctx.cfg
        tp = self.ctx.lp.tp
        nbytes = op_bytes(
            op, dtype, pad_bs, tp, cfg.num_tokens, cfg.vocab, bs, mix, cfg.vocab_limit
        )
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

    def prepare(
        self, op: str, dtype: str, pad_bs: int, bs: int, mode: str, mix: str = ""
    ) -> Prepared:
        import torch

        dist, cfg, tp, dev = self.dist, self.ctx.cfg, self.ctx.lp.tp, self.ctx.device
        if op == "swap_batch_vocab":
            nbytes = _split_bytes(op, dtype, pad_bs, tp, cfg, bs)
            src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            return Prepared(lambda: dist.all_to_all_single(dst, src))
        words = _gather_bytes(op, dtype, pad_bs, tp, cfg, bs, mix) // 4
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

    def prepare(
        self, op: str, dtype: str, pad_bs: int, bs: int, mode: str, mix: str = ""
    ) -> Prepared:
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
        nbytes = _gather_bytes(op, dtype, pad_bs, tp, cfg, bs, mix)
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


def _gather_bytes(
    op: str, dtype: str, pad_bs: int, tp: int, cfg: BenchConfig, bs: int, mix: str
) -> int:
    """Bytes each rank contributes to a raw all-gather of ``bs`` real rows (the
    verify: its records of every real row, ``op_bytes / tp``)."""
    if op == VERIFY:
        total = op_bytes(op, dtype, pad_bs, tp, cfg.num_tokens, cfg.vocab, bs, mix, cfg.vocab_limit)
        return total // tp
    n = cfg.num_tokens
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

    def outcome(self, code: int, what: str) -> int:
        """The worst of every rank's ``code`` (0 ok, 1 skipped, 2 failed)."""
        codes = self.host.all_gather_bytes(bytes([code]), timeout_s=self.cfg.timeout_s, what=what)
        return max(c[0] for c in codes)


def make_runner(ctx: RankCtx, impl: str) -> Runner:
    if impl in BACKEND_CHOICES:
        return CommRunner(ctx, impl)
    if impl == "copy":
        return _CopyRunner(ctx)
    if impl == "torch_dist":
        return _TorchDistRunner(ctx)
    return _NcclCupyRunner(ctx)

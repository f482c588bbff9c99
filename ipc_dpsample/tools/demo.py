"""``ipc-dpsample demo``: run the three collectives on this machine and prove them.

The demo starts as many ranks as the machine supports, feeds every op random
data (never zeros), compares every result bit for bit with the NumPy reference of
:mod:`ipc_dpsample.layout`, times the ops and prints one short table. It exits
with 1 when any rank fails or any output differs from the reference.

How ranks are laid out (:func:`plan_demo`):

* two or more CUDA GPUs: one process per GPU (``run_ranks``);
* exactly one GPU: ``K`` ranks as threads of this process on that GPU
  (``run_threads``, default 4) when the one-sided backend imports, else one rank;
* no GPU (or ``--cpu``): 4 processes over gloo on the CPU.

This module also holds what the other tools share: machine detection
(:func:`detect_machine`), seeded data with its reference (:func:`make_round`),
bit-exact comparison (:func:`bits_equal`) and the rank body (:func:`demo_rank`)
that ``ipc-dpsample doctor`` reuses for its self-tests.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ..arrays import ITEMSIZE, LOGITS_DTYPES, normalize_dtype
from ..config import BACKENDS
from ..layout import (
    reference_gather_verify_logprobs,
    reference_gather_verify_outputs,
    reference_swap_batch_vocab,
)

__all__ = [
    "OPS",
    "DemoPlan",
    "Machine",
    "RankData",
    "bits_equal",
    "demo_rank",
    "detect_machine",
    "format_report",
    "make_round",
    "plan_demo",
    "run_demo",
]

#: The three collectives, in the order a verify step calls them.
OPS: tuple[str, ...] = ("swap_batch_vocab", "gather_verify_outputs", "gather_verify_logprobs")

Launch = Literal["processes", "threads"]
DeviceKind = Literal["cpu", "cuda"]

#: Shapes of one verify step on a GPU machine (Qwen-class vocabulary, 3 drafts + 1).
GPU_SHAPE = {"pad_bs": 64, "num_tokens": 4, "vocab": 152064, "dtype": "bfloat16"}
#: Scaled down for a CPU machine (gloo moves the bytes; a 2-core box finishes fast).
CPU_SHAPE = {"pad_bs": 16, "num_tokens": 4, "vocab": 32000, "dtype": "float32"}
#: Ranks on a CPU-only machine and as threads on a single GPU.
DEFAULT_CPU_RANKS = 4
DEFAULT_THREAD_RANKS = 4


# -- machine ------------------------------------------------------------------------
@dataclass(frozen=True)
class Machine:
    """What this machine can run, probed once without side effects on devices.

    Attributes
    ----------
    torch_gpus : int
        CUDA devices torch sees (0 unless ``torch.cuda.is_available()``).
    cupy_gpus : int
        CUDA devices CuPy can drive (0 when CuPy raises ``CUDARuntimeError``).
    onesided : bool
        ``ipc_dpsample.backends.onesided`` imports.
    onesided_error : str
        Why it does not, when it does not.
    nccl_backend : bool
        ``ipc_dpsample.backends.nccl`` imports and ``cupy.cuda.nccl`` loads.
    nccl_error : str
    cupy_nccl : bool
        ``cupy.cuda.nccl`` loads libnccl (the NCCL baseline of the benchmark).
    cpu_count : int
    """

    torch_gpus: int
    cupy_gpus: int
    onesided: bool = False
    onesided_error: str = ""
    nccl_backend: bool = False
    nccl_error: str = ""
    cupy_nccl: bool = False
    cpu_count: int = 1

    @property
    def gpus(self) -> int:
        """GPUs the tools use: torch's count (the demo and bench move torch tensors)."""
        return self.torch_gpus


def torch_gpu_count() -> int:
    """CUDA devices torch can use; 0 on a CPU build, without a driver or on error."""
    try:
        import torch

        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:
        return 0


def _import_error(module: str) -> str:
    try:
        __import__(module)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def detect_machine() -> Machine:
    """Probe GPUs and optional backends.

    CuPy's ``CUDARuntimeError`` (no GPU, driver too old) counts as zero GPUs
    (:func:`ipc_dpsample.identity.cupy_device_count`).
    """
    import warnings

    from ..identity import cupy_device_count, nccl_available

    onesided_error = _import_error("ipc_dpsample.backends.onesided")
    nccl_error = _import_error("ipc_dpsample.backends.nccl")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CuPy warns when libnccl is missing
        has_nccl = nccl_available()
    if not nccl_error and not has_nccl:
        nccl_error = "cupy.cuda.nccl cannot load libnccl (pip install nvidia-nccl-cu12)"
    return Machine(
        torch_gpus=torch_gpu_count(),
        cupy_gpus=cupy_device_count(),
        onesided=not onesided_error,
        onesided_error=onesided_error,
        nccl_backend=not nccl_error,
        nccl_error=nccl_error,
        cupy_nccl=has_nccl,
        cpu_count=os.cpu_count() or 1,
    )


# -- plan ---------------------------------------------------------------------------
@dataclass(frozen=True)
class DemoPlan:
    """One demo run: who the ranks are and what they move.

    Raises
    ------
    ValueError
        On shapes the communicator would reject (the message names the fix).
    """

    world: int
    launch: Launch
    device: DeviceKind
    backend: str = "auto"
    pad_bs: int = CPU_SHAPE["pad_bs"]
    num_tokens: int = CPU_SHAPE["num_tokens"]
    vocab: int = CPU_SHAPE["vocab"]
    dtype: str = CPU_SHAPE["dtype"]
    iters: int = 20
    #: Rounds verified with fresh data before timing (ping-pong regions see both parities).
    rounds: int = 3
    seed: int = 20261202
    timeout_s: float = 30.0
    note: str = ""

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ValueError(f"world={self.world} must be >= 1")
        if self.launch not in ("processes", "threads"):
            raise ValueError(f"launch={self.launch!r}; expected 'processes' or 'threads'")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r}; expected 'cpu' or 'cuda'")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}; expected one of {BACKENDS}")
        if self.pad_bs < self.world or self.pad_bs % self.world:
            raise ValueError(f"pad_bs={self.pad_bs} must be a positive multiple of {self.world}")
        if self.vocab < self.world or self.vocab % self.world:
            raise ValueError(f"vocab={self.vocab} must be a positive multiple of {self.world}")
        if self.dtype not in LOGITS_DTYPES:
            raise ValueError(f"dtype={self.dtype!r}; expected one of {LOGITS_DTYPES}")
        if self.iters < 1 or self.rounds < 1 or self.num_tokens < 1:
            raise ValueError("iters, rounds and num_tokens must be >= 1")

    @property
    def reqs_per_rank(self) -> int:
        """``R = pad_bs / world``."""
        return self.pad_bs // self.world

    @property
    def vocab_shard(self) -> int:
        """``V / world``."""
        return self.vocab // self.world

    def op_shapes(self, op: str) -> tuple[str, str, str]:
        """``(input per rank, output per rank, dtype)`` as text, for the table."""
        r, n, v = self.reqs_per_rank, self.num_tokens, self.vocab
        if op == "swap_batch_vocab":
            return f"[{self.pad_bs * n}, {self.vocab_shard}]", f"[{r * n}, {v}]", self.dtype
        if op == "gather_verify_outputs":
            return f"3 x [{r}, {n}]", f"3 x [{self.pad_bs}, {n}]", "int32"
        return f"[{r}, {n}]", f"[{self.pad_bs}, {n}]", "float32"

    def op_bytes(self, op: str) -> int:
        """Bytes each rank receives in ``op`` (its output's size)."""
        r, n = self.reqs_per_rank, self.num_tokens
        if op == "swap_batch_vocab":
            return r * n * self.vocab * ITEMSIZE[self.dtype]
        if op == "gather_verify_outputs":
            return self.pad_bs * (2 * n + 1) * 4
        return self.pad_bs * n * 4


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def plan_demo(
    machine: Machine,
    *,
    world_size: int | None = None,
    backend: str = "auto",
    iters: int = 20,
    cpu: bool = False,
) -> DemoPlan:
    """Choose ranks and shapes for this machine (pure: no probing, no devices).

    Parameters
    ----------
    machine : Machine
    world_size : int or None
        Ranks; None for the machine's default (GPUs, 4 threads on one GPU, 4 CPU
        processes).
    backend : {"auto", "onesided", "nccl", "torch"}
    iters : int
        Timed calls of each op.
    cpu : bool
        Use the CPU path even where GPUs exist.

    Raises
    ------
    ValueError
        ``world_size`` exceeds what the machine can place (the message says why).
    """
    if world_size is not None and world_size < 1:
        raise ValueError(f"--world-size {world_size} must be >= 1")
    gpus = 0 if cpu else machine.gpus
    if gpus == 0:
        world = world_size or DEFAULT_CPU_RANKS
        why = "--cpu given" if cpu else "no CUDA GPU found"
        return _sized(
            world=world,
            launch="processes",
            device="cpu",
            backend=backend,
            iters=iters,
            note=f"{world} processes over gloo on the CPU ({why})",
            shape=CPU_SHAPE,
        )
    if gpus >= 2:
        world = world_size or gpus
        if world > gpus:
            raise ValueError(
                f"--world-size {world} > {gpus} GPUs: the demo runs one process per GPU "
                f"(use --world-size <= {gpus}, or --cpu for more CPU ranks)"
            )
        return _sized(
            world=world,
            launch="processes",
            device="cuda",
            backend=backend,
            iters=iters,
            note=f"{world} processes, one per GPU",
            shape=GPU_SHAPE,
        )
    threads_ok = backend in ("auto", "onesided") and machine.onesided and machine.cupy_gpus > 0
    if threads_ok:
        world = world_size or DEFAULT_THREAD_RANKS
        return _sized(
            world=world,
            launch="threads",
            device="cuda",
            backend=backend,
            iters=iters,
            note=f"{world} ranks as threads of one process on the one GPU",
            shape=GPU_SHAPE,
        )
    if backend in ("auto", "onesided") and not machine.onesided:
        why = f"the one-sided backend does not import ({machine.onesided_error})"
    elif backend in ("auto", "onesided"):
        why = "CuPy cannot drive the GPU"
    else:
        why = f"backend={backend} needs one GPU per rank"
    if world_size not in (None, 1):
        raise ValueError(
            f"--world-size {world_size} on one GPU needs in-process ranks, which need the "
            f"one-sided backend, but {why}; use --world-size 1 or --cpu"
        )
    return _sized(
        world=1,
        launch="processes",
        device="cuda",
        backend=backend,
        iters=iters,
        note=f"1 rank on the one GPU ({why})",
        shape=GPU_SHAPE,
    )


def _sized(*, shape: dict[str, Any], **fields: Any) -> DemoPlan:
    """A plan with ``shape``, ``pad_bs`` and ``V`` rounded up to multiples of the world."""
    world = int(fields["world"])
    return DemoPlan(
        pad_bs=_round_up(int(shape["pad_bs"]), world),
        num_tokens=int(shape["num_tokens"]),
        vocab=_round_up(int(shape["vocab"]), world),
        dtype=str(shape["dtype"]),
        **fields,
    )


# -- data ---------------------------------------------------------------------------
@dataclass
class RankData:
    """One rank's inputs of one round and what it must receive.

    Arrays are NumPy; bfloat16 travels as its ``uint16`` bit pattern.
    """

    logits: np.ndarray  # [pad_bs * N, V / world]
    predict: np.ndarray  # int32 [R, N]
    accept_index: np.ndarray  # int32 [R, N]
    accept_length: np.ndarray  # int32 [R]
    logprobs: np.ndarray  # float32 [R, N]
    expect_swap: np.ndarray  # [R * N, V]
    expect_outputs: tuple[np.ndarray, np.ndarray, np.ndarray]
    expect_logprobs: np.ndarray


def _random_logits(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    values = rng.standard_normal(shape, dtype=np.float32) * np.float32(4.0)
    if dtype == "float32":
        return values
    if dtype == "float16":
        return values.astype(np.float16)
    return (values.view(np.uint32) >> 16).astype(np.uint16)  # bfloat16 bits (truncated)


def make_round(plan: DemoPlan, round_: int, ranks: Sequence[int] | None = None) -> list[RankData]:
    """Random inputs of every rank for one round and the reference outputs.

    Every rank derives the same data from ``(plan.seed, round_)``, so a process
    rank can build the whole round and keep only its own part.

    Parameters
    ----------
    plan : DemoPlan
    round_ : int
    ranks : sequence of int or None
        Ranks to return (all when None); the result is indexed like ``ranks``.
    """
    w, r, n, v = plan.world, plan.reqs_per_rank, plan.num_tokens, plan.vocab
    rng = np.random.default_rng([plan.seed, round_])
    logits = [_random_logits(rng, (plan.pad_bs * n, v // w), plan.dtype) for _ in range(w)]
    predict = [rng.integers(1, v, (r, n), dtype=np.int32) for _ in range(w)]
    accept_index = [rng.integers(1, plan.pad_bs * n, (r, n), dtype=np.int32) for _ in range(w)]
    accept_length = [rng.integers(1, n + 1, (r,), dtype=np.int32) for _ in range(w)]
    logprobs = [-rng.exponential(2.0, (r, n)).astype(np.float32) - 1e-3 for _ in range(w)]
    swapped = reference_swap_batch_vocab(logits, tp=w, num_tokens_per_req=n, pad_bs=plan.pad_bs)
    outputs = reference_gather_verify_outputs(predict, accept_index, accept_length)
    gathered_lp = reference_gather_verify_logprobs(logprobs)
    return [
        RankData(
            logits=logits[k],
            predict=predict[k],
            accept_index=accept_index[k],
            accept_length=accept_length[k],
            logprobs=logprobs[k],
            expect_swap=swapped[k],
            expect_outputs=outputs,
            expect_logprobs=gathered_lp,
        )
        for k in (range(w) if ranks is None else ranks)
    ]


def _bits(a: np.ndarray) -> np.ndarray:
    """Unsigned integer view of the same bytes (NaN-safe, -0.0 != 0.0)."""
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    return np.ascontiguousarray(a).view(unsigned)


def bits_equal(got: np.ndarray, expected: np.ndarray) -> str:
    """``""`` when ``got`` and ``expected`` hold the same bits, else what differs."""
    if got.shape != expected.shape:
        return f"shape {got.shape} != expected {expected.shape}"
    if got.dtype.itemsize != expected.dtype.itemsize:
        return f"itemsize {got.dtype.itemsize} != expected {expected.dtype.itemsize}"
    g, e = _bits(got), _bits(expected)
    bad = np.flatnonzero(g.reshape(-1) != e.reshape(-1))
    if bad.size == 0:
        return ""
    first = np.unravel_index(int(bad[0]), got.shape)
    return (
        f"{bad.size} of {g.size} elements differ; first at {tuple(int(i) for i in first)}: "
        f"got {int(g.reshape(-1)[bad[0]]):#x}, expected {int(e.reshape(-1)[bad[0]]):#x}"
    )


def to_torch(a: np.ndarray, dtype: str, device: Any) -> Any:
    """A torch tensor on ``device`` holding ``a`` (``dtype`` is the canonical name)."""
    import torch

    if dtype == "bfloat16":
        t = torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(np.ascontiguousarray(a))
    return t.to(device)


def to_numpy(t: Any) -> np.ndarray:
    """Host copy of a torch tensor's bits (bfloat16 as ``uint16``)."""
    import torch

    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


# -- rank body ----------------------------------------------------------------------
@dataclass
class _OpRecord:
    times_s: list[float] = field(default_factory=list)
    checks: int = 0
    mismatches: list[str] = field(default_factory=list)


def _timer(cuda: bool, stream: Any, issued: Any = None) -> Any:
    """A callable that times ``fn`` ``n`` times and returns seconds per call."""
    if not cuda:

        def time_cpu(fn: Any, n: int) -> list[float]:
            out = []
            for _ in range(n):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
            return out

        return time_cpu
    import torch

    def time_cuda(fn: Any, n: int) -> list[float]:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for i in range(n):
            starts[i].record(stream)
            fn()
            ends[i].record(stream)
        if issued is not None:
            issued()
        ends[-1].synchronize()
        return [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends, strict=True)]

    return time_cuda


def demo_rank(
    rank: int,
    world: int,
    group: Any,
    plan: DemoPlan,
    shared: list[list[RankData]] | None = None,
) -> dict[str, Any]:
    """Body of one demo rank (for ``run_ranks`` / ``run_threads``).

    Verifies ``plan.rounds`` rounds of fresh data, times ``plan.iters`` calls of
    every op, then verifies round 0 again (the buffers were reused in between).

    Parameters
    ----------
    rank, world : int
    group : None (the torch.distributed world) or ThreadGroup
    plan : DemoPlan
    shared : list of rounds of per-rank data, or None
        Prebuilt data (threads share one copy); None builds it here.

    Returns
    -------
    dict
        ``rank``, ``backend``, ``explain``, ``device`` and ``ops``: per op
        ``times_s``, ``checks`` (outputs compared) and ``mismatches``.
    """
    import torch

    from ..comm import DpSamplingComm

    cuda = plan.device == "cuda"
    stream = None
    if cuda:
        if plan.launch == "threads":
            torch.cuda.set_device(0)
        device: Any = torch.device("cuda", torch.cuda.current_device())
        stream = torch.cuda.Stream(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, world)))
    records = {op: _OpRecord() for op in OPS}

    def data(round_: int) -> RankData:
        if shared is not None:
            return shared[round_][rank]
        return make_round(plan, round_, [rank])[0]

    ctx: Any = torch.cuda.stream(stream) if cuda else _NullCtx()
    with ctx:
        comm = DpSamplingComm(
            tp_size=world,
            rank=rank,
            group=group,
            max_pad_bs=plan.pad_bs,
            num_tokens_per_req=plan.num_tokens,
            vocab_size=plan.vocab,
            logits_dtype=plan.dtype,
            backend=plan.backend,
            device=device,
            timeout_s=plan.timeout_s,
        )
        issued = _issued(group, cuda, plan.timeout_s)
        try:
            for round_ in range(plan.rounds):
                _verify_round(comm, plan, data(round_), device, records, issued)
            _time_ops(comm, plan, data(plan.rounds - 1), device, records, stream, issued)
            _verify_round(comm, plan, data(0), device, records, issued)  # reused buffers
        finally:
            comm.close()
    return {
        "rank": rank,
        "backend": comm.backend,
        "explain": comm.explain(),
        "device": comm.device,
        "ops": {op: vars(rec) for op, rec in records.items()},
    }


def _tensors(d: RankData, plan: DemoPlan, device: Any) -> dict[str, Any]:
    return {
        "logits": to_torch(d.logits, plan.dtype, device),
        "predict": to_torch(d.predict, "int32", device),
        "accept_index": to_torch(d.accept_index, "int32", device),
        "accept_length": to_torch(d.accept_length, "int32", device),
        "logprobs": to_torch(d.logprobs, "float32", device),
    }


def _issued(group: Any, cuda: bool, timeout_s: float) -> Any:
    """Rank threads sharing a GPU agree that every rank has issued an op before any
    of them blocks on it (see ipc_dpsample.testing.run_threads); a no-op otherwise."""
    if not cuda or group is None:
        return lambda: None
    return lambda: group.barrier(timeout_s=timeout_s, what="op issued")


def _verify_round(
    comm: Any,
    plan: DemoPlan,
    d: RankData,
    device: Any,
    records: dict[str, _OpRecord],
    issued: Any,
) -> None:
    t = _tensors(d, plan, device)
    pad_bs = plan.pad_bs
    # Each output is copied to the host before the next op is issued (the contract).
    out = comm.swap_batch_vocab(t["logits"], pad_bs=pad_bs)
    issued()
    got = to_numpy(out)
    _check(records["swap_batch_vocab"], "swapped logits", got, d.expect_swap)
    outs = comm.gather_verify_outputs(
        t["predict"], t["accept_index"], t["accept_length"], pad_bs=pad_bs
    )
    issued()
    rec = records["gather_verify_outputs"]
    for name, out, exp in zip(
        ("predict", "accept_index", "accept_length"), outs, d.expect_outputs, strict=True
    ):
        _check(rec, name, to_numpy(out), exp)
    lp = comm.gather_verify_logprobs(t["logprobs"], pad_bs=pad_bs)
    issued()
    got = to_numpy(lp)
    _check(records["gather_verify_logprobs"], "logprobs", got, d.expect_logprobs)


def _check(rec: _OpRecord, name: str, got: np.ndarray, expected: np.ndarray) -> None:
    rec.checks += 1
    diff = bits_equal(got, expected)
    if diff:
        rec.mismatches.append(f"{name}: {diff}")


def _time_ops(
    comm: Any,
    plan: DemoPlan,
    d: RankData,
    device: Any,
    records: dict[str, _OpRecord],
    stream: Any,
    issued: Any = None,
) -> None:
    t = _tensors(d, plan, device)
    pad_bs = plan.pad_bs
    timer = _timer(plan.device == "cuda", stream, issued)
    calls = {
        "swap_batch_vocab": lambda: comm.swap_batch_vocab(t["logits"], pad_bs=pad_bs),
        "gather_verify_outputs": lambda: comm.gather_verify_outputs(
            t["predict"], t["accept_index"], t["accept_length"], pad_bs=pad_bs
        ),
        "gather_verify_logprobs": lambda: comm.gather_verify_logprobs(t["logprobs"], pad_bs=pad_bs),
    }
    for op, fn in calls.items():
        fn()  # one untimed call per op (first-call costs)
        records[op].times_s = timer(fn, plan.iters)


class _NullCtx:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# -- run and report -----------------------------------------------------------------
def run_demo(plan: DemoPlan, *, timeout_s: float = 240.0) -> list[dict[str, Any]]:
    """Start the ranks of ``plan`` and return every rank's :func:`demo_rank` result.

    Raises
    ------
    ipc_dpsample.testing.RankFailure
        A rank raised or did not finish within ``timeout_s`` (tracebacks included).
    """
    from ..testing import run_ranks, run_threads

    if plan.launch == "threads":
        shared = [make_round(plan, k) for k in range(plan.rounds)]
        return run_threads(plan.world, demo_rank, plan, shared, timeout_s=timeout_s)
    env = {"IPC_DPSAMPLE_TEST_PG_BACKEND": "gloo"} if plan.device == "cpu" else {}
    return run_ranks(plan.world, demo_rank, plan, None, timeout_s=timeout_s, env=env)


def mismatches(results: Sequence[dict[str, Any]]) -> list[str]:
    """Every mismatch any rank reported, as ``rank r op: detail``."""
    return [
        f"rank {res['rank']} {op}: {m}"
        for res in results
        for op, rec in res["ops"].items()
        for m in rec["mismatches"]
    ]


def slowest_rank_times(results: Sequence[dict[str, Any]], op: str) -> list[float]:
    """Per-call time of ``op`` on the slowest rank (the op is done when all are)."""
    per_rank = [res["ops"][op]["times_s"] for res in results]
    return [max(ts) for ts in zip(*per_rank, strict=True)]


def _fmt_time(s: float) -> str:
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def format_report(plan: DemoPlan, results: Sequence[dict[str, Any]]) -> str:
    """The demo's table: backend, shapes, bytes, median and p90 time, verification."""
    backends = sorted({res["backend"] for res in results})
    explain = results[0]["explain"] if results else ""
    lines = [
        f"ipc-dpsample demo: {plan.note}",
        f"backend: {', '.join(backends)} ({explain})",
        f"shapes: pad_bs={plan.pad_bs}, N={plan.num_tokens}, V={plan.vocab}, "
        f"{plan.dtype}, tp={plan.world}; {plan.rounds + 1} verified rounds, "
        f"{plan.iters} timed calls per op",
        "",
    ]
    header = ("op", "input/rank", "output/rank", "dtype", "bytes/rank", "median", "p90", "verified")
    rows = [header]
    for op in OPS:
        times = slowest_rank_times(results, op)
        median = statistics.median(times)
        p90 = float(np.percentile(times, 90))
        bad = sum(len(res["ops"][op]["mismatches"]) for res in results)
        checks = sum(res["ops"][op]["checks"] for res in results)
        ok = "yes" if bad == 0 and checks > 0 else f"NO ({bad}/{checks} wrong)"
        rows.append(
            (
                op,
                *plan.op_shapes(op),
                _fmt_bytes(plan.op_bytes(op)),
                _fmt_time(median),
                _fmt_time(p90),
                f"{ok} ({checks} outputs)" if ok == "yes" else ok,
            )
        )
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
    for r in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return "\n".join(lines)


# -- command line -------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``ipc-dpsample demo``."""
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        metavar="K",
        help="ranks (default: one per GPU; 4 threads on a single GPU; 4 CPU processes)",
    )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="backend to request (IPC_DPSAMPLE_BACKEND overrides it; default: auto)",
    )
    p.add_argument("--iters", type=int, default=20, help="timed calls per op (default: 20)")
    p.add_argument("--cpu", action="store_true", help="use the CPU path even where GPUs exist")
    p.add_argument(
        "--dtype",
        default=None,
        help="logits dtype (bf16, fp16, fp32; default: bf16 on GPUs, fp32 on the CPU)",
    )


def run(ns: argparse.Namespace) -> int:
    """Run ``ipc-dpsample demo``; 0 when every output matched the reference."""
    from dataclasses import replace

    from ..testing import RankFailure

    if ns.iters < 1:
        print(f"ipc-dpsample demo: --iters {ns.iters} must be >= 1", file=sys.stderr)
        return 2
    try:
        plan = plan_demo(
            detect_machine(),
            world_size=ns.world_size,
            backend=ns.backend,
            iters=ns.iters,
            cpu=ns.cpu,
        )
        if ns.dtype is not None:
            plan = replace(plan, dtype=normalize_dtype(ns.dtype))
    except (TypeError, ValueError) as exc:
        print(f"ipc-dpsample demo: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        results = run_demo(plan)
    except RankFailure as exc:
        print(f"ipc-dpsample demo: FAILED ({plan.note})\n{exc}", file=sys.stderr)
        return 1
    print(format_report(plan, results))
    bad = mismatches(results)
    elapsed = time.perf_counter() - t0
    if bad:
        print(f"\nFAILED: {len(bad)} outputs differ from the NumPy reference:")
        for line in bad[:20]:
            print(f"  {line}")
        return 1
    print(f"\nOK: every output is bit-identical to the NumPy reference ({elapsed:.1f} s)")
    return 0

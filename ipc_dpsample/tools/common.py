"""What the tools share: machine detection, bit-exact data helpers, and starting
ranks.

* :func:`detect_machine` probes GPUs and the optional backends once
  (:class:`Machine`); CuPy's ``CUDARuntimeError`` counts as "no GPU".
* :class:`DemoPlan` describes one run of the five ops (ranks, shapes, seed);
  :func:`make_round` draws every rank's seeded random inputs and the reference
  outputs for one round.
* :func:`bits_equal`, :func:`to_torch`, :func:`to_numpy` compare and move data
  bit for bit (bfloat16 travels as its ``uint16`` pattern); :func:`logprobs_close`
  compares the argmax's float32 logprobs with a float64 reference, within
  :func:`logprob_atol` (derived from float32's epsilon, NaN-aware).
* :func:`rank_device` and :func:`stream_scope` set a rank up on its device and
  stream; :func:`spawn` starts ranks as threads or processes;
  :func:`ranks_share_gpu` says when their eager timings need the :class:`Gate`
  (rank threads on one GPU), :func:`time_gated` times behind it;
  :func:`failure_summary` turns a :class:`~ipc_dpsample.testing.RankFailure` into
  one line naming the failing ranks and the first error.
"""

from __future__ import annotations

import math
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ..arrays import ITEMSIZE, LOGITS_DTYPES
from ..config import BACKENDS
from ..layout import (
    reference_argmax_batch_vocab,
    reference_gather_verify_logprobs,
    reference_gather_verify_outputs,
    reference_swap_batch_vocab,
)

__all__ = [
    "ARGMAX",
    "CPU_SHAPE",
    "GATE_CYCLES",
    "GATE_MAX_CYCLES",
    "GPU_SHAPE",
    "OPS",
    "VERIFY",
    "DemoPlan",
    "DeviceKind",
    "Gate",
    "Launch",
    "Machine",
    "NullCtx",
    "RankData",
    "bits_equal",
    "detect_machine",
    "failure_summary",
    "logprob_atol",
    "logprobs_close",
    "make_round",
    "rank_device",
    "ranks_share_gpu",
    "round_logits",
    "spawn",
    "stream_scope",
    "time_gated",
    "to_numpy",
    "to_torch",
    "torch_gpu_count",
]

#: The greedy verify op (the arg-max of every full row without moving the logits).
ARGMAX = "argmax_batch_vocab"
#: The sampled verify op (every rank's shard of every row in, the whole batch's verify
#: results out; :mod:`ipc_dpsample.tools.verify_case` builds its data).
VERIFY = "verify_batch_vocab"
#: The ops: the three collectives in the order a verify step calls them, then the argmax
#: and the sampled verify.
OPS: tuple[str, ...] = (
    "swap_batch_vocab",
    "gather_verify_outputs",
    "gather_verify_logprobs",
    ARGMAX,
    VERIFY,
)

Launch = Literal["processes", "threads"]
DeviceKind = Literal["cpu", "cuda"]

#: Shapes of one verify step on a GPU machine (Qwen-class vocabulary, 3 drafts + 1).
GPU_SHAPE = {"pad_bs": 64, "num_tokens": 4, "vocab": 152064, "dtype": "bfloat16"}
#: Scaled down for a CPU machine (gloo moves the bytes; a 2-core box finishes fast).
CPU_SHAPE = {"pad_bs": 16, "num_tokens": 4, "vocab": 32000, "dtype": "float32"}


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
    #: Time each op behind the :class:`Gate` (rank threads sharing one GPU, see
    #: :func:`ranks_share_gpu`): device time after every rank is released at once.
    gated: bool = False

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

    def comm_options(self) -> dict[str, Any]:
        """The plan's :class:`~ipc_dpsample.DpSamplingComm` keywords, except the rank's
        own (``tp_size``, ``rank``, ``group``, ``device``)."""
        return {
            "max_pad_bs": self.pad_bs,
            "num_tokens_per_req": self.num_tokens,
            "vocab_size": self.vocab,
            "logits_dtype": self.dtype,
            "backend": self.backend,
            "timeout_s": self.timeout_s,
        }

    @property
    def bs(self) -> int:
        """The real batch size of the demo's one ``bs < pad_bs`` pass: the last rank
        owns no real request and the one before it a part of its ``R`` (when the
        world has them)."""
        return max(1, self.pad_bs - self.reqs_per_rank - 1)

    def op_shapes(self, op: str) -> tuple[str, str, str]:
        """``(input per rank, output per rank, dtype)`` as text, for the table."""
        r, n, v = self.reqs_per_rank, self.num_tokens, self.vocab
        if op == "swap_batch_vocab":
            return f"[{self.pad_bs * n}, {self.vocab_shard}]", f"[{r * n}, {v}]", self.dtype
        if op == "gather_verify_outputs":
            return f"3 x [{r}, {n}]", f"3 x [{self.pad_bs}, {n}]", "int32"
        if op == ARGMAX:
            return f"[{self.pad_bs * n}, {self.vocab_shard}]", f"2 x [{r * n}]", self.dtype
        if op == VERIFY:
            logits = f"[{self.pad_bs * n}, {self.vocab_shard}]"
            return f"{logits} + [{self.pad_bs}, {n}]", f"3 x [{self.pad_bs}, {n}]", self.dtype
        return f"[{r}, {n}]", f"[{self.pad_bs}, {n}]", "float32"

    def op_bytes(self, op: str) -> int:
        """Bytes each rank receives in ``op`` (its output's size; the verify's records
        are in the demo's footnote)."""
        r, n = self.reqs_per_rank, self.num_tokens
        if op == "swap_batch_vocab":
            return r * n * self.vocab * ITEMSIZE[self.dtype]
        if op in ("gather_verify_outputs", VERIFY):
            return self.pad_bs * (2 * n + 1) * 4
        if op == ARGMAX:
            return r * n * 8  # int32 ids + float32 logprobs
        return self.pad_bs * n * 4


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
    expect_argmax: tuple[np.ndarray, np.ndarray]  # int32 [R * N], float32 [R * N]


def _random_logits(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    values = rng.standard_normal(shape, dtype=np.float32) * np.float32(4.0)
    if dtype == "float32":
        return values
    if dtype == "float16":
        return values.astype(np.float16)
    return (values.view(np.uint32) >> 16).astype(np.uint16)  # bfloat16 bits (truncated)


def _round_start(plan: DemoPlan, round_: int) -> tuple[np.random.Generator, list[np.ndarray]]:
    rng = np.random.default_rng([plan.seed, round_])
    shape = (plan.pad_bs * plan.num_tokens, plan.vocab // plan.world)
    return rng, [_random_logits(rng, shape, plan.dtype) for _ in range(plan.world)]


def round_logits(plan: DemoPlan, round_: int) -> list[np.ndarray]:
    """Every rank's ``local_logits`` of one round, as :func:`make_round` gives them
    (``verify_batch_vocab``'s reference needs every shard)."""
    return _round_start(plan, round_)[1]


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
    rng, logits = _round_start(plan, round_)
    predict = [rng.integers(1, v, (r, n), dtype=np.int32) for _ in range(w)]
    accept_index = [rng.integers(1, plan.pad_bs * n, (r, n), dtype=np.int32) for _ in range(w)]
    accept_length = [rng.integers(1, n + 1, (r,), dtype=np.int32) for _ in range(w)]
    logprobs = [-rng.exponential(2.0, (r, n)).astype(np.float32) - 1e-3 for _ in range(w)]
    swapped = reference_swap_batch_vocab(logits, tp=w, num_tokens_per_req=n, pad_bs=plan.pad_bs)
    outputs = reference_gather_verify_outputs(predict, accept_index, accept_length)
    gathered_lp = reference_gather_verify_logprobs(logprobs)
    argmax = reference_argmax_batch_vocab(
        logits, tp=w, num_tokens_per_req=n, pad_bs=plan.pad_bs, dtype=plan.dtype
    )
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
            expect_argmax=argmax[k],
        )
        for k in (range(w) if ranks is None else ranks)
    ]


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


#: Headroom of :func:`logprob_atol` over its error estimate: the order of a
#: reduction differs between the CPU's blocked sums and a GPU's thread trees.
LOGPROB_HEADROOM = 2.0


def logprob_atol(expected: np.ndarray, vocab: int) -> np.ndarray:
    """Per-element tolerance of an argmax logprob computed in float32 against its
    float64 reference ``expected`` (same shape), for rows of ``vocab`` counted columns.

    The logits (bfloat16, float16 or float32) are decoded to float32 exactly, so
    their dtype adds no error: the tolerance comes from the arithmetic, which is
    float32. Every backend computes ``lp = -log(S)``, ``S = sum_j exp(x_j - max)``
    (the winner's own term is 1). With ``eps`` float32's machine epsilon:

    * ``S``'s relative error becomes ``lp``'s absolute error (``d(-log S) = -dS/S``);
    * each term: ``x_j - max`` rounds by ``eps/2 |x_j - max|``, ``exp`` adds an ulp
      (CUDA's ``__expf``: ``2 + 1.2 |x_j - max|`` ulp). Weighted by the softmax
      ``p_j``, ``sum_j p_j |x_j - max| = H - |lp| <= ln(vocab)`` (``H`` its entropy):
      at most ``eps (2 + 1.2 log2 vocab)``, however large the logits are;
    * summing ``vocab`` positive terms in a reduction of depth ``log2 vocab``:
      ``eps log2 vocab`` (a sequential sum's worst case, ``vocab * eps``, would
      accept almost anything);
    * the final ``log`` and the rounding of ``lp`` to float32: ``2 eps |lp|``.

    Total ``eps (2 |lp| + 2.2 log2 vocab + 2)``, times :data:`LOGPROB_HEADROOM`:
    1.1e-5 at ``vocab = 152064`` and ``|lp| = 3.5``, 9.7e-6 at 32000 and 3, 40 to 50
    ulps of ``lp``. The library stays within 4.2e-7 there; float32
    ``torch.log_softmax`` does not (up to 2.6e-5: it forms ``max + log S`` first and
    rounds at the ulp of ``max``), which is why the reference is float64.
    """
    eps = float(np.finfo(np.float32).eps)
    log2v = math.log2(max(int(vocab), 2))
    magnitude = np.abs(np.asarray(expected, dtype=np.float64))
    return LOGPROB_HEADROOM * eps * (2.0 * magnitude + 2.2 * log2v + 2.0)


def logprobs_close(
    got: np.ndarray, expected: np.ndarray, vocab: int, *, atol: float | None = None
) -> str:
    """``""`` when the float32 logprobs ``got`` agree with the reference ``expected``
    (float64 where possible) within :func:`logprob_atol` for rows of ``vocab``
    columns (or a fixed ``atol``); NaN matches NaN and an infinity only itself.
    Else how many differ and the first one."""
    if got.shape != expected.shape:
        return f"shape {got.shape} != expected {expected.shape}"
    g, e = got.astype(np.float64), expected.astype(np.float64)
    tol = logprob_atol(e, vocab) if atol is None else np.full(e.shape, float(atol))
    with np.errstate(invalid="ignore"):
        near = np.isfinite(e) & (np.abs(g - e) <= tol)
        ok = (g == e) | (np.isnan(g) & np.isnan(e)) | near
    bad = np.flatnonzero(~ok.reshape(-1))
    if bad.size == 0:
        return ""
    i = int(bad[0])
    with np.errstate(invalid="ignore"):  # inf - inf
        err = np.abs(g - e).reshape(-1)[bad]
    worst = float(np.nan_to_num(err, nan=np.inf).max())
    return (
        f"{bad.size} of {g.size} logprobs differ from the float64 reference by more than "
        f"the float32 tolerance (worst {worst:.3g}); first at {i}: got "
        f"{g.reshape(-1)[i]!r}, expected {e.reshape(-1)[i]!r} (tolerance "
        f"{tol.reshape(-1)[i]:.3g})"
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


class NullCtx:
    """A context manager that does nothing (the CPU path's stream scope)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# -- ranks --------------------------------------------------------------------------
def rank_device(device: DeviceKind, launch: Launch, world: int) -> tuple[Any, Any]:
    """Set a rank up: its ``torch.device`` and its own CUDA stream (None on the CPU).

    Rank threads share GPU 0; a process rank uses the GPU ``run_ranks`` gave it. A
    CPU rank gets an equal share of the cores for torch's intra-op threads.
    """
    import torch

    if device == "cuda":
        if launch == "threads":
            torch.cuda.set_device(0)
        dev = torch.device("cuda", torch.cuda.current_device())
        return dev, torch.cuda.Stream(dev)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, world)))
    return torch.device("cpu"), None


def stream_scope(stream: Any) -> Any:
    """``torch.cuda.stream(stream)``, or :class:`NullCtx` when ``stream`` is None."""
    if stream is None:
        return NullCtx()
    import torch

    return torch.cuda.stream(stream)


def ranks_share_gpu(launch: str, device: str) -> bool:
    """Whether the ranks of a launch share one GPU: rank threads of this process
    on GPU 0 (the tools start one process per GPU otherwise, and CPU ranks over
    gloo). Their eager timings are then timed behind a :class:`Gate` by default:
    ungated, each thread's events time its turn at the GIL, not the op."""
    return device == "cuda" and launch == "threads"


#: First length of the gate (GPU cycles of ``torch.cuda._sleep``, ~4 ms at 2 GHz),
#: and the longest it grows to (~0.5 s).
GATE_CYCLES = 8_000_000
GATE_MAX_CYCLES = 1_000_000_000


class Gate:
    """Holds every rank thread's stream at one CUDA event until all of them have
    issued a sample: their kernels then start together, so the time per op is the
    device's, not the skew of Python threads taking turns at the GIL.

    Rank 0 arms it (a sleep kernel on a side stream, then the event) before the
    others issue; each rank's stream waits for the event. A gate that opened
    before every rank had issued (:meth:`check_closed`) doubles its length and the
    sample is taken again (:func:`time_gated`); ``early`` counts those samples and
    ``skewed`` the ones kept anyway because the gate was at ``max_cycles`` (they
    include launch skew). One object serves every rank thread of a launch; its
    stream and event are made by the first rank that uses it, inside the rank
    threads (after :func:`~ipc_dpsample.testing.run_threads` has set
    ``CUDA_DEVICE_MAX_CONNECTIONS``).
    """

    def __init__(self, cycles: int = GATE_CYCLES, max_cycles: int = GATE_MAX_CYCLES) -> None:
        if not 0 < cycles <= max_cycles:
            raise ValueError(f"gate cycles={cycles} must be in 1..max_cycles={max_cycles}")
        self.cycles = cycles
        self.max_cycles = max_cycles
        self.early = 0
        self.skewed = 0
        #: The last sample must be taken again (set by rank 0, read after a barrier).
        self.retake = False
        self._lock = threading.Lock()
        self._cuda: tuple[Any, Any] | None = None

    def _stream_event(self) -> tuple[Any, Any]:
        with self._lock:
            if self._cuda is None:
                import torch

                self._cuda = (torch.cuda.Stream(), torch.cuda.Event())
            return self._cuda

    def arm(self) -> None:
        """Start the sleep kernel and record the event behind it (rank 0)."""
        import torch

        stream, event = self._stream_event()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(self.cycles)
            event.record(stream)

    def hold(self, stream: Any) -> None:
        """Make ``stream`` wait until the gate opens."""
        stream.wait_event(self._stream_event()[1])

    def check_closed(self) -> None:
        """After every rank has issued (rank 0): an open gate means the sample
        includes launch skew; lengthen the gate and ask for a retake, unless the
        gate is at its longest already."""
        opened = bool(self._stream_event()[1].query())
        self.retake = opened and self.cycles < self.max_cycles
        if opened:
            self.early += 1
            if self.retake:
                self.cycles = min(2 * self.cycles, self.max_cycles)
            else:
                self.skewed += 1


def time_gated(
    group: Any,
    rank: int,
    gate: Gate,
    stream: Any,
    body: Callable[[], Any],
    *,
    iters: int,
    timeout_s: float,
    repeat: int = 1,
    calls: int = 1,
) -> list[float]:
    """Seconds per call of ``body``: ``iters`` samples, each ``repeat`` runs of
    ``body`` (holding ``calls`` calls each) issued on ``stream`` behind ``gate``
    and timed with CUDA events. Every rank thread of ``group`` calls it with the
    same arguments; host barriers order the gate (armed by rank 0 before anyone
    issues) and the check that it was still closed when all had issued. A sample
    whose gate opened early is dropped by every rank and taken again."""
    import torch

    out: list[float] = []
    taken = False
    while True:
        group.barrier(timeout_s=timeout_s, what="gated sample")
        if taken and gate.retake:  # rank 0 set it before this barrier
            out.pop()
        if len(out) >= iters:
            return out
        if rank == 0:
            gate.arm()
        group.barrier(timeout_s=timeout_s, what="gate armed")
        gate.hold(stream)
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record(stream)
        for _ in range(repeat):
            body()
        end.record(stream)
        group.barrier(timeout_s=timeout_s, what="sample issued")
        if rank == 0:
            gate.check_closed()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3 / (calls * repeat))
        taken = True


def spawn(
    launch: Launch,
    device: DeviceKind,
    world: int,
    body: Callable[..., Any],
    *args: Any,
    timeout_s: float,
) -> list[Any]:
    """Run ``body(rank, world, group, *args)`` on ``world`` ranks: threads of this
    process (``launch="threads"``) or spawned processes (over gloo on the CPU).

    Raises
    ------
    ipc_dpsample.testing.RankFailure
        A rank raised or did not finish within ``timeout_s`` (tracebacks included).
    """
    from ..testing import run_ranks, run_threads

    if launch == "threads":
        return run_threads(world, body, *args, timeout_s=timeout_s)
    env = {"IPC_DPSAMPLE_TEST_PG_BACKEND": "gloo"} if device == "cpu" else {}
    return run_ranks(world, body, *args, timeout_s=timeout_s, env=env)


_RANK_HEADER = re.compile(r"^--- rank (\d+) failed ---$", re.M)
_HUNG = re.compile(r"^--- ranks \[([\d, ]*)\] (.*) ---$", re.M)


def failure_summary(message: str) -> str:
    """One line from a ``RankFailure`` message: the failing ranks and the first error.

    ``"rank 1 failed: ValueError: bad shape"``; ranks that hung are named too
    (``"ranks 0, 2 failed (ranks [3] did not finish ...)"``).
    """
    failed = [int(m.group(1)) for m in _RANK_HEADER.finditer(message)]
    hung = _HUNG.search(message)
    parts = _RANK_HEADER.split(message)
    first = ""
    if failed:
        tb = parts[2].split("\n--- ")[0]
        lines = [line.strip() for line in tb.strip().splitlines() if line.strip()]
        first = lines[-1] if lines else ""
    who = ", ".join(map(str, failed))
    text = f"rank{'s' if len(failed) != 1 else ''} {who} failed" if failed else ""
    if hung:
        what = f"ranks [{hung.group(1)}] {hung.group(2)}"
        text = f"{text} ({what})" if text else what
    if first:
        text += f": {first}"
    return text or (message.strip().splitlines() or ["ranks failed"])[-1]

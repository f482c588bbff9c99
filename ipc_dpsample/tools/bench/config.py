"""What ``ipc-dpsample bench`` measures: the sweep's names and defaults, the
validated :class:`BenchConfig`, where each ``tp`` runs (:func:`plan_launches`,
pure), the points and their bytes (the options live in :mod:`.options`).

A point is ``(op, dtype, pad_bs, bs, mode, mix)``: ``mix`` is the per-request parameter
mix of ``verify_batch_vocab`` and of its ``swap_sample_gather`` baseline
(:data:`~ipc_dpsample.tools.verify_case.VERIFY_MIXES`), ``""`` for every other op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...arrays import ITEMSIZE, LOGITS_DTYPES
from ...layout import Layout
from ..common import ARGMAX, OPS, VERIFY, Machine, ranks_share_gpu
from ..verify_case import DEMO_MIX, VERIFY_MIXES, onesided_broadcasts, record_bytes

__all__ = [
    "ARGMAX_BASELINES",
    "BACKEND_CHOICES",
    "BASELINES",
    "COLUMNS",
    "DEFAULT_OPS",
    "FULL_ROW_SAMPLER",
    "LOGITS_OPS",
    "MIX_OPS",
    "MODES",
    "VERIFY_BASELINES",
    "BenchConfig",
    "LaunchPlan",
    "op_bytes",
    "plan_launches",
    "points",
]

BACKEND_CHOICES: tuple[str, ...] = ("auto", "onesided", "nccl", "torch")
#: The ops a sweep measures unless ``--ops`` names others: every op but
#: ``verify_batch_vocab``, whose torch path and reference run on the host (seconds per
#: point at the GPU shapes): it is measured when ``--ops`` names it.
DEFAULT_OPS: tuple[str, ...] = tuple(op for op in OPS if op != VERIFY)
BASELINES: tuple[str, ...] = ("copy", "nccl_cupy", "torch_dist")
MODES: tuple[str, ...] = ("eager", "graph")
#: The baselines of ``argmax_batch_vocab``, measured as ops of every backend in the
#: same run: ``swap_argmax`` is that backend's swap then ``torch.argmax`` over the
#: swapped real rows (what a caller runs today); ``read_once`` is
#: ``torch.amax(local_logits[:bs*N], dim=1)`` (reading the shard's real rows once).
ARGMAX_BASELINES: tuple[str, ...] = ("swap_argmax", "read_once")
#: What ``verify_batch_vocab`` brings, measured by every backend on the same logits:
#: ``swap_sample_gather`` is TokenSpeed's Batch-DP route with the package's full-row
#: sampler of the same semantics (the backend's swap, ``sampling.verify_rows`` over the
#: rank's swapped rows, the backend's ``gather_verify_outputs``); ``read_once`` as for
#: the argmax; ``argmax_batch_vocab`` itself (the greedy op, a target's reference).
VERIFY_BASELINES: tuple[str, ...] = ("swap_sample_gather", "read_once", ARGMAX)
#: The full-row sampler of ``swap_sample_gather`` (named in its table).
FULL_ROW_SAMPLER = "ipc_dpsample.sampling.verify_rows (torch, on the rank's device)"
#: Ops whose points carry a parameter mix.
MIX_OPS: tuple[str, ...] = (VERIFY, "swap_sample_gather")
#: Sweep defaults where GPUs exist (the spec's shapes: Qwen-class vocab, 3 drafts + 1).
GPU_DEFAULTS: dict[str, Any] = {
    "pad_bs": (8, 64, 256),
    "vocab": 152064,
    "dtypes": ("bfloat16", "float32"),
    "tp": (2, 4, 8),
}
#: Sweep defaults on the CPU path (gloo moves the bytes; sized for a small box).
CPU_DEFAULTS: dict[str, Any] = {
    "pad_bs": (8, 64),
    "vocab": 32000,
    "dtypes": ("float32",),
    "tp": (2, 4),
}
#: Columns of ``bench.csv`` (and keys of every row in ``bench.json``).
COLUMNS: tuple[str, ...] = (
    "tp",
    "launch",
    "device",
    "op",
    "dtype",
    "pad_bs",
    "bs",
    "bs_arg",
    "vocab_limit",
    "num_tokens",
    "vocab",
    "mode",
    "impl",
    "kind",
    "resolved",
    "status",
    "verified",
    "n",
    "median_us",
    "p10_us",
    "p90_us",
    "mean_us",
    "min_us",
    "max_us",
    "bytes",
    "algbw_gbps",
    "busbw_gbps",
    "vs_copy",
    "vs_nccl_cupy",
    "vs_torch_dist",
    "vs_swap_argmax",
    "vs_read_once",
    "vs_full_bs",
    "mix",
    "record_bytes",
    "vs_swap_sample_gather",
    "vs_argmax",
    "note",
)


# -- configuration ------------------------------------------------------------------
@dataclass(frozen=True)
class BenchConfig:
    """A validated sweep.

    Raises
    ------
    ValueError
        On an empty list, a non-positive size or an unknown name.
    """

    pad_bs: tuple[int, ...] = GPU_DEFAULTS["pad_bs"]
    num_tokens: int = 4
    vocab: int = GPU_DEFAULTS["vocab"]
    dtypes: tuple[str, ...] = GPU_DEFAULTS["dtypes"]
    tp: tuple[int, ...] = GPU_DEFAULTS["tp"]
    backends: tuple[str, ...] = BACKEND_CHOICES
    modes: tuple[str, ...] = MODES
    ops: tuple[str, ...] = DEFAULT_OPS
    baselines: tuple[str, ...] = BASELINES
    iters: int = 50
    warmup: int = 10
    graph_ops: int = 10
    out: str = "ipc-dpsample-bench"
    cpu: bool = False
    verify: bool = True
    seed: int = 0
    timeout_s: float = 1800.0
    #: Every ``tp`` as rank threads on GPU 0, also where ``tp <= GPUs`` (which get a
    #: process per GPU otherwise). Rank threads sharing a GPU are gated unless
    #: ``ungated``: their streams wait at one CUDA event until every rank has issued
    #: a sample, so the time is the device's, not launch skew.
    gated: bool = False
    #: Time rank threads sharing a GPU without the gate (the host path: each
    #: thread's eager calls as it gets its turn at the GIL).
    ungated: bool = False
    #: Real batch sizes: one tuple per ``pad_bs`` (same order), or a single tuple
    #: for every ``pad_bs``; passed as ``bs=`` to every op. Empty: ``bs`` is not
    #: passed (every row moves; rows carry ``bs = pad_bs``).
    bs: tuple[tuple[int, ...], ...] = ()
    #: ``vocab_limit`` of ``argmax_batch_vocab`` and ``verify_batch_vocab`` (None: ``vocab``).
    vocab_limit: int | None = None
    #: The parameter mixes ``verify_batch_vocab`` is measured with (one point each).
    verify_mixes: tuple[str, ...] = (DEMO_MIX,)
    #: The baselines ``verify_batch_vocab`` brings (a subset of :data:`VERIFY_BASELINES`).
    verify_baselines: tuple[str, ...] = VERIFY_BASELINES

    def bs_values(self, pad_bs: int) -> tuple[int, ...]:
        """The real batch sizes measured at ``pad_bs`` (``(pad_bs,)`` without ``--bs``)."""
        if not self.bs:
            return (pad_bs,)
        return self.bs[0] if len(self.bs) == 1 else self.bs[self.pad_bs.index(pad_bs)]

    @property
    def limit(self) -> int:
        """The argmax's ``vocab_limit`` (``vocab`` when not given)."""
        return self.vocab if self.vocab_limit is None else self.vocab_limit

    def __post_init__(self) -> None:
        for name in ("pad_bs", "dtypes", "tp", "backends", "modes", "ops", "verify_mixes"):
            if not getattr(self, name):
                raise ValueError(f"{name} must not be empty")
        for name, values in (("pad_bs", self.pad_bs), ("tp", self.tp)):
            bad = [v for v in values if v < 1]
            if bad:
                raise ValueError(f"{name} values {bad} must be >= 1")
        for name, value in (("num_tokens", self.num_tokens), ("vocab", self.vocab)):
            if value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if self.iters < 1 or self.warmup < 0 or self.graph_ops < 1:
            raise ValueError(
                f"iters={self.iters} must be >= 1, warmup={self.warmup} >= 0, "
                f"graph_ops={self.graph_ops} >= 1"
            )
        for name, values, allowed in (
            ("dtypes", self.dtypes, LOGITS_DTYPES),
            ("backends", self.backends, BACKEND_CHOICES),
            ("modes", self.modes, MODES),
            ("ops", self.ops, OPS),
            ("baselines", self.baselines, BASELINES),
            ("verify_mixes", self.verify_mixes, VERIFY_MIXES),
            ("verify_baselines", self.verify_baselines, VERIFY_BASELINES),
        ):
            bad = [v for v in values if v not in allowed]
            if bad:
                raise ValueError(f"{name} {bad} not in {allowed}")
        if self.bs:
            if len(self.bs) not in (1, len(self.pad_bs)) or not all(self.bs):
                raise ValueError(
                    f"bs={self.bs}: expected one list of real batch sizes for every pad_bs "
                    f"or one list per pad_bs={self.pad_bs} (--bs 64,8/256,130)"
                )
            for p in self.pad_bs:
                bad = [b for b in self.bs_values(p) if not 0 < b <= p]
                if bad:
                    raise ValueError(
                        f"bs={bad} out of range for pad_bs={p}: expected 1 <= bs <= pad_bs "
                        "(one list per pad_bs: --bs 64,8/256,130)"
                    )
        if self.vocab_limit is not None and not 1 <= self.vocab_limit <= self.vocab:
            raise ValueError(
                f"vocab_limit={self.vocab_limit} out of range: expected 1 <= vocab_limit <= "
                f"vocab={self.vocab}"
            )
        if self.gated and self.ungated:
            raise ValueError("gated and ungated exclude each other (--gated, --ungated)")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be > 0")


# -- plan ---------------------------------------------------------------------------
@dataclass(frozen=True)
class LaunchPlan:
    """One set of ranks of the sweep (one ``tp``).

    Attributes
    ----------
    tp : int
    launch : {"processes", "threads"}
    device : {"cpu", "cuda"}
    impls : tuple of str
        Backends and baselines these ranks measure.
    skipped : tuple of (impl, reason)
        Requested ones that cannot run here.
    pad_bs : tuple of int
        The configured batch sizes that are multiples of ``tp``.
    modes : tuple of str
    reason : str
        Non-empty when the whole launch is skipped.
    gated : bool
        Eager and graph samples start behind the :class:`~ipc_dpsample.tools.common.Gate`:
        the ranks share a GPU (:func:`~ipc_dpsample.tools.common.ranks_share_gpu`)
        and ``--ungated`` was not given.
    """

    tp: int
    launch: str
    device: str
    impls: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]
    pad_bs: tuple[int, ...]
    modes: tuple[str, ...]
    reason: str = ""
    gated: bool = False


def plan_launches(cfg: BenchConfig, machine: Machine) -> list[LaunchPlan]:
    """Where each ``tp`` runs and what it can measure (pure)."""
    cuda = machine.gpus > 0 and not cfg.cpu
    plans = []
    for tp in cfg.tp:
        pads = tuple(p for p in cfg.pad_bs if p % tp == 0)
        reason = ""
        if cfg.vocab % tp:
            reason = f"vocab={cfg.vocab} is not a multiple of tp={tp}"
        elif not pads:
            reason = f"no pad_bs in {cfg.pad_bs} is a multiple of tp={tp}"
        skipped: list[tuple[str, str]] = []
        modes = cfg.modes
        if cfg.gated and not cuda:
            reason = "--gated needs a CUDA GPU (rank threads sharing GPU 0)"
        if not cuda:
            launch, device = "processes", "cpu"
            for b in cfg.backends:
                if b in ("onesided", "nccl"):
                    skipped.append((b, f"{b} needs CUDA data (CPU sweep)"))
            if "nccl_cupy" in cfg.baselines:
                skipped.append(("nccl_cupy", "needs a GPU per rank (CPU sweep)"))
            if "graph" in modes:
                skipped.append(("graph", "CUDA graphs need CUDA (CPU sweep)"))
                modes = tuple(m for m in modes if m != "graph")
        elif tp <= machine.gpus and not cfg.gated:
            launch, device = "processes", "cuda"
            if "nccl_cupy" in cfg.baselines and not (machine.cupy_nccl and machine.cupy_gpus):
                skipped.append(("nccl_cupy", "cupy.cuda.nccl cannot load libnccl here"))
        else:
            launch, device = "threads", "cuda"
            for b in cfg.backends:
                if b == "torch":
                    skipped.append(
                        (
                            b,
                            f"torch.distributed needs one process per GPU ({tp} > "
                            f"{machine.gpus} GPUs)",
                        )
                    )
                elif b == "nccl":
                    skipped.append(
                        (b, f"NCCL refuses two ranks on one GPU ({tp} > {machine.gpus} GPUs)")
                    )
            for b in ("nccl_cupy", "torch_dist"):
                if b in cfg.baselines:
                    skipped.append((b, f"needs one GPU per rank ({tp} > {machine.gpus} GPUs)"))
            if not (machine.onesided and machine.cupy_gpus):
                reason = reason or (
                    f"tp={tp} > {machine.gpus} GPUs needs in-process ranks with the one-sided "
                    f"backend, which is unavailable: "
                    f"{machine.onesided_error or 'CuPy cannot drive the GPU'}"
                )
        gone = {name for name, _ in skipped}
        impls = tuple(b for b in cfg.backends if b not in gone) + tuple(
            b for b in cfg.baselines if b not in gone
        )
        if not reason and not any(i in BACKEND_CHOICES for i in impls):
            reason = "none of the requested backends can run here"
        gated = ranks_share_gpu(launch, device) and not cfg.ungated
        plans.append(
            LaunchPlan(tp, launch, device, impls, tuple(skipped), pads, modes, reason, gated)
        )
    return plans


Point = tuple[str, str, int, int, str, str]


def points(cfg: BenchConfig, lp: LaunchPlan, impl: str | None = None) -> list[Point]:
    """``(op, dtype, pad_bs, bs, mode, mix)`` measured by ``impl`` of ``lp`` (every
    point when None). The logits dtype sweeps the logits ops only (the gathers move
    int32 / float32); ``argmax_batch_vocab`` brings :data:`ARGMAX_BASELINES` and
    ``verify_batch_vocab`` :data:`VERIFY_BASELINES` (measured by backends only; an op
    brought twice is measured once); the raw baselines measure the collectives and
    the verify's records (an all-gather of them). ``mix`` runs over
    ``cfg.verify_mixes`` for :data:`MIX_OPS` and the raw baselines of the verify, else
    is ``""``. ``bs`` is innermost: one CUDA graph serves every ``bs`` of its point."""
    ops: list[str] = []
    for op in cfg.ops:
        ops += [op]
        ops += list(ARGMAX_BASELINES) if op == ARGMAX else []
        ops += list(cfg.verify_baselines) if op == VERIFY else []
    ops = list(dict.fromkeys(ops))
    if impl is not None and impl not in BACKEND_CHOICES:
        ops = [op for op in ops if op in OPS and op != ARGMAX]
    out = []
    for op in ops:
        dtypes = cfg.dtypes if op in LOGITS_OPS else (_gather_dtype(op),)
        for mix in cfg.verify_mixes if op in MIX_OPS else ("",):
            for pad_bs in lp.pad_bs:
                for dtype in dtypes:
                    for mode in lp.modes:
                        out += [(op, dtype, pad_bs, b, mode, mix) for b in cfg.bs_values(pad_bs)]
    return out


#: Ops whose data is the logits (``[pad_bs*N, V/tp]`` in ``--dtype``).
LOGITS_OPS: tuple[str, ...] = (
    "swap_batch_vocab",
    ARGMAX,
    *ARGMAX_BASELINES,
    VERIFY,
    "swap_sample_gather",
)


def _gather_dtype(op: str) -> str:
    return "int32" if op == "gather_verify_outputs" else "float32"


def op_bytes(
    op: str,
    dtype: str,
    pad_bs: int,
    tp: int,
    num_tokens: int,
    vocab: int,
    bs: int | None = None,
    mix: str = "",
    vocab_limit: int | None = None,
    backend: str = "torch",
    max_pad_bs: int | None = None,
) -> int:
    """Bytes one rank moves in ``op`` with ``bs`` real requests (None: ``pad_bs``),
    what the copy baseline copies. The swap: its input rows of real requests
    (:meth:`~ipc_dpsample.layout.Layout.swap_bytes_per_rank`, = what it receives
    when ``bs = pad_bs``); the argmax, ``read_once`` and ``swap_argmax``: the same
    logits bytes (the shard's real rows, read once or sent); a gather: the ``bs``
    real rows it receives; ``verify_batch_vocab``: the records of the real rows it
    holds after the all-gather, ``tp * bs * N *`` :func:`~ipc_dpsample.tools.
    verify_case.record_bytes` of ``mix`` (its own included, as for a gather; a probe
    round is not counted) on the torch backend; on ``backend`` onesided / nccl the
    records of its own rows from every rank, ``bs * N * record``, plus the results'
    gather (``swap_sample_gather``'s bytes when the kernels refuse the mix), except
    that a one-sided call that broadcasts (a small batch: ``verify_case.
    onesided_broadcasts`` with the communicator's ``max_pad_bs``) receives every real
    row's record from every rank, ``tp * bs * N * record``, and gathers nothing;
    ``swap_sample_gather``: the swap's bytes plus the gather's."""
    layout = Layout(tp, pad_bs, num_tokens, vocab)
    reqs = pad_bs if bs is None else min(max(bs, 0), pad_bs)
    if op == VERIFY:
        rec = record_bytes(
            mix, pad_bs, num_tokens, vocab, bs=reqs, vocab_limit=vocab_limit, backend=backend
        )
        if backend not in ("onesided", "nccl"):
            return tp * reqs * num_tokens * rec
        if rec == 0:
            return op_bytes("swap_sample_gather", dtype, pad_bs, tp, num_tokens, vocab, bs)
        if backend == "onesided" and onesided_broadcasts(
            mix, pad_bs, num_tokens, vocab, tp, max_pad_bs=max_pad_bs
        ):
            return tp * reqs * num_tokens * rec
        return reqs * num_tokens * rec + reqs * (2 * num_tokens + 1) * 4
    if op == "swap_sample_gather":
        swap = layout.swap_bytes_per_rank(pad_bs, ITEMSIZE[dtype], reqs)
        return swap + reqs * (2 * num_tokens + 1) * 4
    if op in LOGITS_OPS:
        return layout.swap_bytes_per_rank(pad_bs, ITEMSIZE[dtype], reqs)
    if op == "gather_verify_outputs":
        return reqs * (2 * num_tokens + 1) * 4
    return reqs * num_tokens * 4

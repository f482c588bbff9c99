"""What ``ipc-dpsample bench`` measures: the sweep's names and defaults, the
validated :class:`BenchConfig`, its command-line options, and where each ``tp``
runs (:func:`plan_launches`, pure).
"""

from __future__ import annotations

import argparse
import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ...arrays import ITEMSIZE, LOGITS_DTYPES, normalize_dtype
from ..common import OPS, Machine

__all__ = [
    "BACKEND_CHOICES",
    "BASELINES",
    "COLUMNS",
    "MODES",
    "BenchConfig",
    "LaunchPlan",
    "add_arguments",
    "choice_list",
    "config_from_args",
    "op_bytes",
    "parse_dtype_list",
    "parse_int_list",
    "plan_launches",
    "points",
]

BACKEND_CHOICES: tuple[str, ...] = ("auto", "onesided", "nccl", "torch")
BASELINES: tuple[str, ...] = ("copy", "nccl_cupy", "torch_dist")
MODES: tuple[str, ...] = ("eager", "graph")
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
    ops: tuple[str, ...] = OPS
    baselines: tuple[str, ...] = BASELINES
    iters: int = 50
    warmup: int = 10
    graph_ops: int = 10
    out: str = "ipc-dpsample-bench"
    cpu: bool = False
    verify: bool = True
    seed: int = 0
    timeout_s: float = 1800.0
    #: Rank threads on one GPU whose streams wait at one CUDA event until every
    #: rank has issued a sample: the time is the device's, not launch skew.
    gated: bool = False
    #: Real batch size per ``pad_bs`` (same length), passed as ``bs=`` to the swap;
    #: empty: every row moves and no ``bs`` is passed.
    bs: tuple[int, ...] = ()

    def real_bs(self, pad_bs: int) -> int | None:
        """The ``bs`` paired with ``pad_bs``, or None when ``--bs`` was not given."""
        return self.bs[self.pad_bs.index(pad_bs)] if self.bs else None

    def __post_init__(self) -> None:
        for name in ("pad_bs", "dtypes", "tp", "backends", "modes", "ops"):
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
        ):
            bad = [v for v in values if v not in allowed]
            if bad:
                raise ValueError(f"{name} {bad} not in {allowed}")
        if self.bs and (
            len(self.bs) != len(self.pad_bs)
            or any(not 0 < b <= p for b, p in zip(self.bs, self.pad_bs, strict=True))
        ):
            raise ValueError(
                f"bs={self.bs} must pair one real batch size 1..pad_bs with each "
                f"pad_bs={self.pad_bs}"
            )
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be > 0")


def parse_int_list(text: str) -> tuple[int, ...]:
    """``"8,64,256"`` -> ``(8, 64, 256)`` (argparse ``type=``)."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("empty list")
    return values


def parse_dtype_list(text: str) -> tuple[str, ...]:
    """``"bf16,fp32"`` -> ``("bfloat16", "float32")`` (argparse ``type=``)."""
    out = []
    for v in text.split(","):
        if not v.strip():
            continue
        try:
            name = normalize_dtype(v.strip())
        except TypeError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if name not in LOGITS_DTYPES:
            raise argparse.ArgumentTypeError(f"{v!r}: logits dtypes are {LOGITS_DTYPES}")
        out.append(name)
    if not out:
        raise argparse.ArgumentTypeError("empty list")
    return tuple(dict.fromkeys(out))


def choice_list(choices: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """An argparse ``type=`` for a comma-separated subset of ``choices``."""

    def parse(text: str) -> tuple[str, ...]:
        values = tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
        bad = [v for v in values if v not in choices]
        if bad or not values:
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected a comma-separated subset of {','.join(choices)}"
            )
        return values

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``ipc-dpsample bench``."""

    def dflt(key: str) -> str:
        g, c = GPU_DEFAULTS[key], CPU_DEFAULTS[key]
        if isinstance(g, tuple):
            return f"default {','.join(map(str, g))}; --cpu: {','.join(map(str, c))}"
        return f"default {g}; --cpu: {c}"

    p.add_argument("--pad-bs", type=parse_int_list, help=f"padded batch sizes ({dflt('pad_bs')})")
    p.add_argument("--num-tokens", type=int, default=4, help="N, rows per request (default 4)")
    p.add_argument("--vocab", type=int, help=f"communication vocab V ({dflt('vocab')})")
    p.add_argument(
        "--dtype",
        type=parse_dtype_list,
        help=f"logits dtypes, from {{bf16,fp16,fp32}} ({dflt('dtypes')})",
    )
    p.add_argument("--tp", type=parse_int_list, help=f"ranks per group ({dflt('tp')})")
    p.add_argument(
        "--backends",
        type=choice_list(BACKEND_CHOICES),
        default=BACKEND_CHOICES,
        help=f"backends to measure, comma-separated from {{{','.join(BACKEND_CHOICES)}}} "
        "(default: all; unavailable ones are reported skipped)",
    )
    p.add_argument(
        "--baselines",
        type=choice_list(BASELINES),
        default=BASELINES,
        help=f"baselines measured in the same run, from {{{','.join(BASELINES)}}} "
        "(default: all that can run)",
    )
    p.add_argument(
        "--mode",
        type=choice_list(MODES),
        default=MODES,
        help=f"eager calls and/or CUDA-graph replays, from {{{','.join(MODES)}}} "
        "(default: both; graph needs CUDA)",
    )
    p.add_argument(
        "--ops",
        type=choice_list(OPS),
        default=OPS,
        help=f"ops to measure, from {{{','.join(OPS)}}} (default: all)",
    )
    p.add_argument("--iters", type=int, default=50, help="timed samples per point (default 50)")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls per point (default 10)")
    p.add_argument(
        "--graph-ops", type=int, default=10, help="calls captured per CUDA graph (default 10)"
    )
    p.add_argument(
        "--out", default=None, help="output folder (default ./ipc-dpsample-bench-<timestamp>)"
    )
    p.add_argument("--cpu", action="store_true", help="CPU ranks over gloo even where GPUs exist")
    p.add_argument(
        "--no-verify", action="store_true", help="skip the bit-exact check before timing"
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per tp (default 1800)")
    p.add_argument(
        "--gated",
        action="store_true",
        help="rank threads on GPU 0 whose streams wait at one CUDA event until every rank "
        "issued the sample, so the time is device time (one-sided backend and copy only)",
    )
    p.add_argument(
        "--bs",
        type=parse_int_list,
        default=None,
        help="real batch sizes, one per --pad-bs value, passed to the swap as bs= "
        "(default: none, every row moves)",
    )


def config_from_args(ns: argparse.Namespace, *, gpu_machine: bool) -> BenchConfig:
    """Turn parsed options into a :class:`BenchConfig` (defaults depend on whether
    the sweep runs on GPUs: ``gpu_machine and not ns.cpu``).

    Raises
    ------
    ValueError
        Inconsistent values (from :class:`BenchConfig`).
    """
    d = GPU_DEFAULTS if gpu_machine and not ns.cpu else CPU_DEFAULTS
    out = ns.out or "ipc-dpsample-bench-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return BenchConfig(
        pad_bs=ns.pad_bs or d["pad_bs"],
        num_tokens=ns.num_tokens,
        vocab=ns.vocab or d["vocab"],
        dtypes=ns.dtype or d["dtypes"],
        tp=ns.tp or d["tp"],
        backends=tuple(ns.backends),
        modes=tuple(ns.mode),
        ops=tuple(ns.ops),
        baselines=tuple(ns.baselines),
        iters=ns.iters,
        warmup=ns.warmup,
        graph_ops=ns.graph_ops,
        out=out,
        cpu=bool(ns.cpu),
        verify=not ns.no_verify,
        timeout_s=float(ns.timeout),
        gated=bool(ns.gated),
        bs=tuple(ns.bs or ()),
    )


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
        plans.append(
            LaunchPlan(tp, launch, device, impls, tuple(skipped), pads, modes, reason, cfg.gated)
        )
    return plans


def points(cfg: BenchConfig, lp: LaunchPlan) -> list[tuple[str, str, int, str]]:
    """``(op, dtype, pad_bs, mode)`` measured by every impl of ``lp`` (the logits
    dtype sweeps the swap only; the gathers move int32 / float32)."""
    out = []
    for op in cfg.ops:
        dtypes = cfg.dtypes if op == "swap_batch_vocab" else (_gather_dtype(op),)
        for pad_bs in lp.pad_bs:
            for dtype in dtypes:
                for mode in lp.modes:
                    out.append((op, dtype, pad_bs, mode))
    return out


def _gather_dtype(op: str) -> str:
    return "int32" if op == "gather_verify_outputs" else "float32"


def op_bytes(op: str, dtype: str, pad_bs: int, tp: int, num_tokens: int, vocab: int) -> int:
    """Bytes each rank receives in ``op`` (= what the copy baseline copies)."""
    if op == "swap_batch_vocab":
        return pad_bs // tp * num_tokens * vocab * ITEMSIZE[dtype]
    if op == "gather_verify_outputs":
        return pad_bs * (2 * num_tokens + 1) * 4
    return pad_bs * num_tokens * 4

"""The options of ``ipc-dpsample bench``: list parsers (argparse ``type=``), the
option set and their conversion into a :class:`~.config.BenchConfig`.
"""

from __future__ import annotations

import argparse
import datetime
from collections.abc import Callable, Sequence

from ...arrays import LOGITS_DTYPES, normalize_dtype
from ..common import ARGMAX, OPS, VERIFY
from ..verify_case import DEMO_MIX, TARGET_MIXES, VERIFY_MIXES
from .config import (
    BACKEND_CHOICES,
    BASELINES,
    CPU_DEFAULTS,
    DEFAULT_OPS,
    GPU_DEFAULTS,
    MODES,
    VERIFY_BASELINES,
    BenchConfig,
)

__all__ = [
    "add_arguments",
    "choice_list",
    "config_from_args",
    "parse_bs_groups",
    "parse_dtype_list",
    "parse_int_list",
]


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


def parse_bs_groups(text: str) -> tuple[tuple[int, ...], ...]:
    """``"256,130,8"`` -> ``((256, 130, 8),)``; ``"64,8/256,130"`` -> ``((64, 8),
    (256, 130))``: one comma list per ``--pad-bs`` value, separated by ``/`` (argparse
    ``type=``)."""
    return tuple(parse_int_list(group) for group in text.split("/"))


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
        default=DEFAULT_OPS,
        help=f"ops to measure, from {{{','.join(OPS)}}} (default: all but {VERIFY}, whose "
        f"torch path and reference run on the host; {ARGMAX} also measures its baselines on "
        "each backend: swap_argmax = swap_batch_vocab then torch.argmax over the swapped "
        "real rows, read_once = torch.amax over the shard's real rows; "
        f"{VERIFY} measures swap_sample_gather = swap_batch_vocab, the package's full-row "
        "sampler (ipc_dpsample.sampling.verify_rows) over the rank's rows, then "
        f"gather_verify_outputs, and read_once and {ARGMAX} at the same points)",
    )
    p.add_argument(
        "--verify-mix",
        type=choice_list(VERIFY_MIXES),
        default=(DEMO_MIX,),
        help=f"per-request parameter mixes of {VERIFY}, comma-separated from "
        f"{{{','.join(VERIFY_MIXES)}}}, each its own point: temperature = T in 0.6..1.0 per "
        "request, topk50 = top-k 50, topk50-topp0.9 = with top-p 0.9, minp = min-p 0.05, "
        "topp0.9 = top-p without top-k, mixed = half greedy and half T=0.8 with top-k 50 "
        f"and top-p 0.9 (default {DEMO_MIX}; issue 24's GPU targets are set for "
        f"{','.join(TARGET_MIXES)})",
    )
    p.add_argument(
        "--verify-baselines",
        type=choice_list(VERIFY_BASELINES),
        default=VERIFY_BASELINES,
        help=f"the baselines {VERIFY} brings, from {{{','.join(VERIFY_BASELINES)}}} (default: all)",
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
    gate = p.add_mutually_exclusive_group()
    gate.add_argument(
        "--gated",
        action="store_true",
        help="run every tp as rank threads sharing GPU 0, gated, also where tp <= GPUs (which "
        "otherwise get one process per GPU, ungated); the one-sided backend and the copy only",
    )
    gate.add_argument(
        "--ungated",
        action="store_true",
        help="time rank threads sharing a GPU without the gate: the host path, where each "
        "thread's eager calls wait for its turn at the GIL (the table says so). By default "
        "ranks sharing a GPU are gated: every rank's stream waits at one CUDA event until "
        "all ranks have issued the sample, so eager and graph times are device time. One "
        "process per GPU and the CPU are never gated (nothing shares a device; the CPU "
        "path times wall clock)",
    )
    p.add_argument(
        "--bs",
        type=parse_bs_groups,
        default=None,
        metavar="LIST[/LIST...]",
        help="real batch sizes passed as bs= to every op, each measured as its own point: "
        "one comma list for every --pad-bs value (--pad-bs 256 --bs 256,192,130,64,8), or "
        "one list per --pad-bs value separated by '/' in the same order (--pad-bs 64,256 "
        "--bs 64,33,2/256,130,8); each value in 1..pad_bs. Eager calls get bs as a host "
        "int; CUDA-graph points get it as a device int32 tensor written before the replay "
        "(one graph per op, dtype and pad_bs serves every bs). Bytes and GB/s count the "
        "real rows only. Default: bs is not passed (every row moves)",
    )
    p.add_argument(
        "--vocab-limit",
        type=int,
        default=None,
        help="vocab_limit of argmax_batch_vocab and verify_batch_vocab: columns >= it never "
        "win (default: --vocab)",
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
        ungated=bool(ns.ungated),
        bs=tuple(ns.bs or ()),
        vocab_limit=ns.vocab_limit,
        verify_mixes=tuple(ns.verify_mix),
        verify_baselines=tuple(ns.verify_baselines),
    )

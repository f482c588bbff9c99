"""Torch backend on CPU (gloo, tp=2) beside the plain collectives a user would write.

One run per torch thread setting (``--threads``, default both: torch's default and
``torch.set_num_threads(1)``), two spawned ranks each, both sides timed in the same
processes, reps of the two sides interleaved (their order alternating):

* ``swap_batch_vocab`` (through :class:`~ipc_dpsample.DpSamplingComm`, argument
  checks included) vs ``dist.all_to_all_single`` of the same bytes plus the permute
  a user needs to get the ``[pad_bs/tp*N, V]`` layout;
* ``gather_verify_outputs`` vs three ``dist.all_gather_single`` calls
  (``all_gather_into_tensor`` before torch 2.13).

Prints per point: median, p10, p90 (µs, rank 0's clock), bytes (one rank's input:
what the op moves per rank, its own 1/tp share included), GB/s at the median, and
the ratio package / baseline (targets: swap <= 1.2, gather <= 1.0, with either
thread setting).

Usage: ``python scripts/bench_torch_cpu.py [--reps 80] [--quick] [--threads default,1]``
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ipc_dpsample import DpSamplingComm
from ipc_dpsample._version import package_commit
from ipc_dpsample.testing import run_ranks

TP = 2
#: (pad_bs, N, V) swap points, bfloat16 logits
SWAP_POINTS = ((8, 4, 32768), (64, 4, 32768), (256, 4, 32768))
#: (pad_bs, N) gather points
GATHER_POINTS = ((8, 4), (64, 4), (256, 8))


def _stats(samples: list[float]) -> tuple[float, float, float]:
    a = np.asarray(samples) * 1e6
    return float(np.median(a)), float(np.percentile(a, 10)), float(np.percentile(a, 90))


def _time_pair(a: Any, b: Any, reps: int) -> tuple[list[float], list[float]]:
    """Interleaved timings of ``a()`` and ``b()``, the order alternating so that
    neither side always absorbs the ranks' skew (a few warm-up calls first)."""
    for _ in range(3):
        a()
        b()
    ta, tb = [], []
    for i in range(reps):
        first, second, t_first, t_second = (a, b, ta, tb) if i % 2 == 0 else (b, a, tb, ta)
        t0 = time.perf_counter()
        first()
        t1 = time.perf_counter()
        second()
        t2 = time.perf_counter()
        t_first.append(t1 - t0)
        t_second.append(t2 - t1)
    return ta, tb


def _swap_point(rank: int, pad_bs: int, n: int, v: int, reps: int) -> dict[str, Any]:
    vs, r = v // TP, pad_bs // TP
    x = torch.randn(pad_bs * n, vs).to(torch.bfloat16)
    staged = torch.empty_like(x)
    out = torch.empty(r * n, v, dtype=torch.bfloat16)
    with DpSamplingComm(
        tp_size=TP, rank=rank, max_pad_bs=pad_bs, num_tokens_per_req=n, vocab_size=v,
        logits_dtype="bfloat16", device="cpu", backend="torch",
    ) as comm:  # fmt: skip

        def plain() -> None:
            dist.all_to_all_single(staged, x)
            out.view(r * n, TP, vs).copy_(staged.view(TP, r * n, vs).transpose(0, 1))

        got = comm.swap_batch_vocab(x, pad_bs=pad_bs)
        plain()
        assert torch.equal(got.view(torch.int16), out.view(torch.int16)), "swap != plain"
        ours, base = _time_pair(lambda: comm.swap_batch_vocab(x, pad_bs=pad_bs), plain, reps)
    return {"ours": ours, "base": base, "bytes": x.numel() * x.element_size()}


def _gather_point(rank: int, pad_bs: int, n: int, reps: int) -> dict[str, Any]:
    r = pad_bs // TP
    pred = torch.randint(0, 1000, (r, n), dtype=torch.int32)
    acc = torch.randint(0, 1000, (r, n), dtype=torch.int32)
    length = torch.randint(0, n, (r,), dtype=torch.int32)
    outs = [torch.empty(pad_bs, n, dtype=torch.int32) for _ in range(2)]
    outs.append(torch.empty(pad_bs, dtype=torch.int32))
    with DpSamplingComm(
        tp_size=TP, rank=rank, max_pad_bs=pad_bs, num_tokens_per_req=n, vocab_size=TP,
        logits_dtype="float32", device="cpu", backend="torch",
    ) as comm:  # fmt: skip
        # torch 2.13 deprecates all_gather_into_tensor for all_gather_single
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

        def plain() -> None:
            for o, a in zip(outs, (pred, acc, length), strict=True):
                gather(o, a)

        got = comm.gather_verify_outputs(pred, acc, length, pad_bs=pad_bs)
        plain()
        assert all(torch.equal(g, o) for g, o in zip(got, outs, strict=True)), "gather != plain"
        ours, base = _time_pair(
            lambda: comm.gather_verify_outputs(pred, acc, length, pad_bs=pad_bs), plain, reps
        )
    return {"ours": ours, "base": base, "bytes": 4 * r * (2 * n + 1)}


def body(
    rank: int, world: int, group: Any, reps: int, quick: bool, threads: int | None
) -> dict[str, Any]:
    """One thread setting: ``threads`` None keeps torch's default."""
    if threads is not None:
        torch.set_num_threads(threads)
    rows = []
    for pad_bs, n, v in SWAP_POINTS[:2] if quick else SWAP_POINTS:
        res = _swap_point(rank, pad_bs, n, v, reps)
        rows.append({"op": "swap", "point": f"pad_bs={pad_bs} N={n} V={v} bf16", **res})
    for pad_bs, n in GATHER_POINTS[:2] if quick else GATHER_POINTS:
        res = _gather_point(rank, pad_bs, n, reps)
        rows.append({"op": "gather_verify_outputs", "point": f"pad_bs={pad_bs} N={n}", **res})
    return {"threads": torch.get_num_threads(), "rows": rows}


def _thread_settings(text: str) -> list[int | None]:
    settings: list[int | None] = []
    for item in text.split(","):
        item = item.strip()
        if item == "default":
            settings.append(None)
        elif item.isdigit() and int(item) > 0:
            settings.append(int(item))
        else:
            raise argparse.ArgumentTypeError(f"--threads item {item!r}: 'default' or a count")
    return settings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=80)
    parser.add_argument("--quick", action="store_true", help="the two smaller points of each op")
    parser.add_argument(
        "--threads",
        type=_thread_settings,
        default=[None, 1],
        help="comma-separated torch thread settings, 'default' or a count (default: default,1)",
    )
    args = parser.parse_args()
    cpu = platform.processor() or platform.machine()
    print(
        f"# bench_torch_cpu: tp={TP} gloo, {os.cpu_count()} CPUs ({cpu}), "
        f"torch {torch.__version__} (default {torch.get_num_threads()} intra-op threads), "
        f"{datetime.date.today().isoformat()}, commit {package_commit() or 'unknown'}"
    )
    print(f"# command: python scripts/bench_torch_cpu.py {' '.join(sys.argv[1:])}".rstrip())
    baseline = {"swap": "all_to_all_single+permute", "gather_verify_outputs": "3x all_gather"}
    print(
        f"{'op':<22} {'threads':<10} {'point':<28} {'side':<26} {'median_us':>10} {'p10':>9} "
        f"{'p90':>9} {'bytes':>10} {'GB/s':>7} {'ratio':>6}"
    )
    worst: dict[tuple[str, str], float] = {}
    for threads in args.threads:
        run = run_ranks(TP, body, args.reps, args.quick, threads, timeout_s=1800)[0]
        setting = f"{'default' if threads is None else 'set'}={run['threads']}"
        for row in run["rows"]:
            ours, base = _stats(row["ours"]), _stats(row["base"])
            ratio = ours[0] / base[0]
            key = (row["op"], setting)
            worst[key] = max(worst.get(key, 0.0), ratio)
            for side, (med, p10, p90) in (("ipc_dpsample", ours), (baseline[row["op"]], base)):
                gbs = row["bytes"] / (med * 1e-6) / 1e9
                tail = f"{ratio:6.2f}" if side == "ipc_dpsample" else ""
                print(
                    f"{row['op']:<22} {setting:<10} {row['point']:<28} {side:<26} {med:10.1f} "
                    f"{p10:9.1f} {p90:9.1f} {row['bytes']:10d} {gbs:7.3f} {tail:>6}"
                )
    target = {"swap": 1.2, "gather_verify_outputs": 1.0}
    print(
        "# worst ratio: "
        + ", ".join(
            f"{op} threads {setting} {ratio:.2f} (target <= {target[op]})"
            for (op, setting), ratio in worst.items()
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

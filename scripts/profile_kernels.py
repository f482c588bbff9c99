#!/usr/bin/env python3
"""GPU time per kernel of any ``ipc-dpsample`` command, concurrent ranks included.

ncu serialises kernels, so it cannot profile ranks whose kernels wait for each other
(the gated bench's rank threads). This runs the command in this process under
``torch.profiler`` (CUPTI's kernel records, every stream, CuPy's launches and graph
replays included) and prints, per kernel name, the calls, the median, p10 and p90 of
one call's duration, and the total. A kernel that waits for its peers (the one-sided
ops spin on flags) counts its wait, so read a wait-free kernel's figures as its cost,
and the others as an upper bound.

Usage (on the GPU machine, from the repository root)::

    PYTHONPATH=$PWD python3 scripts/profile_kernels.py [--match REGEX] -- \\
        bench --gated --tp 8 --pad-bs 8 --ops verify_batch_vocab ...

Everything after ``--`` goes to ``python -m ipc_dpsample``.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

__all__ = ["main", "table"]


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def table(times: dict[str, list[float]]) -> str:
    """One line per kernel (the most total time first): calls, the median, p10 and p90 of
    one call's duration in microseconds, and the total in milliseconds."""
    lines = [f"{'kernel':<44} {'calls':>6} {'median us':>10} {'p10':>9} {'p90':>9} {'total ms':>9}"]
    for name, xs in sorted(times.items(), key=lambda kv: -sum(kv[1])):
        lines.append(
            f"{name[:44]:<44} {len(xs):>6} {statistics.median(xs):>10.2f} "
            f"{_percentile(xs, 0.1):>9.2f} {_percentile(xs, 0.9):>9.2f} {sum(xs) / 1e3:>9.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: profile_kernels.py [--match REGEX] -- COMMAND ARGS...", file=sys.stderr)
        return 2
    cut = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--match", default="", help="only kernels whose name matches")
    ns = parser.parse_args(argv[:cut])
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from ipc_dpsample.tools.cli import main as cli_main

    if not torch.cuda.is_available():
        print("profile_kernels.py: needs torch with a CUDA GPU (none here)", file=sys.stderr)
        return 2
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        rc = cli_main(argv[cut + 1 :])
    torch.cuda.synchronize()
    times: dict[str, list[float]] = defaultdict(list)
    pattern = re.compile(ns.match)
    for ev in prof.events():
        if ev.device_type != DeviceType.CUDA or not pattern.search(ev.name):
            continue
        times[ev.name].append(float(ev.time_range.elapsed_us()))
    print(table(times))
    if not times:  # this torch files kernels elsewhere: its own table
        print(prof.key_averages().table(sort_by="device_time_total", row_limit=40))
    return rc


if __name__ == "__main__":
    sys.exit(main())

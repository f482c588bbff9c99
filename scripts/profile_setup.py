#!/usr/bin/env python3
"""Construction cost of a communicator: wall time and host all-gathers.

Builds ``--reps`` tp-rank communicators (ranks as threads of this process sharing
one GPU) and prints the median and spread of the constructor's wall time (the
slowest rank of each rep; the first, compiling rep is left out) and how many host
all-gathers one construction made. Run on a GPU machine::

    PYTHONPATH=$PWD python3 scripts/profile_setup.py --tp 8 --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from ipc_dpsample import DpSamplingComm, ThreadGroup
from ipc_dpsample.testing import run_threads

_counts: dict[int, int] = {}
_lock = threading.Lock()
_orig = ThreadGroup.all_gather_bytes


def _counting(self, data, *, timeout_s, what):  # type: ignore[no-untyped-def]
    with _lock:
        _counts[self.rank] = _counts.get(self.rank, 0) + 1
    return _orig(self, data, timeout_s=timeout_s, what=what)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--backend", default="onesided")
    ns = ap.parse_args()
    ThreadGroup.all_gather_bytes = _counting  # type: ignore[method-assign]
    import torch

    times: list[float] = []
    gathers: list[int] = []

    def body(rank: int, tp: int, group: ThreadGroup) -> tuple[float, int]:
        torch.cuda.set_device(0)
        torch.cuda.set_stream(torch.cuda.Stream())
        group.barrier(timeout_s=60, what="start")
        before = _counts.get(rank, 0)
        t0 = time.perf_counter()
        comm = DpSamplingComm(
            tp_size=tp,
            rank=rank,
            group=group,
            max_pad_bs=256,
            num_tokens_per_req=4,
            vocab_size=152064,
            logits_dtype="float32",
            backend=ns.backend,
            device=0,
        )
        dt = time.perf_counter() - t0
        n = _counts.get(rank, 0) - before
        comm.close()
        return dt, n

    for rep in range(ns.reps + 1):
        res = run_threads(ns.tp, body)
        if rep == 0:
            continue  # the first one compiles the kernels
        times.append(max(t for t, _ in res))
        gathers.append(res[0][1])
    times.sort()
    print(
        f"construction tp={ns.tp} backend={ns.backend}: "
        f"median {statistics.median(times) * 1e3:.1f} ms (min {times[0] * 1e3:.1f}, "
        f"max {times[-1] * 1e3:.1f}, {len(times)} reps, slowest rank per rep); "
        f"host all-gathers per construction: {sorted(set(gathers))}"
    )


if __name__ == "__main__":
    main()

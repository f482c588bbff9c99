#!/usr/bin/env python3
"""Where the host time of one eager call goes (one-sided backend, tp=1, torch).

Times, per call (median of batches of 200 calls, with p10/p90): the public
``swap_batch_vocab`` and ``gather_verify_outputs`` calls, and the pieces of their
path (argument description, stream lookup, the backend's stream/graph checks, the
kernel launch itself, the completion-event record), plus CuPy's own ``RawKernel``
call with the same arguments for comparison. Then a cProfile of 2000 swap calls.
Run on a GPU machine: ``PYTHONPATH=$PWD python3 scripts/profile_host.py``.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time

import torch

from ipc_dpsample import DpSamplingComm
from ipc_dpsample.arrays import describe, resolve_stream
from ipc_dpsample.testing import run_threads


def per_call_us(fn, batches: int = 20, calls: int = 200) -> tuple[float, float, float]:
    out = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.current_stream().synchronize()
    out.sort()
    return statistics.median(out), out[len(out) // 10], out[-1 - len(out) // 10]


def body(rank, tp, group):
    torch.cuda.set_device(0)
    stream = torch.cuda.Stream()
    torch.cuda.set_stream(stream)
    n, v, pad_bs = 4, 4096, 8
    with DpSamplingComm(
        tp_size=1,
        rank=0,
        group=group,
        max_pad_bs=64,
        num_tokens_per_req=n,
        vocab_size=v,
        logits_dtype=torch.bfloat16,
        backend="onesided",
        device=0,
    ) as comm:
        be = comm._backend
        x = torch.randn(pad_bs * n, v, device="cuda").to(torch.bfloat16)
        p = torch.randint(0, 100, (64, n), device="cuda", dtype=torch.int32)
        ln = torch.randint(0, n, (64,), device="cuda", dtype=torch.int32)
        y = comm.swap_batch_vocab(x, pad_bs=pad_bs)
        stream.synchronize()
        assert torch.equal(y, x), "tp=1 swap must return its input"
        info = describe(x, "x")
        handle = resolve_stream(info.kind, None, 0)
        push, _, _ = be._swap_plan(pad_bs)
        # CuPy's RawKernel call with the same 18 arguments (the old launch path)
        import cupy

        args = tuple(int(push._vals[i]) for i in range(len(push._vals)))
        cs = cupy.cuda.ExternalStream(handle)
        rows = []

        def row(what, fn):
            m, lo, hi = per_call_us(fn)
            rows.append((what, m, lo, hi))

        row("swap_batch_vocab (public call)", lambda: comm.swap_batch_vocab(x, pad_bs=pad_bs))
        row(
            "gather_verify_outputs (public call)",
            lambda: comm.gather_verify_outputs(p, p, ln, pad_bs=64),
        )
        lp = p.float()  # made once: a torch op inside the timed call would dominate it
        row(
            "gather_verify_logprobs (public call)",
            lambda: comm.gather_verify_logprobs(lp, pad_bs=64),
        )
        row("  describe(x)", lambda: describe(x, "x"))
        row("  resolve_stream", lambda: resolve_stream(info.kind, None, 0))
        row("  config.validate_pad_bs", lambda: comm.config.validate_pad_bs(pad_bs))
        row("  backend._begin", lambda: be._begin(handle))
        row("  kernel launch (cuLaunchKernel, packed args)", lambda: push(handle, info.ptr))
        row(
            "  kernel launch (CuPy RawKernel call, 18 args)",
            lambda: be._swap((push._grid,), (push._block,), (info.ptr, *args[1:]), stream=cs),
        )
        row("  cudaEventRecord", lambda: be._runtime.eventRecord(be._event_ptr, handle))
        row("  cudaStreamIsCapturing", lambda: be._runtime.streamIsCapturing(handle))
        stream.synchronize()
        comm.check()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(2000):
            comm.swap_batch_vocab(x, pad_bs=pad_bs)
        prof.disable()
        stream.synchronize()
        comm.check()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
    return rows, buf.getvalue()


def main() -> None:
    rows, prof = run_threads(1, body)[0]
    print(f"# {torch.cuda.get_device_name(0)}  host time per eager call, tp=1, bf16")
    print(f"{'what':48s} {'median us':>10s} {'p10':>7s} {'p90':>7s}")
    for what, m, lo, hi in rows:
        print(f"{what:48s} {m:10.2f} {lo:7.2f} {hi:7.2f}")
    print("\ncProfile of 2000 swap_batch_vocab calls (tottime):")
    print(prof)


if __name__ == "__main__":
    main()

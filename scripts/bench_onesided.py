#!/usr/bin/env python3
"""Benchmark of the one-sided backend with several ranks on ONE GPU (threads of
this process, one stream each), against the copy limit measured in the same run.

Measures (issue targets in brackets):
* swap at tp=8, pad_bs=256, N=4, V=152064, fp32: time per op for all ranks
  together vs a device-to-device copy of the same bytes [ratio >= 0.90];
* small-op latency: swap pad_bs=8 (bf16) and both gathers at pad_bs=64, eager and
  CUDA-graph replayed;
* host overhead per eager call (tp=1, Python call time only) [<= 20 us].

Timing: each rep issues 20 (50 for small eager ops) ops per rank back to back, and
the time per op is the slowest rank's, from CUDA events on its stream. "gated"
rows hold every rank's stream at one CUDA event until all rank threads have issued
the rep, so the kernels start together and the figure is device time, as it is for
ranks that are processes on GPUs of their own; the "launched" row shows the same
swap as the Python threads issue it (their turns at the GIL skew the starts). The
copy limit is ``copy_`` of the same bytes, 20 back to back per rep.

Every timed configuration is first checked against a reference on the inputs it is
timed with. Prints a table and writes JSON (``--out``). Run on a GPU machine:
``CUDA_DEVICE_MAX_CONNECTIONS=32 PYTHONPATH=$PWD python3 scripts/bench_onesided.py``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import torch

from ipc_dpsample import DpSamplingComm
from ipc_dpsample.testing import run_threads

_capture_lock = threading.Lock()


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "p10": pct(xs, 0.1), "p90": pct(xs, 0.9), "n": len(xs)}


def _inputs(op, rank, tp, pad_bs, n, vs, dtype):
    """Rank ``rank``'s random inputs of ``op`` (the same for a given rank every time)."""
    r = pad_bs // tp
    g = torch.Generator(device="cuda").manual_seed(1000 + rank)
    if op == "swap":
        return ((torch.randn(pad_bs * n, vs, generator=g, device="cuda") * 3).to(dtype),)
    if op == "gather_outputs":
        p = torch.randint(0, 1 << 30, (r, n), generator=g, device="cuda", dtype=torch.int32)
        a = torch.randint(0, 1 << 30, (r, n), generator=g, device="cuda", dtype=torch.int32)
        ln = torch.randint(0, n, (r,), generator=g, device="cuda", dtype=torch.int32)
        return p, a, ln
    return (torch.randn(r, n, generator=g, device="cuda"),)


def _reference(op, rank, tp, pad_bs, n, vs, dtype):
    """The expected output of ``op`` on ``rank`` (a tuple of tensors)."""
    every = [_inputs(op, s, tp, pad_bs, n, vs, dtype) for s in range(tp)]
    if op == "swap":
        rows = pad_bs // tp * n
        return (torch.cat([x[0][rank * rows : (rank + 1) * rows] for x in every], dim=1),)
    return tuple(torch.cat([x[k] for x in every], dim=0) for k in range(len(every[0])))


def _op_call(comm, op, rank, tp, pad_bs, n, vs, dtype):
    """Inputs for one op and a closure that issues it."""
    x = _inputs(op, rank, tp, pad_bs, n, vs, dtype)
    if op == "swap":
        return lambda: comm.swap_batch_vocab(x[0], pad_bs=pad_bs)
    if op == "gather_outputs":
        return lambda: comm.gather_verify_outputs(*x, pad_bs=pad_bs)
    return lambda: comm.gather_verify_logprobs(x[0], pad_bs=pad_bs)


#: length of the start gate (GPU cycles of torch.cuda._sleep; ~60 ms at 2 GHz): longer
#: than the rank threads need to issue one rep's ops, so they all start at once
GATE_CYCLES = 120_000_000


class Gate:
    """Holds every rank's stream at a CUDA event until all of them have issued a
    rep's ops: the kernels then start together, so a time per op is the device's,
    not the skew of Python threads that take turns at the GIL to launch.

    Rank 0 arms it (a sleep kernel on a side stream, then the event) before the
    others issue; each rank's stream waits for the event. ``early`` counts reps in
    which the gate had opened before every rank had issued (their timing includes
    launch skew; a longer gate fixes it).
    """

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream()
        self.event = torch.cuda.Event()
        self.early = 0

    def arm(self) -> None:
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(GATE_CYCLES)
            self.event.record(self.stream)

    def hold(self, stream) -> None:
        stream.wait_event(self.event)

    def check_closed(self) -> None:
        if self.event.query():
            self.early += 1


def _rank_body(rank, tp, group, op, pad_bs, n, vocab, dtype, reps, per_rep, mode, gate):
    torch.cuda.set_device(0)
    stream = torch.cuda.Stream()
    torch.cuda.set_stream(stream)
    vs = vocab // tp
    with DpSamplingComm(
        tp_size=tp,
        rank=rank,
        group=group,
        max_pad_bs=pad_bs,
        num_tokens_per_req=n,
        vocab_size=vocab,
        logits_dtype=dtype,
        backend="onesided",
        device=0,
        timeout_s=30,
    ) as comm:
        call = _op_call(comm, op, rank, tp, pad_bs, n, vs, dtype)
        # correctness of the timed configuration, on the inputs the timing uses
        ref = _reference(op, rank, tp, pad_bs, n, vs, dtype)
        # allocations and same-device copies serialise streams (CUDA's implicit
        # synchronisation): a rank still allocating while a peer's op is in flight
        # stalls both until the timeout. Everyone allocates first.
        stream.synchronize()
        group.barrier(timeout_s=60, what="inputs allocated")
        y = call()
        # every rank issues the op before any rank blocks on its completion (see
        # ipc_dpsample.testing.run_threads)
        group.barrier(timeout_s=60, what="launched")
        stream.synchronize()
        comm.check()
        for got, want in zip(y if isinstance(y, tuple) else (y,), ref, strict=True):
            assert torch.equal(got, want), f"{op} output differs from the reference"
        del ref
        stream.synchronize()
        group.barrier(timeout_s=60, what="checked")
        for _ in range(3):
            call()
        group.barrier(timeout_s=60, what="warm-up launched")
        stream.synchronize()
        graph = None
        if mode == "graph":
            group.barrier(timeout_s=60, what="capture")
            graph = torch.cuda.CUDAGraph()
            with (
                _capture_lock,
                torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"),
            ):
                for _ in range(per_rep):
                    call()
            group.barrier(timeout_s=60, what="captured")
            graph.replay()
            group.barrier(timeout_s=60, what="replay launched")
            stream.synchronize()
        times = []
        for _ in range(reps):
            group.barrier(timeout_s=60, what="rep")
            if gate is not None:
                if rank == 0:
                    gate.arm()
                group.barrier(timeout_s=60, what="gate armed")
                gate.hold(stream)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            if graph is not None:
                graph.replay()
            else:
                for _ in range(per_rep):
                    call()
            end.record(stream)
            group.barrier(timeout_s=60, what="rep launched")
            if gate is not None and rank == 0:
                gate.check_closed()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / per_rep)  # us per op
        comm.check()
        group.barrier(timeout_s=60, what="done")
        del graph
    return times


def run_point(tp, op, pad_bs, n, vocab, dtype, reps, per_rep, mode, gated=True):
    """Per rep, the time per op of the slowest rank (us), and the number of reps whose
    gate opened before every rank had issued (0 when ``gated`` is False)."""
    gate = Gate() if gated else None
    per_rank = run_threads(
        tp, _rank_body, op, pad_bs, n, vocab, dtype, reps, per_rep, mode, gate, timeout_s=600
    )
    # the ranks are coupled by the protocol; an op is done when the slowest rank is
    return [max(ts) for ts in zip(*per_rank, strict=True)], (gate.early if gate else 0)


def copy_limit_us(nbytes: int, reps: int, per_rep: int = 20) -> list[float]:
    """Device-to-device copy of ``nbytes`` (one ``copy_``), timed like the swaps:
    ``per_rep`` back to back per rep."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(per_rep):
            dst.copy_(src)
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e) * 1e3 / per_rep)
    assert torch.equal(dst, src)
    return out


def host_overhead_us(op: str, calls: int = 2000) -> list[float]:
    def body(rank, tp, group):
        torch.cuda.set_device(0)
        stream = torch.cuda.Stream()
        torch.cuda.set_stream(stream)
        with DpSamplingComm(
            tp_size=1,
            rank=0,
            group=group,
            max_pad_bs=64,
            num_tokens_per_req=4,
            vocab_size=4096,
            logits_dtype=torch.bfloat16,
            backend="onesided",
            device=0,
        ) as comm:
            call = _op_call(comm, op, 0, 1, 8 if op == "swap" else 64, 4, 4096, torch.bfloat16)
            for _ in range(50):
                call()
            stream.synchronize()
            per = []
            for _ in range(calls // 100):
                t0 = time.perf_counter()
                for _ in range(100):
                    call()
                per.append((time.perf_counter() - t0) / 100 * 1e6)
                stream.synchronize()
            comm.check()
        return per

    return run_threads(1, body)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--big-only", action="store_true", help="only the tp-rank big swap, eager")
    ap.add_argument(
        "--dump-after",
        type=float,
        default=0,
        help="print every thread's stack and exit after this many seconds (hang diagnosis)",
    )
    args = ap.parse_args()
    if args.dump_after > 0:
        import faulthandler

        faulthandler.dump_traceback_later(args.dump_after, exit=True)
    tp = args.tp
    commit = (
        os.environ.get("GIT_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    )
    meta = {
        "gpu": torch.cuda.get_device_name(0),
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit or "?",
        "torch": torch.__version__,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }
    print(
        f"# {meta['gpu']}  {meta['date']}  commit {meta['commit']}  tp={tp} ranks on one GPU  "
        f"swap CTAs/SM={os.environ.get('IPC_DPSAMPLE_SWAP_CTAS_PER_SM', 'default')}"
    )
    print(
        f"# swap knobs: CTAs/SM={os.environ.get('IPC_DPSAMPLE_SWAP_CTAS_PER_SM', 'default')} "
        f"unroll={os.environ.get('IPC_DPSAMPLE_SWAP_UNROLL', 'default')} "
        f"chunk={os.environ.get('IPC_DPSAMPLE_SWAP_CHUNK', 'default')} "
        f"block={os.environ.get('IPC_DPSAMPLE_SWAP_BLOCK', 'default')} "
        f"fit={os.environ.get('IPC_DPSAMPLE_SWAP_FIT', 'default')} "
        f"streaming={os.environ.get('IPC_DPSAMPLE_SWAP_STREAMING', 'default')}"
    )
    print(
        "# gated: every rank's stream waits at one event until all ranks have issued, "
        "so the ops start together (device time); launched: as the threads issue them"
    )
    print(f"{'what':44s} {'mode':14s} {'median us':>10s} {'p10':>8s} {'p90':>8s}  extra")
    rows: list[dict] = []
    failed: list[str] = []
    t_start = time.monotonic()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    def show(r: dict) -> None:
        rows.append(r)
        st = r["us"]
        extra = ""
        if "ratio_to_copy" in r:
            extra = (
                f"{r['GBps']:.0f} GB/s; copy {r['copy_us']['median']:.1f} us = "
                f"{r['copy_GBps']:.0f} GB/s; ratio to copy {r['ratio_to_copy']:.3f}"
            )
        if r.get("gate_early"):
            extra += f" (gate opened early in {r['gate_early']}/{st['n']} reps: includes skew)"
        print(
            f"{r['what']:44s} {r['mode']:14s} {st['median']:10.2f} {st['p10']:8.2f} "
            f"{st['p90']:8.2f}  {extra} [{time.monotonic() - t_start:.0f} s]",
            flush=True,
        )
        # written after every row: a later point that fails leaves the earlier ones
        (out_dir / "bench_onesided.json").write_text(
            json.dumps({"meta": meta, "rows": rows, "failed": failed}, indent=1)
        )

    def point(what: str, *a, **kw):
        """run_point, or None (printed and counted) when a rank failed."""
        try:
            return run_point(*a, **kw)
        except Exception as exc:  # keep measuring the other points
            failed.append(f"{what}: {exc}")
            print(f"{what:44s} FAILED: {str(exc)[-3000:]}", flush=True)
            return None

    f32, bf16 = torch.float32, torch.bfloat16
    big = dict(op="swap", pad_bs=256, n=4, vocab=152064, dtype=f32)
    nbytes = big["pad_bs"] * big["n"] * big["vocab"] * 4  # all ranks' inputs together
    c = copy_limit_us(nbytes, args.reps)
    # tp ranks (the target: gated, then as launched), then tp=1 (one kernel alone: its
    # own copy efficiency); graph mode runs the entry barrier, then pushes into the
    # fixed output
    big_points = [
        (tp, "eager", True),
        (tp, "eager", False),
        (tp, "graph", True),
        (1, "eager", True),
    ]
    if args.big_only:
        big_points = big_points[:1] + big_points[3:]
    for btp, mode, gated in big_points:
        what = f"swap pad_bs=256 N=4 V=152064 fp32 tp={btp}"
        res = point(what, btp, mode=mode, reps=args.reps, per_rep=20, gated=gated, **big)
        if res is None:
            continue
        t, early = res
        show(
            {
                "what": what,
                "tp": btp,
                "mode": mode + (" gated" if gated else " launched"),
                "bytes": nbytes,
                "us": stats(t),
                "gate_early": early,
                "copy_us": stats(c),
                "GBps": nbytes / statistics.median(t) / 1e3,
                "copy_GBps": nbytes / statistics.median(c) / 1e3,
                "ratio_to_copy": statistics.median(c) / statistics.median(t),
            }
        )
    if not args.big_only:
        for op in ("swap", "gather_outputs", "gather_logprobs"):
            h = host_overhead_us(op)
            show(
                {
                    "what": f"host time per eager {op} call (tp=1)",
                    "tp": 1,
                    "mode": "eager",
                    "bytes": 0,
                    "us": stats(h),
                }
            )
        for op, pad_bs, dtype in (
            ("swap", 8, bf16),
            ("gather_outputs", 64, bf16),
            ("gather_logprobs", 64, bf16),
        ):
            for mode in ("eager", "graph"):
                what = f"{op} pad_bs={pad_bs} N=4" + (" V=152064 bf16" if op == "swap" else "")
                res = point(
                    what,
                    tp,
                    op,
                    pad_bs,
                    4,
                    152064,
                    dtype,
                    args.reps,
                    20 if mode == "graph" else 50,
                    mode,
                )
                if res is None:
                    continue
                t, early = res
                nb = {
                    "swap": pad_bs * 4 * 152064 * 2,
                    "gather_outputs": pad_bs * 9 * 4,
                    "gather_logprobs": pad_bs * 4 * 4,
                }[op]  # bytes of the whole result
                show(
                    {
                        "what": what,
                        "tp": tp,
                        "mode": mode + " gated",
                        "bytes": nb,
                        "us": stats(t),
                        "gate_early": early,
                    }
                )
    if failed:
        print(f"# {len(failed)} point(s) failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

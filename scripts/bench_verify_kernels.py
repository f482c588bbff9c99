#!/usr/bin/env python3
"""GPU time of the verify kernels alone: ``tp`` shards on one GPU, no communication.

The gated bench times ``verify_batch_vocab`` with its ranks' kernels waiting for each
other, so neither ncu (it serialises kernels) nor a kernel's own duration separates a
kernel's cost from its wait. This runs the two kernels of ``kernels/verify.cu`` (the
device code the one-sided push and finish share) on the batch of a ``tp``-rank group,
all on this GPU: ``dp_verify_records`` on every rank's shard, the records stacked as
the owners receive them, then ``dp_verify_combine``, both as every owner's launch
(``R = pad_bs / tp`` requests each) and as one launch of the whole batch (what each rank
runs when the one-sided backend broadcasts the records of a small batch). Nothing waits
on a peer, so ncu can profile each kernel alone (its duration is the kernel's cost)::

    PYTHONPATH=$PWD python3 scripts/bench_verify_kernels.py --mix topk50
    ncu --kernel-name dp_verify_combine --launch-skip 3 --launch-count 1 \\
        python3 scripts/bench_verify_kernels.py --mix topk50 --iters 5

``--phases RUNS`` then says where each kernel's time goes: the kernels built with
``-DDV_PHASE_CLOCKS`` record the SM clock at each phase mark of their first CTA, and the
median cycles between marks over RUNS launches are printed (BENCHMARKS.md has a table).
The environment's compile-time knobs of the verify kernels (``IPC_DPSAMPLE_VERIFY_*``,
the ``-DDV_*`` options of ``ipc_dpsample.envs.OnesidedTuning``) apply here as in the
one-sided kernels.

Every output is poisoned first and checked bit for bit against
``ipc_dpsample.layout.reference_verify_batch_vocab`` (the owners' launches: predict,
accept_index, accept_length; the whole-batch launch numbers accept_index over the
batch, so it is checked on predict and accept_length) before anything is timed.
Prints medians with p10..p90 over ``--iters`` samples, in microseconds per call: each
sample replays a CUDA graph of ``--reps`` calls between two events, so no launch from
Python is in the time (where capture fails it says so and times each call from Python,
the host's launch of the kernel included: an upper bound for a short kernel).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

__all__ = ["main", "make_shards", "parse_args", "stack_owner"]

POISON = 0x5A5A5A5A
DTYPES = ("fp32", "bf16", "fp16")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked: ``pad_bs`` a multiple of ``tp`` and ``vocab`` of
    ``tp`` (argparse exits with the expected values otherwise)."""
    from ipc_dpsample.tools.verify_case import VERIFY_MIXES

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=8, help="shards (ranks) of the batch")
    p.add_argument("--pad-bs", type=int, default=8)
    p.add_argument("--num-tokens", type=int, default=4, help="N, rows per request")
    p.add_argument("--vocab", type=int, default=152064)
    p.add_argument("--dtype", choices=DTYPES, default="fp32")
    p.add_argument("--mix", choices=VERIFY_MIXES, default="topk50")
    p.add_argument(
        "--cap",
        type=int,
        default=128,
        help="list capacity of the records (128: what a call with device parameters, as "
        "the graph-replayed bench, uses with top-k; 0: the call's largest top-k, as with "
        "host parameters); ignored without top-k",
    )
    p.add_argument("--iters", type=int, default=50, help="timed samples per kernel")
    p.add_argument("--reps", type=int, default=20, help="calls per sample (one CUDA graph)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--phases",
        type=int,
        default=0,
        metavar="RUNS",
        help="also build the kernels with -DDV_PHASE_CLOCKS and print, over RUNS launches "
        "each, the median SM cycles between the phase marks of the first CTA (row 0 of "
        "shard 0; request 0 of the whole-batch combine); 0: off",
    )
    ns = p.parse_args(argv)
    if ns.phases < 0:
        p.error(f"--phases {ns.phases}; expected 0 (off) or the launches to sample")
    if min(ns.tp, ns.pad_bs, ns.num_tokens, ns.iters, ns.reps) < 1:
        p.error("--tp, --pad-bs, --num-tokens, --iters and --reps must be at least 1")
    if not 0 <= ns.cap <= 128:
        p.error(f"--cap {ns.cap}; expected 0 (the largest top-k) or 1 to 128")
    if ns.pad_bs % ns.tp:
        p.error(f"--pad-bs {ns.pad_bs} must be a multiple of --tp {ns.tp}")
    if ns.vocab % ns.tp:
        p.error(f"--vocab {ns.vocab} must be a multiple of --tp {ns.tp}")
    return ns


def stack_owner(records: Any, owner: int, reqs: int, n: int) -> Any:
    """The records owner ``owner`` receives: every source's rows of its ``reqs``
    requests, ``[tp][reqs * n][words]`` contiguous (``records`` is
    ``[tp][pad_bs * n][words]``, NumPy or CuPy)."""
    xp = sys.modules[type(records).__module__.split(".")[0]]
    part = records[:, owner * reqs * n : (owner + 1) * reqs * n]
    return xp.ascontiguousarray(part)


def make_shards(seed: int, rows: int, vocab: int, tp: int, dtype: str) -> list[np.ndarray]:
    """Every rank's ``local_logits`` ``[rows, vocab / tp]``: the bench's and the demo's
    logits (``randn * 4``, bfloat16 as its uint16 bits), cut into ``tp`` shards."""
    from ipc_dpsample.arrays import normalize_dtype
    from ipc_dpsample.tools.common import _random_logits

    full = _random_logits(np.random.default_rng(seed), (rows, vocab), normalize_dtype(dtype))
    vs = vocab // tp
    return [np.ascontiguousarray(full[:, s * vs : (s + 1) * vs]) for s in range(tp)]


# What ends at each phase mark of kernels/verify.cuh (dv_phase; the first mark of each
# kernel is its start): the record kernel's marks DV_PH_REC + 1.., the combine's
# DV_PH_COMB + 1.. A mark a row does not reach (the threshold of a temperature row, the
# top-p step without top-p) is left out, its time counted in the next one reached.
PH_REC, PH_COMB, PH_ALL = 0, 16, 32
REC_PHASES = (
    "pass 1 (the row's maximum) and the NaN vote",
    "the block's first maximum",
    "top-k: the candidates' threshold",
    "top-k: pass 2 (the candidates)",
    "logprobs: the sum of exp",
    "the temperature pass or the top-k list",
    "the header written",
)
COMB_PHASES = (
    "record headers staged",
    "rows decided (a warp each)",
    "top-k: the slots chosen",
    "top-k: stream keys, pool offsets",
    "top-k: the pool filled",
    "top-k: cuts (a thread per slot)",
    "top-k: prefixes up to the cuts",
    "top-k: prefix scan",
    "top-k: ranks (the merge)",
    "top-k: scores, masses",
    "top-k: top-p masses",
    "top-k: best kept entries",
    "logprobs",
    "accept chain, outputs",
)


def verify_options() -> tuple[str, ...]:
    """The verify kernels' compile-time knobs the environment sets (the ``-DDV_*`` of
    :attr:`ipc_dpsample.envs.OnesidedTuning.compile_options`)."""
    from ipc_dpsample import envs

    return tuple(o for o in envs.onesided_tuning().compile_options if o.startswith("-DDV_"))


def phase_table(samples: np.ndarray, base: int, names: tuple[str, ...], khz: float) -> str:
    """The median cycles (and microseconds at ``khz``, the GPU's clock) from each reached
    phase mark to the next one reached, over ``samples`` ``[runs, PH_ALL]`` of clock64
    values (0: the mark was not reached in that run)."""
    marks = samples[:, base : base + len(names) + 1].astype(np.int64)
    reached = [j for j in range(marks.shape[1]) if np.all(marks[:, j] != 0)]
    lines, total = [], 0.0
    for a, b in itertools.pairwise(reached):
        cyc = float(np.median(marks[:, b] - marks[:, a]))
        total += cyc
        lines.append(f"    {names[b - 1]:<46} {cyc:9.0f} cycles {cyc / khz * 1e3:8.2f} us")
    tot = f"{total:9.0f} cycles {total / khz * 1e3:8.2f} us"
    lines.append(f"    {'total (the first mark to the last)':<46} {tot}")
    return "\n".join(lines)


def _stats(us: list[float]) -> str:
    p10, med, p90 = np.percentile(np.asarray(us), [10, 50, 90])
    return f"median {med:8.2f} us [p10 {p10:.2f}, p90 {p90:.2f}], n={len(us)}"


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    try:
        import cupy as cp

        cp.cuda.runtime.getDeviceCount()
    except (ImportError, RuntimeError) as e:  # CUDARuntimeError is a RuntimeError
        print(f"bench_verify_kernels.py needs CuPy and a CUDA GPU: {e}", file=sys.stderr)
        return 2

    from ipc_dpsample.arrays import normalize_dtype
    from ipc_dpsample.backends.verify_plan import (
        call_digest,
        list_cap,
        pack_params,
        param_offsets,
        record_words,
    )
    from ipc_dpsample.kernel_cache import get_kernel
    from ipc_dpsample.layout import verify_params
    from ipc_dpsample.protocol import Dtype
    from ipc_dpsample.tools.verify_case import make_verify_case

    tp, pad_bs, n, vocab = ns.tp, ns.pad_bs, ns.num_tokens, ns.vocab
    dtype, vs, rows, reqs = normalize_dtype(ns.dtype), vocab // tp, pad_bs * n, pad_bs // tp
    shards = make_shards(ns.seed, rows, vocab, tp, dtype)
    rng = np.random.default_rng(ns.seed + 1)  # the parameters and candidates
    case = make_verify_case(shards, tp=tp, pad_bs=pad_bs, dtype=dtype, mix=ns.mix, rng=rng)
    checked = verify_params(pad_bs=pad_bs, num_tokens_per_req=n, vocab_size=vocab, **case.params)
    cap = list_cap(checked)
    if cap and ns.cap:
        if ns.cap < cap:
            print(f"--cap {ns.cap} is below the mix's top-k {cap}", file=sys.stderr)
            return 2
        cap = ns.cap
    words = record_words(cap)
    digest = call_digest(vocab, cap, False, n)
    code = int(Dtype[dtype.upper()])

    d_shards = [cp.asarray(s) for s in shards]
    d_cand = cp.asarray(case.candidates)
    d_params = cp.asarray(pack_params(checked))
    ptrs = [int(d_params.data.ptr) + off for off in param_offsets(pad_bs)]
    records = cp.full((tp, rows, words), POISON, cp.uint32)
    err_rec = cp.zeros(tp, cp.uint32)
    name = "dp_verify_records" if cap else "dp_verify_records_nolist"
    opts = verify_options()
    rec_k = get_kernel("verify.cu", name, cp.cuda.Device().id, opts)
    comb_k = get_kernel("verify.cu", "dp_verify_combine", cp.cuda.Device().id, opts)
    u, i = np.uint64, np.int64
    block = (256,)

    def rec_args(s: int) -> tuple[Any, ...]:
        return (
            u(d_shards[s].data.ptr), u(d_cand.data.ptr), *(u(p) for p in ptrs), i(cap), i(0),
            i(digest), u(0), i(pad_bs), i(rows), i(vs), i(s * vs), i(vocab), i(code), i(n),
            u(records[s].data.ptr), u(err_rec[s:].data.ptr),
        )  # fmt: skip

    def outputs(count: int) -> tuple[Any, ...]:
        return (
            cp.full((count, n), POISON, cp.int32), cp.full((count, n), POISON, cp.int32),
            cp.full(count, POISON, cp.int32), cp.full((count, n), np.nan, cp.float32),
            cp.zeros(1, cp.uint32),
        )  # fmt: skip

    def comb_args(recs: Any, count: int, req0: int, outs: tuple[Any, ...]) -> tuple[Any, ...]:
        return (
            u(d_cand.data.ptr), *(u(p) for p in ptrs), i(cap), i(0), i(digest), u(0),
            i(pad_bs), u(recs.data.ptr), i(tp), i(count), i(n), i(req0), i(vocab),
            *(u(a.data.ptr) for a in outs),
        )  # fmt: skip

    def launch_records() -> None:
        for s in range(tp):
            rec_k((rows,), block, rec_args(s))

    # the check: every owner's launch on its received records, the whole batch's launch
    launch_records()
    owner_recs = [stack_owner(records, o, reqs, n) for o in range(tp)]
    owner_outs = [outputs(reqs) for _ in range(tp)]
    for o in range(tp):
        comb_k((max(1, reqs),), block, comb_args(owner_recs[o], reqs, o * reqs, owner_outs[o]))
    whole_outs = outputs(pad_bs)
    comb_k((pad_bs,), block, comb_args(records, pad_bs, 0, whole_outs))
    cp.cuda.Device().synchronize()
    bad = []
    if int(err_rec.max()) or any(int(o[4][0]) for o in owner_outs) or int(whole_outs[4][0]):
        bad.append("an error word was set (refused value or mismatched records)")
    got = [np.concatenate([cp.asnumpy(o[j]) for o in owner_outs]) for j in range(3)]
    bad += [f"owners' combine: {m}" for m in case.mismatches(got)]
    whole = [cp.asnumpy(whole_outs[0]), case.accept_index, cp.asnumpy(whole_outs[2])]
    bad += [f"whole-batch combine: {m}" for m in case.mismatches(whole)]
    what = (
        f"tp={tp} pad_bs={pad_bs} N={n} V={vocab} {ns.mix} {ns.dtype}, record {4 * words} B, "
        f"{cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)['name'].decode()}"
    )
    if bad:
        print(f"WRONG ({what}):\n  " + "\n  ".join(bad))
        return 1
    print(f"checked bit for bit against the reference ({what})")

    stream = cp.cuda.Stream(non_blocking=True)
    method = {"name": ""}

    def timed(fn: Any) -> list[float]:
        """Per-launch times of ``fn``: ``--reps`` calls captured in a CUDA graph and
        replayed between two events (no host launch in the time), or, where capture
        fails, two events around each call from Python (the host's launch included)."""
        with stream:
            fn()  # warm, outside any capture
            stream.synchronize()
            graph = None
            try:
                stream.begin_capture()
                for _ in range(ns.reps):
                    fn()
                graph = stream.end_capture()
            except Exception as e:  # any failure falls back to timing each call, said below
                try:
                    if stream.is_capturing():
                        stream.end_capture()
                except Exception:  # an invalidated capture: nothing to end
                    pass
                method["name"] = f"events around each launch (graph capture failed: {e})"
            out = []
            for _ in range(ns.iters):
                a, b = cp.cuda.Event(), cp.cuda.Event()
                a.record(stream)
                if graph is not None:
                    graph.launch(stream)
                else:
                    fn()
                b.record(stream)
                b.synchronize()
                per = ns.reps if graph is not None else 1
                out.append(cp.cuda.get_elapsed_time(a, b) * 1e3 / per)
        if graph is not None and not method["name"]:
            method["name"] = f"a CUDA graph of {ns.reps} calls per sample, the time per call"
        return out

    print(f"dp_verify_records, every shard ({tp} launches of {rows} rows): "
          f"{_stats(timed(launch_records))}")  # fmt: skip
    print(f"dp_verify_records, one shard ({rows} rows): "
          f"{_stats(timed(lambda: rec_k((rows,), block, rec_args(0))))}")  # fmt: skip
    args0 = comb_args(owner_recs[0], reqs, 0, owner_outs[0])
    print(f"dp_verify_combine, one owner ({reqs} requests, {tp} sources): "
          f"{_stats(timed(lambda: comb_k((max(1, reqs),), block, args0)))}")  # fmt: skip
    argsw = comb_args(records, pad_bs, 0, whole_outs)
    print(f"dp_verify_combine, the whole batch ({pad_bs} requests, {tp} sources): "
          f"{_stats(timed(lambda: comb_k((pad_bs,), block, argsw)))}")  # fmt: skip
    print(f"times: {method['name']}")
    if ns.phases:
        from ipc_dpsample.kernel_cache import get_module

        dev = cp.cuda.Device().id
        mod = get_module("verify.cu", dev, (*opts, "-DDV_PHASE_CLOCKS"))
        clocks = cp.ndarray((PH_ALL,), cp.uint64, memptr=mod.get_global("dv_phase_clock"))
        khz = float(cp.cuda.runtime.getDeviceProperties(dev)["clockRate"])

        def sample(fn: Any) -> np.ndarray:
            out = []
            for _ in range(ns.phases):
                clocks.fill(0)
                fn()
                cp.cuda.Device().synchronize()
                out.append(cp.asnumpy(clocks))
            return np.stack(out)

        rec_p, comb_p = mod.get_function(name), mod.get_function("dp_verify_combine")
        print(f"phases (-DDV_PHASE_CLOCKS build, median of {ns.phases} launches, us at "
              f"{khz / 1e3:.0f} MHz, the GPU's top clock):")  # fmt: skip
        print(f"  {name}, one shard ({rows} rows), row 0:")
        print(phase_table(sample(lambda: rec_p((rows,), block, rec_args(0))), PH_REC,
                          REC_PHASES, khz))  # fmt: skip
        print("  dp_verify_combine, the whole batch, request 0:")
        print(phase_table(sample(lambda: comb_p((pad_bs,), block, argsw)), PH_COMB,
                          COMB_PHASES, khz))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

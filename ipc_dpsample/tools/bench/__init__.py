"""``ipc-dpsample bench``: sweep the collectives against their baselines.

For every tensor-parallel size ``tp`` the sweep starts one set of ranks:

* ``tp <= GPUs``: one process per GPU (``run_ranks``; NCCL and torch.distributed
  run there too);
* ``tp > GPUs`` (e.g. one GPU) or ``--gated``: ``tp`` threads of one process on
  GPU 0 (``run_threads``; only the one-sided backend can run so);
* ``--cpu`` or no GPU: ``tp`` processes over gloo on the CPU.

Each rank measures, for every point ``(op, dtype, pad_bs, bs, mode, mix)``, every
requested backend of :class:`~ipc_dpsample.DpSamplingComm` (checked before timing
on the real rows: bit for bit; argmax logprobs against a float64 reference within
:func:`~ipc_dpsample.tools.common.logprob_atol`; a graph's replay too) and, in the
same run, the baselines:

``swap_argmax``, ``read_once`` (ops measured by every backend, with the argmax)
    The argmax's baselines: the backend's swap then ``torch.argmax`` over the
    swapped real rows, and ``torch.amax`` over the shard's real rows.
``swap_sample_gather``, ``read_once``, ``argmax_batch_vocab`` (with the verify)
    ``verify_batch_vocab`` (``--ops verify_batch_vocab``, one point per
    ``--verify-mix``) against TokenSpeed's Batch-DP route with the package's
    full-row sampler of the same semantics: the backend's swap,
    ``ipc_dpsample.sampling.verify_rows`` over the rank's swapped rows (on a GPU in
    chunks of ``runners.SAMPLER_CHUNK_ELEMS_GPU`` elements: fewer launches than its
    default), the backend's ``gather_verify_outputs``. Both are checked against
    ``layout.reference_verify_batch_vocab`` (predict, accept_index, accept_length bit
    for bit) on the inputs they are timed with: fresh random logits, the mix's
    parameters and candidates that accept 0 to N-1 drafts
    (:mod:`ipc_dpsample.tools.verify_case`). A backend without the op reports its
    verify points skipped, "not available", and
    still measures the baselines; the torch backend's verify is not captured in CUDA
    graphs (its records are computed on the host). The raw baselines below move the
    verify's records (an all-gather of ``bs * N`` records per rank).
``copy``
    The copy limit: each rank copies the op's bytes per rank with one
    ``copy_`` (device-to-device on one GPU, to the next GPU peer-to-peer with
    one GPU per rank, ``memcpy`` on the CPU).
``nccl_cupy``
    Raw NCCL through ``cupy.cuda.nccl``: grouped send/recv all-to-all for the swap,
    ``allGather`` for the gathers (no layout permutation; one GPU per rank).
``torch_dist``
    Raw ``torch.distributed.all_to_all_single`` / ``all_gather_into_tensor``.

Timing: ranks meet at a host barrier before each point; every call (eager) or
every replay of a CUDA graph holding ``--graph-ops`` calls (graph; divided by
that count) is timed with CUDA events (``perf_counter`` on the CPU). Rank threads
sharing a GPU are gated by default (``LaunchPlan.gated``; ``--ungated`` turns it
off): each sample waits behind a :class:`~ipc_dpsample.tools.common.Gate` until
every rank has issued it (eager: ``--graph-ops`` calls back to back), so it is
device time and not the threads' turns at the GIL (ungated, a 288-byte gather
at tp=2 took 101 us eager against 4.1 us graph-replayed on an H200). Each
table's first line says what was timed (:func:`~.output.timing_text`). A sample
is the slowest rank's time for that call. Reported: median, p10, p90, bytes per
rank, algorithmic and bus bandwidth, and ``vs_<baseline>`` = baseline median /
median (above 1: faster than the baseline; against ``copy``: the fraction of the
copy limit reached).

``--out`` receives ``bench.csv``, ``bench.json`` and ``bench.png``.

``--bs`` measures every op at several real batch sizes per ``pad_bs`` (bytes and
GB/s count the real rows only); ``argmax_batch_vocab`` brings its baselines
``swap_argmax`` and ``read_once``, measured per backend. After each launch's rows
come the ``bs`` scaling table (issue 13), the argmax table (issue 14) and the verify
table (issue 24: its record bytes per row per shard, the targets); their targets are
judged only on GPU device time (gated eager rows, graph replays).

Modules: :mod:`.config` (sweep, launch plan, points, bytes), :mod:`.options` (the
command line), :mod:`.runners` (what a rank times), :mod:`.measure` (the rank
body and timing), :mod:`.output` (rows, statistics, CSV/JSON/plot, table),
:mod:`.tables` (the bs and argmax summaries).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import time
from pathlib import Path
from typing import Any

from ..._version import package_commit
from ..common import Machine, detect_machine, spawn
from .config import (
    ARGMAX_BASELINES,
    BACKEND_CHOICES,
    BASELINES,
    COLUMNS,
    DEFAULT_OPS,
    MODES,
    BenchConfig,
    LaunchPlan,
    op_bytes,
    plan_launches,
    points,
)
from .measure import Gate, bench_rank
from .options import (
    add_arguments,
    choice_list,
    config_from_args,
    parse_bs_groups,
    parse_dtype_list,
    parse_int_list,
)
from .output import (
    PLOT_HINT,
    format_rows,
    make_rows,
    slowest,
    summarize,
    timing_text,
    write_csv,
    write_json,
    write_plot,
)
from .runners import swap_expected, swap_input
from .tables import format_argmax_table, format_bs_table, format_verify_table

#: ``ipc-dpsample bench --help``: plain text (argparse prints it as is).
DESCRIPTION = """\
Sweep the collectives and argmax_batch_vocab over shapes, dtypes, ranks,
backends and eager/graph modes, against the copy limit, raw NCCL and raw
torch.distributed measured in the same run. Every point is checked before it
is timed: bit for bit, argmax logprobs within a float32 tolerance of a float64
reference. The results go to bench.csv, bench.json and bench.png in --out.

--ops verify_batch_vocab measures the sampled verify for each --verify-mix
against swap_batch_vocab + the package's full-row sampler + gather, read_once
and argmax_batch_vocab, all checked against the NumPy reference, on every
backend (onesided, nccl, torch).

Ranks for each tp: one process per GPU where tp <= GPUs; tp rank threads
sharing GPU 0 where tp > GPUs (or with --gated); tp CPU processes over gloo
with --cpu or without a GPU.

Timing: rank threads sharing a GPU are gated by default. Every rank's stream
waits at one CUDA event until all ranks have issued the sample, so eager and
graph times are device time; --ungated times the host path instead. One
process per GPU times CUDA events as the calls are issued, and the CPU path
times wall clock. The header of each table says what was measured. The targets
of issues 13 and 14 are shown only where they apply: device time on a GPU
(gated eager rows and graph replays).

Exit status: 0 when every measured point verified, 1 otherwise, 2 on a usage
error."""

__all__ = [
    "ARGMAX_BASELINES",
    "BACKEND_CHOICES",
    "BASELINES",
    "COLUMNS",
    "DEFAULT_OPS",
    "DESCRIPTION",
    "MODES",
    "BenchConfig",
    "LaunchPlan",
    "add_arguments",
    "bench_rank",
    "choice_list",
    "config_from_args",
    "format_argmax_table",
    "format_bs_table",
    "format_rows",
    "format_verify_table",
    "make_rows",
    "op_bytes",
    "parse_bs_groups",
    "parse_dtype_list",
    "parse_int_list",
    "plan_launches",
    "points",
    "run",
    "run_bench",
    "run_launch",
    "slowest",
    "summarize",
    "swap_expected",
    "swap_input",
    "timing_text",
    "write_csv",
    "write_json",
    "write_plot",
]


# -- driver -------------------------------------------------------------------------
def run_launch(cfg: BenchConfig, lp: LaunchPlan) -> tuple[list[dict[str, Any]], str]:
    """Run one launch; returns its rows and an error text ("" when the ranks ran)."""
    from ...testing import RankFailure

    if lp.reason:
        return make_rows(cfg, lp, None), ""
    gate = Gate() if lp.gated else None
    try:
        results = spawn(
            lp.launch,  # type: ignore[arg-type]
            lp.device,  # type: ignore[arg-type]
            lp.tp,
            bench_rank,
            lp,
            cfg,
            gate,
            timeout_s=cfg.timeout_s,
        )
        skewed = sum(int(r.get("gate_skewed", 0)) for r in results)
        if skewed:
            cycles = max(int(r.get("gate_cycles", 0)) for r in results)
            print(
                f"tp={lp.tp}: the gate, at its longest ({cycles} GPU cycles), opened before "
                f"every rank had issued in {skewed} samples (their time includes launch skew)",
                file=sys.stderr,
            )
    except RankFailure as exc:
        failed = dataclasses.replace(lp, reason=f"ranks failed: {str(exc).strip()[-300:]}")
        rows = make_rows(cfg, failed, None)
        for r in rows:
            r["status"] = "failed"
        return rows, str(exc)
    return make_rows(cfg, lp, results), ""


def run_bench(cfg: BenchConfig, machine: Machine | None = None) -> int:
    """Run the sweep, print a table per launch, write CSV/JSON/PNG into ``cfg.out``.

    Returns 0 when every measured point succeeded and verified, else 1.
    """
    machine = machine or detect_machine()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat()
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    plans = plan_launches(cfg, machine)
    commit, gpu = package_commit(), machine_gpu_name()
    print(f"# ipc-dpsample bench: {started[:19]} UTC, commit {commit}, GPU {gpu}", flush=True)
    for lp in plans:
        print(
            f"\n== tp={lp.tp}: {lp.launch} on {lp.device}"
            + (f" (skipped: {lp.reason})" if lp.reason else ""),
            flush=True,
        )
        t0 = time.perf_counter()
        launch_rows, error = run_launch(cfg, lp)
        if error:
            errors.append(error)
            print(f"ranks failed:\n{error}", file=sys.stderr)
        rows += launch_rows
        if not lp.reason:
            print(timing_text(cfg, lp))
            print(format_rows(launch_rows))
            tables = (format_bs_table, format_argmax_table, format_verify_table)
            for table in (t(launch_rows) for t in tables):
                if table:
                    print("\n" + table)
            print(f"   ({time.perf_counter() - t0:.1f} s)", flush=True)
    meta = {
        "config": dataclasses.asdict(cfg),
        "machine": dataclasses.asdict(machine),
        "launches": [dataclasses.asdict(lp) | {"timing": timing_text(cfg, lp)} for lp in plans],
        "started": started,
        "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "host": os.uname().nodename,
        "versions": _versions(),
        "commit": commit,
        "gpu": gpu,
        "errors": errors,
        "ratio_definition": "vs_<baseline> = baseline median / median (above 1: faster)",
    }
    paths = [write_csv(rows, out / "bench.csv"), write_json(rows, meta, out / "bench.json")]
    try:
        paths.append(write_plot(rows, out / "bench.png"))
    except ImportError as exc:  # matplotlib is an extra: measure and write without it
        print(f"no plot ({exc}); for bench.png: {PLOT_HINT}", file=sys.stderr)
    print("\nwrote " + ", ".join(str(p) for p in paths))
    measured = [r for r in rows if r["status"] == "ok"]
    wrong = [r for r in rows if r["verified"] is False]
    failed = [r for r in rows if r["status"] == "failed"]
    if wrong:
        print(f"FAILED: {len(wrong)} points produced wrong results", file=sys.stderr)
    if failed:
        print(f"FAILED: {len(failed)} points failed (see the note column)", file=sys.stderr)
    if not measured:
        print("FAILED: nothing was measured", file=sys.stderr)
    good = bool(measured) and not wrong and not failed
    if good:
        checked = sum(r["verified"] is True for r in rows)
        print(
            f"OK: no point failed: {len(measured)} measured, {checked} of them checked "
            "against the reference before timing"
        )
    return 0 if good else 1


def _versions() -> dict[str, str | None]:
    v: dict[str, str | None] = {"python": sys.version.split()[0]}
    for mod in ("torch", "cupy", "numpy"):
        try:
            v[mod] = str(__import__(mod).__version__)
        except Exception:
            v[mod] = None
    return v


def machine_gpu_name() -> str | None:
    """Name of CUDA device 0 (torch), None without one."""
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:
        return None


def run(ns: argparse.Namespace) -> int:
    """Run ``ipc-dpsample bench``."""
    machine = detect_machine()
    try:
        cfg = config_from_args(ns, gpu_machine=machine.gpus > 0)
    except ValueError as exc:
        print(f"ipc-dpsample bench: {exc}", file=sys.stderr)
        return 2
    return run_bench(cfg, machine)

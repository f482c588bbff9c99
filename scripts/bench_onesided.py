#!/usr/bin/env python3
"""Gated benchmark of the one-sided backend with several ranks on ONE GPU: a thin
wrapper around ``python -m ipc_dpsample bench --gated`` (the measurement, checks
and CSV/JSON/plot are the tool's).

Measures the big swap (pad_bs=256, N=4, V=152064, fp32) at ``--tp`` ranks and at
tp=1 against the copy limit measured in the same run; without ``--big-only`` also
CUDA-graph replays and the small ops (swap pad_bs=8 bf16, both gathers at 64).
``--bs 256,130,8`` measures the big swap at those real batch sizes too (only the
real rows move; a device ``bs`` under a graph) and prints the tool's bs-scaling
table. Host time per call lives in ``scripts/profile_host.py``.

Writes the tool's ``bench.csv``/``bench.json`` into ``--out`` and, for
``scripts/device_run.sh``'s knob picker, ``bench_onesided.json`` whose rows carry
``what``, ``tp``, ``mode`` ("eager gated", "graph gated"), ``bytes``, ``us``
(median/p10/p90/n), ``GBps`` and ``ratio_to_copy``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

from ipc_dpsample.tools.cli import main as tool_main


def _bench(out: Path, tp: str, reps: int, modes: str, **shape: str) -> int:
    argv = ["bench", "--gated", "--tp", tp, "--backends", "onesided", "--baselines", "copy"]
    argv += ["--mode", modes, "--iters", str(reps), "--graph-ops", "20", "--out", str(out)]
    for key, value in shape.items():
        argv += [f"--{key.replace('_', '-')}", value]
    return tool_main(argv)


def _legacy_rows(doc: dict) -> list[dict]:
    """The tool's rows in the form ``bench_onesided.json`` always had."""
    rows = []
    for r in doc["rows"]:
        if r["status"] != "ok" or r["kind"] != "backend":
            continue
        what = f"{r['op']} pad_bs={r['pad_bs']} N={r['num_tokens']} V={r['vocab']} {r['dtype']}"
        if r.get("bs") not in (None, r["pad_bs"]):
            what += f" bs={r['bs']}"
        row = {
            "what": f"{what} tp={r['tp']}",
            "tp": r["tp"],
            "bs": r.get("bs"),
            "mode": f"{r['mode']} gated",
            "bytes": r["bytes"],
            "us": {k: r[f"{k}_us"] for k in ("median", "p10", "p90")} | {"n": r["n"]},
            "GBps": r["algbw_gbps"],
        }
        if r.get("vs_copy") is not None:
            row["ratio_to_copy"] = r["vs_copy"]
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--big-only", action="store_true", help="only the big swap, eager")
    ap.add_argument(
        "--bs",
        default="",
        help="real batch sizes of the big swap (pad_bs=256), a comma list in 1..256 "
        "(default: 256 only, every padded request real)",
    )
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
    out = Path(args.out)
    big = {"pad_bs": "256", "num_tokens": "4", "vocab": "152064", "dtype": "fp32"}
    big["ops"] = "swap_batch_vocab"
    if args.bs:
        big["bs"] = args.bs
    runs = [(out / "big", f"{args.tp},1", "eager" if args.big_only else "eager,graph", big)]
    if not args.big_only:
        small = {"num_tokens": "4", "vocab": "152064", "dtype": "bf16"}
        runs.append(
            (
                out / "small-swap",
                str(args.tp),
                "eager,graph",
                small | {"pad_bs": "8", "ops": "swap_batch_vocab"},
            )
        )
        gathers = small | {"pad_bs": "64", "ops": "gather_verify_outputs,gather_verify_logprobs"}
        runs.append((out / "small-gathers", str(args.tp), "eager,graph", gathers))
    rc, rows = 0, []
    for folder, tp, modes, shape in runs:
        rc |= _bench(folder, tp, args.reps, modes, **shape)
        path = folder / "bench.json"
        if path.exists():
            rows += _legacy_rows(json.loads(path.read_text()))
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_onesided.json").write_text(json.dumps({"rows": rows}, indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main())

"""Where a kernel's instructions and stalls go, from an ncu source page of SASS.

Reads what ``ncu -i REPORT --page source --csv --print-source sass`` writes (plain or
gzip; ``scripts/device_ncu_verify.sh`` with ``SOURCE=1`` saves it as
``src-MIX-bPAD-sass.csv.gz``) and prints, per kernel: the totals, the windows of
consecutive instructions that hold the most stall samples (with their share of the
executed instructions and the window's first instruction), and the single instructions
with the most stall samples. A window holding a loop shows its body; the instruction
after a load that stalls most is usually the first use of the loaded value.

Usage::

    python scripts/ncu_sass_summary.py benchmarks/h200-2026-12-06d/ncu-topk50-b256-sass.csv.gz
    python scripts/ncu_sass_summary.py FILE --kernel dp_verify_push --window 50 --top 15
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["Kernel", "main", "read_kernels", "summary"]

_SOURCE = "Source"
_STALLS = "Warp Stall Sampling (All Samples)"
_EXECUTED = "Instructions Executed"


@dataclass
class Kernel:
    """One kernel's SASS: per instruction, its text, warp instructions executed and
    stall samples, in address order."""

    name: str
    text: list[str]
    executed: list[int]
    stalls: list[int]


def _int(raw: str) -> int:
    raw = raw.strip().replace(",", "")
    return int(float(raw)) if raw else 0


def read_kernels(lines: Iterable[str]) -> list[Kernel]:
    """Parse an ncu source-page CSV (one or more kernels).

    Raises
    ------
    ValueError
        The file has no ``Address`` header with the columns this script reads.
    """
    kernels: list[Kernel] = []
    cols: dict[str, int] | None = None
    name = "?"
    for row in csv.reader(lines):
        if not row:
            continue
        if row[0] == "Kernel Name":
            name = row[1] if len(row) > 1 else "?"
            cols = None
            continue
        if row[0] == "Address":
            missing = [c for c in (_SOURCE, _STALLS, _EXECUTED) if c not in row]
            if missing:
                raise ValueError(f"the source page lacks the columns {missing}")
            cols = {c: row.index(c) for c in (_SOURCE, _STALLS, _EXECUTED)}
            kernels.append(Kernel(name, [], [], []))
            continue
        if cols is None or not row[0].startswith("0x"):
            continue
        k = kernels[-1]
        k.text.append(row[cols[_SOURCE]].strip())
        k.executed.append(_int(row[cols[_EXECUTED]]))
        k.stalls.append(_int(row[cols[_STALLS]]))
    if not kernels:
        raise ValueError("no 'Address' header: not an ncu --page source --csv file")
    return kernels


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:5.1f}%" if whole else "    -"


def summary(k: Kernel, window: int = 100, top: int = 10) -> str:
    """The report of one kernel (see the module docstring)."""
    n, ex, st = len(k.text), sum(k.executed), sum(k.stalls)
    out = [f"{k.name}: {n} SASS instructions, {ex} warp instructions executed, {st} stall samples"]
    wins = []
    for a in range(0, n, window):
        b = min(n, a + window)
        wins.append((sum(k.stalls[a:b]), sum(k.executed[a:b]), a, b))
    wins.sort(reverse=True)
    out.append(f"  windows of {window} instructions by stall samples:")
    out.append("     from     to  stalls  executed  first instruction")
    for s, e, a, b in wins[:top]:
        out.append(f"    {a:5d}  {b - 1:5d}  {_pct(s, st)}  {_pct(e, ex)}   {k.text[a][:60]}")
    out.append("  instructions by stall samples:")
    out.append("    index  stalls  executed  instruction")
    order = sorted(range(n), key=lambda i: -k.stalls[i])[:top]
    for i in order:
        out.append(f"    {i:5d}  {_pct(k.stalls[i], st)}  {k.executed[i]:9d}  {k.text[i][:70]}")
    return "\n".join(out)


def _open(path: str) -> io.TextIOBase:
    if path.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    """Print the summary of every kernel (or those whose name contains ``--kernel``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file", help="ncu --page source --csv --print-source sass output (.gz ok)")
    p.add_argument("--kernel", default="", help="only kernels whose name contains this")
    p.add_argument("--window", type=int, default=100, help="instructions per window")
    p.add_argument("--top", type=int, default=10, help="rows per table")
    args = p.parse_args(argv)
    if args.window < 1 or args.top < 1:
        p.error(f"--window and --top must be >= 1, got {args.window} and {args.top}")
    with _open(args.file) as f:
        kernels = [k for k in read_kernels(f) if args.kernel in k.name]
    if not kernels:
        print(f"no kernel name contains {args.kernel!r}", file=sys.stderr)
        return 1
    print("\n\n".join(summary(k, args.window, args.top) for k in kernels))
    return 0


if __name__ == "__main__":
    sys.exit(main())

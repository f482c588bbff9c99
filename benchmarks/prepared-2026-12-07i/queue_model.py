"""A NumPy model of how many columns of a float32 temperature row the one read scores.

``dv_row_max_temp`` (kernels/verify.cuh) reads a row once with one CTA of 128 threads (4
warps), 16-byte vectors, two a thread a round. Each warp queues the columns at or above
its bound (a column can win only if x / T + 16.6375 reaches the best score known) and
scores them 64 at a time once the queue holds ``at``; each drain raises the block's best
and the warp's bound. The leftovers are padded to whole 64-column rounds. The model keeps
that order (warps in turn, lanes' columns in ballot order) but not the timing between
warps, and uses NumPy's Gumbel noise instead of the Philox stream (the same law).

It prints the share of the row's columns that get their noise (every scored column costs
one Philox4x32-10), for the bench's rows (19 008 columns of ``randn * 4``, T drawn from
one of 0.6, 0.7, 0.8, 1.0 as ``ipc-dpsample bench --verify-mix temperature`` draws it):

* ``at=64`` (main) and ``at=128`` (patch 0003);
* ``sorted``: each drain scores its columns in descending order and drops those the
  raised bound excludes (an upper estimate of what ordering the queue could gain);
* ``defer k, cap``: columns within k T of the bound wait in a second buffer of ``cap``
  entries a warp, scored at the row's end against the final bound;
* ``ideal``: the final best known from the start (what two reads of the row approach).

Usage: ``python3 benchmarks/prepared-2026-12-07i/queue_model.py [ROWS]`` (default 40 rows,
about two minutes).
"""

from __future__ import annotations

import sys

import numpy as np

G_BOUND = 16.6375
B, U, E, W = 128, 2, 4, 32


def model(
    x: np.ndarray,
    t: float,
    g: np.ndarray,
    at: int,
    *,
    ordered: bool = False,
    defer: float = 0.0,
    cap: int = 0,
) -> float:
    """Share of the row's columns scored (padding included)."""
    n = len(x)
    nvec, nw = n // E, B // W
    score = x / t + g
    block = float(score[int(np.argmax(x[: min(B, nvec) * E]))])  # the seed
    bar = [block] * nw
    queue: list[list[int]] = [[] for _ in range(nw)]
    later: list[list[int]] = [[] for _ in range(nw)]
    scored = 0

    def drain(w: int, least: int) -> None:
        nonlocal block, scored
        if len(queue[w]) < least:
            return
        k = len(queue[w]) // 64 * 64
        todo = np.array(queue[w][:k], dtype=np.int64)
        queue[w] = queue[w][k:]
        if ordered:
            todo = todo[np.argsort(-x[todo], kind="stable")]
        while len(todo):
            chunk, todo = todo[:64], todo[64:]
            scored += 64
            block = max(block, float(score[chunk].max()))
            bar[w] = max(bar[w], block)
            if ordered:
                todo = todo[x[todo] >= (bar[w] - G_BOUND) * t]

    for v0 in range(0, nvec, U * B):
        for u in range(U):
            for w in range(nw):
                xb = (bar[w] - G_BOUND) * t
                vs = v0 + u * B + w * W + np.arange(W)
                vs = vs[vs < nvec]
                cols = (vs[None, :] * E + np.arange(E)[:, None]).ravel()
                cols = cols[x[cols] >= xb]
                if defer > 0.0:
                    near = cols[x[cols] < xb + defer * t]
                    room = max(cap - len(later[w]), 0)
                    later[w].extend(near[:room].tolist())
                    cols = np.concatenate([cols[x[cols] >= xb + defer * t], near[room:]])
                queue[w].extend(cols.tolist())
                drain(w, at)
    for w in range(nw):  # the leftovers, padded to whole rounds
        if queue[w]:
            scored += (len(queue[w]) + 63) // 64 * 64
            block = max(block, float(score[queue[w]].max()))
    final = (block - G_BOUND) * t
    for w in range(nw):
        keep = [c for c in later[w] if x[c] >= final]
        scored += (len(keep) + 63) // 64 * 64
    return scored / n


def main() -> None:
    nrows = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    rng = np.random.default_rng(1)
    rows = []
    for _ in range(nrows):
        x = (rng.standard_normal(19008) * 4).astype(np.float32)
        t = float(rng.choice([0.6, 0.7, 0.8, 1.0]))  # verify_case._TEMPERATURES
        rows.append((x, t, rng.gumbel(size=19008)))

    def mean(**kw: object) -> float:
        return float(np.mean([model(x, t, g, **kw) for x, t, g in rows]))  # type: ignore[arg-type]

    out = [f"{nrows} rows of 19008 columns, randn * 4, T 0.6/0.7/0.8/1.0: share scored"]
    out.append(f"  at=64 (main)              {mean(at=64):.3f}")
    out.append(f"  at=128 (patch 0003)       {mean(at=128):.3f}")
    out.append(f"  at=128, sorted drains     {mean(at=128, ordered=True):.3f}")
    for k, cap in ((3.0, 512), (3.0, 1024)):
        out.append(f"  at=128, defer {k:g} T, {cap:4d}   {mean(at=128, defer=k, cap=cap):.3f}")
    ideal = np.mean([np.mean(x >= ((x / t + g).max() - G_BOUND) * t) for x, t, g in rows])
    out.append(f"  ideal (final best known)  {ideal:.3f}")
    print("\n".join(out))  # noqa: T201


if __name__ == "__main__":
    main()

"""NumPy model of the temperature pass's bound (BENCHMARKS.md, 2026-12-07 warp-merge section).

A temperature row's column can win only if float32(x / T) + 16.6375 reaches the best score
found so far, so the pass computes the noise of every column at or above that bound. The
kernel starts from the best score of the threads' own maxima. This estimates, on the gated
bench's rows (19 008 ``randn * 4`` columns a shard, T in 0.6..1.0, 128 threads of 4-column
vectors), the share of columns that need their noise from that start, from each thread's best
4 columns, and from the row's final best score (the least any bound can do). Numpy's Gumbel
noise stands in for the Philox stream (the same distribution); not a GPU count.

    python3 benchmarks/h100-2026-12-07e/temperature_bound_model.py
"""

import numpy as np

N, THREADS, G_BOUND, ROWS = 19008, 128, 16.6375, 400


def main() -> None:
    rng = np.random.default_rng(0)
    owner = np.repeat(np.arange(N // 4) % THREADS, 4)  # thread of each column
    cols = [np.flatnonzero(owner == t) for t in range(THREADS)]
    start, top4, final = [], [], []
    for _ in range(ROWS):
        t = rng.uniform(0.6, 1.0)
        x = (rng.standard_normal(N) * 4).astype(np.float32)
        z = x / t
        score = z - np.log(-np.log(rng.random(N)))
        best0 = max(score[c[np.argmax(x[c])]] for c in cols)
        best4 = max(score[c[np.argsort(-x[c])[:4]]].max() for c in cols)
        start.append(np.mean(z >= best0 - G_BOUND))
        top4.append(np.mean(z >= best4 - G_BOUND))
        final.append(np.mean(z >= score.max() - G_BOUND))
    print(  # noqa: T201
        f"columns needing their noise: from the threads' maxima {np.mean(start):.4f}, "
        f"from each thread's best 4 {np.mean(top4):.4f}, from the final best {np.mean(final):.4f}"
    )


if __name__ == "__main__":
    main()

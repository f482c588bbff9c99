"""NumPy model of how many columns of a temperature row need their noise (the Philox
word and the Gumbel transform), with the two reads of IPC_DPSAMPLE_VERIFY_TEMP_ONEPASS=0
and with one read (=1 / =2). Not the kernels' exact arithmetic (float64 here, a fresh
Gumbel stream instead of Philox): only the share of columns at or above the bound.

Rows of the gated bench: V/tp = 19008 columns of randn * 4, T uniform in 0.6..1.0, 256
threads a row, 4 (float32) or 8 (bfloat16) columns a 16-byte vector.

- two reads: the bound comes from the best score of the threads' own maxima over the
  whole row (dv_row_temp);
- one read: from the score of the maximum of the first round of vectors (one vector a
  thread), then from the best score found so far, raised once per round of vectors (the
  kernel raises it at every drain of a warp's queue: a little more often).

Run: python3 bound_model.py (prints the mean share over 30 rows per vector width).
"""

import numpy as np

V, G, B = 19008, 16.6375, 256


def main() -> None:
    g = np.random.default_rng(1)
    for e in (4, 8):
        two, one = [], []
        for _ in range(30):
            t = g.uniform(0.6, 1.0)
            x = g.standard_normal(V).astype(np.float32) * 4
            score = x / t - np.log(-np.log(g.uniform(size=V)))
            nvec = V // e
            rounds = (nvec + B - 1) // B
            vec = np.arange(nvec * e) // e
            thread, rnd = vec % B, vec // B
            best = -np.inf
            for th in range(B):
                sel = np.where(thread == th)[0]
                best = max(best, score[sel[np.argmax(x[sel])]])
            two.append(np.mean(x >= t * (best - G)))
            first = np.where(rnd == 0)[0]
            s = score[first[np.argmax(x[first])]]
            queued = 0
            for r in range(rounds):
                seg = np.where(rnd == r)[0]
                passing = x[seg] >= t * (s - G)
                queued += passing.sum()
                if passing.any():
                    s = max(s, score[seg][passing].max())
            one.append(queued / V)
        print(f"{e} columns a vector: two reads {np.mean(two):.3f}, one read {np.mean(one):.3f}")  # noqa: T201


if __name__ == "__main__":
    main()

"""NumPy model of branch issue24-vkeys' second pass on a pad_bs=8 top-k 50 row (19 008
fp32 columns of randn * 4, one CTA of 256 threads, 8 warps): the candidates at or above
the threshold (each warp's 7th largest lane maximum, the smallest over the warps), the
vectors read again (key's upper 16 bits at or above the threshold's), and how many
distinct (loop round, slot) places a warp holds them at. Run: python3 vkeys_model.py"""

import numpy as np

B, E, NCOLS, WARPS, R = 256, 4, 19008, 8, 7
NVEC = NCOLS // E


def order_key(x: np.ndarray) -> np.ndarray:
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return np.where(u & 0x80000000, (~u) & 0xFFFFFFFF, u | 0x80000000)


rows = []
g = np.random.default_rng(1)
for _ in range(50):
    x = (g.standard_normal(NCOLS) * 4).astype(np.float32)
    vmax = x.reshape(NVEC, E).max(1)
    lane_max = np.array([vmax[t::B].max() for t in range(B)], np.float32)
    lk = order_key(lane_max)
    thr = min(np.sort(lk[w * 32 : (w + 1) * 32])[::-1][R - 1] for w in range(WARPS))
    again = np.nonzero((order_key(vmax) >> 16) >= (thr >> 16))[0]
    group = again // 4  # 4 keys a thread per shared load: thread group % B, round group // B
    warp, rnd, slot = (group % B) // 32, group // B, again % 4
    places = [len(set(zip(rnd[warp == w], slot[warp == w], strict=True))) for w in range(WARPS)]
    rows.append(((order_key(x) >= thr).sum(), len(again), np.mean(places), max(places)))
a = np.array(rows, float)
c, v, p, s = a.mean(0)
print(  # noqa: T201
    f"mean over 50 rows: candidates {c:.1f}, vectors read again {v:.1f}, "
    f"places a warp {p:.2f}, the slowest warp's {s:.2f}"
)

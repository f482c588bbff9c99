#!/usr/bin/env python3
"""The compute floor of a temperature row: how fast this GPU makes the noise's Philox words.

``verify_batch_vocab`` decides a temperature row exactly: every column whose best possible
score (``x / T`` plus the largest noise, 16.6355) reaches the row's best score needs its
own Gumbel noise, one Philox4x32-10 word keyed by the global token id (TokenSpeed's
``tl.rand``; ``docs/verify_contract.md``). On ``randn * 4`` rows at T 0.6 .. 1.0 about 19 %
of the columns need it even from the row's final best score, the least any bound can do
(``benchmarks/h100-2026-12-07e/temperature_bound_model.py``). This script measures, on
this GPU alone and with nothing else in the kernel:

* ``philox``: Philox words a second, the verify kernels' own ``dv_philox32_w0``
  (``kernels/verify.cuh``), two independent chains a thread (as their temperature pass
  runs them), each word folded into a checksum so none is optimised away;
* ``read``: a float32 array of the gated bench's size (tp shards of ``rows x V / tp``)
  read once (the maximum of each thread's columns), the copy limit that ``read_once``
  stands for;

and prints, for the gated bench's shape, the time of the Philox words alone for
``--fraction`` of its columns, against the read: a floor below which no exact temperature
kernel with this noise can go on this GPU, whatever its memory traffic. The checksum of
the first ``2**20`` words is checked against ``ipc_dpsample.layout.philox4x32_10`` before
anything is timed. Medians with p10..p90 over ``--iters`` samples, each between two CUDA
events::

    PYTHONPATH=$PWD python3 scripts/bench_philox.py
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

SOURCE = r"""
#include "verify.cuh"
// word 0 of Philox4x32-10 of counters (i, 0, 0, 0), key (k0, k1), for i < n, two chains a
// thread; the XOR of every word lands in *out
extern "C" __global__ void philox_words(unsigned long long n, unsigned k0, unsigned k1,
                                        unsigned* out) {
  const unsigned long long stride = 2ull * gridDim.x * blockDim.x;
  unsigned acc = 0;
  for (unsigned long long i = 2ull * (blockIdx.x * blockDim.x + threadIdx.x); i < n;
       i += stride) {
    const unsigned a = dv_philox32_w0((unsigned)i, k0, k1);
    const unsigned b = i + 1 < n ? dv_philox32_w0((unsigned)(i + 1), k0, k1) : 0u;
    acc ^= a ^ b;
  }
  for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xFFFFFFFFu, acc, o);
  if ((threadIdx.x & 31u) == 0) atomicXor(out, acc);
}
// the maximum of n float32 values, 16 bytes a load, into *out as its bits (x >= 0 only:
// the inputs are |values|, so the integer maximum of the bits is the float maximum)
extern "C" __global__ void read_max(const float4* x, unsigned long long n4, unsigned* out) {
  float m = 0.0f;
  for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n4;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    const float4 v = x[i];
    m = fmaxf(m, fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w)));
  }
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  if ((threadIdx.x & 31u) == 0) atomicMax(out, __float_as_uint(m));
}
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=8, help="shards of the gated bench's batch")
    ap.add_argument("--rows", type=int, default=1024, help="rows a shard (pad_bs * N)")
    ap.add_argument("--vocab", type=int, default=152064)
    ap.add_argument(
        "--fraction",
        type=float,
        default=0.19,
        help="share of the columns that need their noise (the bound model's 19 %%)",
    )
    ap.add_argument("--words", type=int, default=1 << 30, help="Philox words a sample")
    ap.add_argument("--iters", type=int, default=15, help="timed samples")
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args(argv)
    if not 0.0 < ns.fraction <= 1.0:
        ap.error(f"--fraction {ns.fraction}: expected a share in (0, 1]")
    if ns.words < 1 << 20 or ns.iters < 1 or ns.tp < 1 or ns.rows < 1 or ns.vocab < ns.tp:
        ap.error("--words >= 2**20, --iters >= 1, --tp >= 1, --rows >= 1, --vocab >= --tp")
    return ns


def reference_checksum(n: int, k0: int, k1: int) -> int:
    """XOR of word 0 of Philox4x32-10 of counters ``(i, 0, 0, 0)``, ``i < n`` (NumPy)."""
    from ipc_dpsample.layout import philox4x32_10

    ids = np.arange(n, dtype=np.uint64)
    w0 = np.asarray(philox4x32_10((ids, 0, 0, 0), (k0, k1))[0], dtype=np.uint64)
    return int(np.bitwise_xor.reduce(w0.astype(np.uint32)))


def _stats(us: list[float]) -> tuple[float, str]:
    p10, med, p90 = np.percentile(np.asarray(us), [10, 50, 90])
    return float(med), f"{med:9.2f} us [p10 {p10:.2f}, p90 {p90:.2f}]"


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(argv)
    try:
        import cupy as cp

        cp.cuda.runtime.getDeviceCount()
    except (ImportError, RuntimeError) as e:  # CUDARuntimeError is a RuntimeError
        print(f"bench_philox.py needs CuPy and a CUDA GPU: {e}", file=sys.stderr)
        return 2
    from ipc_dpsample.kernel_cache import kernel_dir

    mod = cp.RawModule(code=SOURCE, options=("--std=c++17", f"-I{kernel_dir()}"))
    words_k, read_k = mod.get_function("philox_words"), mod.get_function("read_max")
    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    rng = np.random.default_rng(ns.seed)
    k0, k1 = (int(v) for v in rng.integers(0, 2**32, 2))
    u, i32 = np.uint64, np.uint32
    grid, block = (sms * 16,), (256,)
    out = cp.zeros(1, cp.uint32)

    def run_words(n: int) -> int:
        out.fill(0xA5A5A5A5)  # poisoned: the kernel XORs into it
        words_k(grid, block, (u(n), i32(k0), i32(k1), out))
        return int(out.get()[0]) ^ 0xA5A5A5A5

    want = reference_checksum(1 << 20, k0, k1)
    got = run_words(1 << 20)
    if got != want:
        print(f"FAIL: Philox checksum {got:#010x}, expected {want:#010x}", file=sys.stderr)
        return 1

    columns = ns.tp * ns.rows * (ns.vocab // ns.tp)
    x = cp.abs(cp.asarray(rng.standard_normal(columns, dtype=np.float32)))
    n4 = columns // 4
    want_max = float(cp.asnumpy(x[: n4 * 4].max()))
    out.fill(0)
    read_k(grid, block, (x, u(n4), out))
    got_max = float(out.view(cp.float32).get()[0])
    if got_max != want_max:
        print(f"FAIL: read_max {got_max}, expected {want_max}", file=sys.stderr)
        return 1

    def timed(fn: Any) -> list[float]:
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        fn()  # warm-up
        us = []
        for _ in range(ns.iters):
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            us.append(cp.cuda.get_elapsed_time(start, stop) * 1e3)
        return us

    w_med, w_txt = _stats(timed(lambda: words_k(grid, block, (u(ns.words), i32(k0), i32(k1), out))))
    r_med, r_txt = _stats(timed(lambda: read_k(grid, block, (x, u(n4), out))))
    rate = ns.words / (w_med * 1e-6)
    nbytes = n4 * 16
    need = ns.fraction * columns
    floor_us = need / rate * 1e6
    print(f"GPU {name} ({sms} SMs); Philox checksum and read maximum checked against NumPy")
    print(f"philox  {ns.words} words: {w_txt}  -> {rate / 1e9:.1f} G words/s")
    print(f"read    {nbytes / 1e6:.1f} MB float32: {r_txt}  -> {nbytes / r_med / 1e3:.1f} GB/s")
    print(f"shape   tp={ns.tp} x {ns.rows} rows x {ns.vocab // ns.tp} columns = {columns} columns")
    print(
        f"floor   Philox words of {ns.fraction:.0%} of them: {floor_us:.1f} us = "
        f"{floor_us / r_med:.2f}x the float32 read ({2 * floor_us / r_med:.2f}x a bfloat16 "
        f"read, half the bytes); every column: {columns / rate * 1e6:.1f} us"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A fused Triton full-row Gumbel sampler, timed: the sampling step of the route that
``verify_batch_vocab`` replaces, built the way TokenSpeed's Triton backend builds it.

TokenSpeed's route is ``swap_batch_vocab`` (every rank gets its requests' full rows),
then a Triton sampler over those rows, then ``gather_verify_outputs``. The package's
own full-row sampler (``ipc_dpsample.sampling``) is exact but made of unfused torch
ops, so a comparison against it says little. This script times the fast design
instead: every column's score ``x / T - log(-log(max(u, 1e-7)))`` with
``u = tl.rand(tl.randint(seed, offset + d), column)`` (Triton's Philox and its float32
``log``), the best column of each block of columns in a first kernel (its lowest
column on ties), the best block of each row in a second. That is the arithmetic of
TokenSpeed's Gumbel kernels (``tokenspeed_kernel/ops/sampling/triton/gumbel.py``,
temperature only: no top-k, top-p or min-p); the code is written here.

The timed rows are the rows of every rank at once: ``pad_bs * N`` rows of the whole
vocabulary (what the tp ranks of one box hold after the swap, tp rows blocks of
``pad_bs / tp * N``). With the ranks on separate GPUs each GPU samples ``1 / tp`` of
them; with the package's gated single-GPU benchmark (every rank sharing one GPU) the
GPU does all of them, which is what is timed here.

Before timing, the tokens of the first rows are checked against the package's NumPy
reference (``layout.sample_full_rows``, whose noise is Triton's stream): they must be
equal on at least 99 % of the rows, a difference allowed only where the two best
scores are a near tie (Triton's float32 ``log`` is not the reference's correctly
rounded one). Then each variant is timed with CUDA events per call; the script prints
medians with p10..p90, bytes read, GB/s, and the same figures for ``torch.amax`` over
the rows (one read of the logits, for scale).

Usage (on a GPU machine with torch and Triton)::

    PYTHONPATH=$PWD python3 scripts/bench_triton_sampler.py --pad-bs 256 --num-tokens 4 \\
        --vocab 152064 --dtype fp32,bf16
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from typing import Any

import numpy as np

from ipc_dpsample._version import package_commit
from ipc_dpsample.layout import noise_stream_key, sample_full_rows

_TEMPERATURES = np.asarray((0.6, 0.7, 0.8, 1.0), np.float32)  # the bench's temperature mix
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def block_best(x_ptr, t_ptr, seed_ptr, off_ptr, ids_ptr, best_ptr, n_blocks, V, N,
                   B: tl.constexpr):  # fmt: skip
        row = tl.program_id(0)
        blk = tl.program_id(1)
        req = row // N
        cols = blk * B + tl.arange(0, B)
        mask = cols < V
        x = tl.load(x_ptr + row.to(tl.int64) * V + cols, mask=mask, other=float("-inf"))
        temperature = tl.maximum(tl.load(t_ptr + req).to(tl.float32), 1.0e-20)
        key = tl.randint(tl.load(seed_ptr + req), tl.load(off_ptr + req) + (row - req * N))
        u = tl.maximum(tl.rand(key, cols), 1.0e-7)
        s = tl.where(mask, x.to(tl.float32) / temperature - tl.log(-tl.log(u)), float("-inf"))
        m = tl.max(s, axis=0)
        tok = tl.min(tl.where(s == m, cols, 2147483647), axis=0)
        tl.store(ids_ptr + row * n_blocks + blk, tok)
        tl.store(best_ptr + row * n_blocks + blk, m)

    @triton.jit
    def row_best(ids_ptr, best_ptr, out_ptr, n_blocks, P: tl.constexpr):
        row = tl.program_id(0)
        j = tl.arange(0, P)
        mask = j < n_blocks
        s = tl.load(best_ptr + row * n_blocks + j, mask=mask, other=float("-inf"))
        ids = tl.load(ids_ptr + row * n_blocks + j, mask=mask, other=2147483647)
        m = tl.max(s, axis=0)
        tl.store(out_ptr + row, tl.min(tl.where(s == m, ids, 2147483647), axis=0))

    return block_best, row_best


def _time(fn: Any, iters: int, warmup: int) -> list[float]:
    """Microseconds per call, one pair of CUDA events around each call."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1000.0)
    return out


def _summary(name: str, us: list[float], nbytes: int) -> str:
    q = np.percentile(us, [10, 90])
    med = statistics.median(us)
    return (
        f"{name:<34} median {med:8.1f} us [p10 {q[0]:.1f}, p90 {q[1]:.1f}], n={len(us)}, "
        f"{nbytes / 1e6:.1f} MB read, {nbytes / med / 1e3:.0f} GB/s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pad-bs", type=int, default=256)
    parser.add_argument("--num-tokens", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--dtype", default="fp32,bf16", help="comma list of fp32, bf16, fp16")
    parser.add_argument("--blocks", default="1024,2048,4096", help="columns per Triton program")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--check-rows", type=int, default=64)
    args = parser.parse_args(argv)

    import torch
    import triton

    if not torch.cuda.is_available():
        print("bench_triton_sampler: needs a CUDA GPU (torch sees none)", file=sys.stderr)
        return 2
    block_best, row_best = _kernels()
    dev = torch.device("cuda")
    rows, v, n = args.pad_bs * args.num_tokens, args.vocab, args.num_tokens
    print(
        f"# bench_triton_sampler: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} "
        f"UTC, commit {package_commit()}, GPU {torch.cuda.get_device_name(0)}, "
        f"torch {torch.__version__}, triton {triton.__version__}"
    )
    print(f"# command: python scripts/bench_triton_sampler.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"# rows={rows} (pad_bs={args.pad_bs} x N={n}), V={v}, logits randn * 4, T in 0.6..1.0")
    rng = np.random.default_rng(2026)
    temperature = rng.choice(_TEMPERATURES, args.pad_bs).astype(np.float32)
    seed = rng.integers(-(2**62), 2**62, args.pad_bs, dtype=np.int64)
    offset = rng.integers(0, 2**40, args.pad_bs, dtype=np.int64)
    t_d, seed_d, off_d = (torch.from_numpy(a).to(dev) for a in (temperature, seed, offset))
    failed = False
    for name in args.dtype.split(","):
        if name not in _DTYPES:
            parser.error(f"--dtype item {name!r}; expected one of {','.join(_DTYPES)}")
        dtype = getattr(torch, _DTYPES[name])
        x = (torch.randn(rows, v, device=dev, dtype=torch.float32) * 4.0).to(dtype)
        nbytes = x.numel() * x.element_size()
        out = torch.full((rows,), -1, dtype=torch.int32, device=dev)
        # the reference's tokens of the first rows (the float32 value of each logit)
        c = min(args.check_rows, rows)
        xs = x[:c].float().cpu().numpy()
        req = np.arange(c) // n
        key = noise_stream_key(seed[req], offset[req] + (np.arange(c) % n))
        want = sample_full_rows(
            xs, temperature=temperature[req], top_k=np.zeros(c, np.int64),
            top_p=np.ones(c, np.float32), min_p=np.zeros(c, np.float32),
            greedy=np.zeros(c, bool), stream_key=key,
        )  # fmt: skip
        for b in (int(s) for s in args.blocks.split(",")):
            nb = -(-v // b)
            ids = torch.empty((rows, nb), dtype=torch.int32, device=dev)
            best = torch.empty((rows, nb), dtype=torch.float32, device=dev)
            p = triton.next_power_of_2(nb)

            def call(ids=ids, best=best, nb=nb, b=b, p=p, x=x, out=out) -> None:
                block_best[(rows, nb)](x, t_d, seed_d, off_d, ids, best, nb, v, n, B=b)
                row_best[(rows,)](ids, best, out, nb, P=p)

            out.fill_(-1)
            call()
            torch.cuda.synchronize()
            got = out[:c].cpu().numpy()
            differ = int((got != want).sum())
            ok = differ <= max(1, c // 100) and (out >= 0).all().item()
            failed |= not ok
            verdict = "checked" if ok else "FAILED"
            label = f"triton sampler {name} B={b}"
            print(
                f"{_summary(label, _time(call, args.iters, args.warmup), nbytes)}, "
                f"{verdict} ({differ} of {c} rows differ from the reference)"
            )
        amax = _time(lambda x=x: torch.amax(x, dim=1), args.iters, args.warmup)
        print(_summary(f"torch.amax (one read) {name}", amax, nbytes))
        del x
        torch.cuda.empty_cache()
    print("FAILED: a variant's tokens differ from the reference" if failed else "OK")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

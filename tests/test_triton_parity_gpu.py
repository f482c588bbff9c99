"""TokenSpeed parity of the noise contract, checked against Triton itself on a GPU
(issue 24, exactness item 4; ``docs/verify_contract.md``, "TokenSpeed parity").

TokenSpeed's Triton sampler draws, for row ``(req, d)``, ``gs = tl.randint(seed,
offset + d)`` (a 32-bit word: Philox4x32-10 on the offset's two 32-bit halves, keyed
by the seed's) and, per column, ``u = max(tl.rand(gs, column), 1e-7)``, then samples
``argmax(logits / max(T, 1e-20) - log(-log(u)))`` (lowest column on ties). These tests
run that arithmetic as a Triton kernel written here (Triton's own Philox, ``log`` and
division) and compare it with the package's NumPy reference, which the GPU kernels
equal bit for bit (``tests/test_verify_onesided_gpu.py``):

* the stream key and every uniform: bit for bit;
* the sampled tokens: equal except on rows whose two best Triton scores lie within a
  few float32 ulps (Triton's float32 ``log`` and division are not the reference's
  correctly rounded ones); such rows must be rare and each one a near tie.
"""

from __future__ import annotations

import numpy as np
import pytest
from _gpu_common import gpu_skip_reason
from _verify_bodies import encode, logits, storage

from ipc_dpsample.layout import (
    noise_stream_key,
    philox4x32_10,
    reference_verify_batch_vocab,
    uniform_from_uint32,
)


def _skip_reason() -> str | None:
    reason = gpu_skip_reason()
    if reason is not None:
        return reason
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"Triton is not importable ({exc}); torch's CUDA builds ship it"
    return None


_REASON = _skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def _kernels() -> tuple[object, object]:
    import triton
    import triton.language as tl

    @triton.jit
    def noise(seed_ptr, off_ptr, key_ptr, u_ptr, B: tl.constexpr):
        r = tl.program_id(0)
        gs = tl.randint(tl.load(seed_ptr + r).to(tl.int64), tl.load(off_ptr + r).to(tl.int64))
        # a 32-bit word (Triton 3.x randint4x splits 64-bit offsets into two counters)
        tl.store(key_ptr + r, gs.to(tl.uint32, bitcast=True).to(tl.int64))
        cols = tl.arange(0, B)
        tl.store(u_ptr + r * B + cols, tl.maximum(tl.rand(gs, cols), 1.0e-7))

    @triton.jit
    def scores(x_ptr, t_ptr, seed_ptr, off_ptr, out_ptr, n, V: tl.constexpr, B: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * B + tl.arange(0, B)
        mask = cols < V
        x = tl.load(x_ptr + row * V + cols, mask=mask, other=float("-inf")).to(tl.float32)
        req = row // n
        temperature = tl.maximum(tl.load(t_ptr + req).to(tl.float32), 1.0e-20)
        offset = tl.load(off_ptr + req).to(tl.int64) + (row - req * n)
        gs = tl.randint(tl.load(seed_ptr + req).to(tl.int64), offset)
        u = tl.maximum(tl.rand(gs, cols), 1.0e-7)
        s = tl.where(mask, x / temperature - tl.log(-tl.log(u)), float("-inf"))
        tl.store(out_ptr + row * V + cols, s, mask=mask)

    return noise, scores


def test_triton_noise_stream_is_the_reference_one() -> None:
    """``tl.randint(seed, offset)`` is :func:`noise_stream_key` and ``tl.rand(key, col)``
    (floored at 1e-7) is :func:`uniform_from_uint32` of Philox4x32-10 word 0, bit for
    bit, over seeds of both signs and offsets beyond 32 bits."""
    import torch
    import triton

    print(f"triton {triton.__version__}")

    noise, _ = _kernels()
    rows, b = 64, 1024
    rng = np.random.default_rng(24)
    seed = rng.integers(-(2**62), 2**62, rows)
    off = rng.integers(0, 2**40, rows)
    key = torch.full((rows,), -1, dtype=torch.int64, device="cuda")
    u = torch.full((rows, b), float("nan"), dtype=torch.float32, device="cuda")
    noise[(rows,)](torch.tensor(seed, device="cuda"), torch.tensor(off, device="cuda"), key, u, B=b)
    want = noise_stream_key(seed, off)
    got_key = key.cpu().numpy().view(np.uint64)
    bad = np.flatnonzero(got_key != want)
    assert not len(bad), f"{len(bad)} keys differ: {got_key[bad[:3]]} != {want[bad[:3]]}"
    k = want[:, None]
    x0 = philox4x32_10((np.arange(b, dtype=np.uint64)[None], 0, 0, 0), (k & 0xFFFFFFFF, k >> 32))[0]
    got = u.cpu().numpy()
    bad = np.argwhere(got != uniform_from_uint32(x0))
    assert not len(bad), f"{len(bad)} uniforms differ, first at {bad[:4].tolist()}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tokens_equal_tritons_gumbel_sampler_but_near_ties(dtype: str) -> None:
    """Temperature rows sampled by Triton's arithmetic and by the reference: the same
    token on every row but a few near ties (the two tokens' Triton scores within
    1e-5 relative), at most 1% of the rows."""
    import torch

    _, scores = _kernels()
    pad_bs, n, v, b = 256, 2, 5000, 1024
    rng = np.random.default_rng(7)
    x = encode(logits((24, 1), pad_bs * n, v, scale=3.0, specials=False), dtype)
    temperature = rng.choice(np.array([0.3, 0.7, 1.0, 1.5], np.float32), pad_bs)
    seed = rng.integers(-(2**62), 2**62, pad_bs)
    off = rng.integers(0, 2**40, pad_bs)
    cand = np.zeros((pad_bs, n), np.int32)
    predict = reference_verify_batch_vocab(
        [storage(x)], cand, tp=1, pad_bs=pad_bs, dtype=dtype, temperature=temperature,
        seed=seed, offset=off,
    )[0]  # fmt: skip
    # predict[:, 0] is row 0's sampled token; row 1's is predict[:, 1] only where draft
    # 1 was accepted, so run again with candidates that accept it
    cand[:, 1] = predict[:, 0]
    full = reference_verify_batch_vocab(
        [storage(x)], cand, tp=1, pad_bs=pad_bs, dtype=dtype, temperature=temperature,
        seed=seed, offset=off,
    )  # fmt: skip
    assert (full[2] == 2).all(), "every draft 1 equals row 0's token: all accepted"
    ours = full[0].reshape(-1)

    dev = torch.device("cuda")
    out = torch.full((pad_bs * n, v), float("nan"), dtype=torch.float32, device=dev)
    scores[(pad_bs * n, -(-v // b))](
        x.to(dev), torch.from_numpy(temperature).to(dev), torch.tensor(seed, device=dev),
        torch.tensor(off, device=dev), out, n, V=v, B=b,
    )  # fmt: skip
    s = out.cpu().numpy()
    assert not np.isnan(s).any()
    theirs = s.argmax(axis=1)  # the first (lowest) column of the maximum
    differ = np.flatnonzero(theirs != ours)
    rows = np.arange(len(ours))
    gap = s[rows, theirs] - s[rows, ours]
    scale = np.maximum(1.0, np.abs(s[rows, theirs]))
    print(f"{dtype}: {len(differ)} of {len(ours)} rows differ, largest gap {gap.max():.3g}")
    assert len(differ) <= len(ours) // 100, (len(differ), differ[:8].tolist())
    far = differ[gap[differ] > 1e-5 * scale[differ]]
    assert not len(far), f"rows {far[:8].tolist()} differ by more than a near tie: {gap[far][:8]}"

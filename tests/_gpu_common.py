"""Shared helpers of the GPU tests: skip reasons, deterministic random inputs, and
the NumPy reference checks."""

from __future__ import annotations

import numpy as np


def gpu_skip_reason(min_gpus: int = 1) -> str | None:
    """None when CuPy and torch can drive ``min_gpus`` GPUs, else what is missing."""
    try:
        import cupy

        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError on a machine without a GPU
        return f"needs a CUDA GPU visible to CuPy ({type(exc).__name__}: {str(exc)[:80]})"
    if n < min_gpus:
        return f"needs {min_gpus} CUDA GPU(s), found {n}"
    try:
        import torch

        if not torch.cuda.is_available():
            return "needs torch with CUDA (torch.cuda.is_available() is False)"
    except Exception as exc:
        return f"needs torch ({exc})"
    return None


TORCH_DTYPES = {}


def torch_dtype(name: str):
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def all_inputs(seed: int, tp: int, pad_bs: int, n: int, vs: int, dtype: str, device="cpu"):
    """Every rank's local_logits for one swap (identical on every rank)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tp, pad_bs * n, vs, generator=g, device=device) * 10 + 0.5
    return x.to(torch_dtype(dtype))


def all_verify(seed: int, tp: int, pad_bs: int, n: int, device="cpu"):
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    r = pad_bs // tp
    hi = 2**31 - 1
    pred = torch.randint(-hi, hi, (tp, r, n), generator=g, device=device, dtype=torch.int64)
    acc = torch.randint(-hi, hi, (tp, r, n), generator=g, device=device, dtype=torch.int64)
    ln = torch.randint(-hi, hi, (tp, r), generator=g, device=device, dtype=torch.int64)
    lp = torch.randn(tp, r, n, generator=g, device=device) * 100
    return pred.to(torch.int32), acc.to(torch.int32), ln.to(torch.int32), lp


def swap_reference_torch(x_all, rank: int, tp: int, pad_bs: int, n: int):
    """Reference of rank ``rank``'s swap output computed with torch indexing on the
    same device (used where the NumPy round trip would dominate a long run); the
    NumPy reference in ipc_dpsample.layout is checked against it in test_layout."""
    rows = pad_bs // tp * n
    vs = x_all.shape[-1]
    blk = x_all[:, rank * rows : (rank + 1) * rows, :]  # [src, rows, vs]
    return blk.permute(1, 0, 2).reshape(rows, tp * vs)


def bits(t) -> np.ndarray:
    """Bit pattern of a tensor as a NumPy integer array (bfloat16 has no NumPy dtype)."""
    import torch

    t = t.detach().cpu()
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16).numpy()
    if t.dtype == torch.float32:
        return t.view(torch.int32).numpy()
    return t.numpy()


def argmax_inputs(seed: int, tp: int, pad_bs: int, n: int, vs: int, dtype: str, vocab_limit: int):
    """Every rank's ``local_logits`` for an argmax, ``[tp, pad_bs*n, vs]`` on the CPU:
    random rows plus, where the batch has room, the special rows of the contract:
    a tie of the maximum across a shard boundary, a NaN, an all ``-inf`` row, a
    ``+inf``, and values whose naive exp overflows. The columns that win stay below
    ``vocab_limit``; the padded tail holds larger values that must not win."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tp, pad_bs * n, vs, generator=g) * 3
    v = tp * vs
    full = x.permute(1, 0, 2).reshape(pad_bs * n, v)  # a view: rows of the full vocab
    full[:, vocab_limit:] = 50.0  # the tail would win if it counted
    rows = pad_bs * n
    big = 60000.0 if dtype == "float16" else 3.0e38
    specials = []
    if vocab_limit > vs:  # a tie across the boundary of shards 0 and 1
        specials.append(lambda r: full[r].__setitem__(slice(vs - 1, vs + 1), 20.0))
    specials += [
        lambda r: full[r].__setitem__(min(vocab_limit - 1, v // 2), float("nan")),
        lambda r: full[r].fill_(float("-inf")),
        lambda r: full[r].__setitem__(0, float("inf")),
        lambda r: full[r, :vocab_limit].mul_(big / 4).clamp_(-big, big),
        lambda r: full[r, :vocab_limit].fill_(7.0),  # every column ties: index 0
    ]
    for i, special in enumerate(specials):
        if 2 * i + 1 < rows:
            special(2 * i + 1)
    return full.reshape(pad_bs * n, tp, vs).permute(1, 0, 2).contiguous().to(torch_dtype(dtype))


def reference_argmax(x_all, tp: int, pad_bs: int, n: int, dtype: str, vocab_limit: int):
    """:func:`ipc_dpsample.layout.reference_argmax_batch_vocab` of torch inputs."""
    import torch

    from ipc_dpsample.layout import reference_argmax_batch_vocab

    if dtype == "bfloat16":
        inputs = [x.view(torch.int16).numpy().view(np.uint16) for x in x_all]
    else:
        inputs = [x.numpy() for x in x_all]
    return reference_argmax_batch_vocab(
        inputs, tp=tp, num_tokens_per_req=n, pad_bs=pad_bs, dtype=dtype, vocab_limit=vocab_limit
    )


def onesided_comm(group, rank: int, tp: int, **kw):
    """A communicator of the GPU tests: one-sided on GPU 0, 20 s timeout unless given."""
    from ipc_dpsample import DpSamplingComm

    kw.setdefault("backend", "onesided")
    kw.setdefault("device", 0)
    kw.setdefault("timeout_s", 20.0)
    return DpSamplingComm(tp_size=tp, rank=rank, group=group, **kw)

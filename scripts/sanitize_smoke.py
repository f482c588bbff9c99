#!/usr/bin/env python3
"""A short in-process run of every one-sided kernel path, for compute-sanitizer:
``compute-sanitizer --tool memcheck python3 scripts/sanitize_smoke.py [tp]``.
Exits non-zero if any output differs from the reference."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import torch

from ipc_dpsample import DpSamplingComm
from ipc_dpsample.testing import run_threads


def body(rank: int, tp: int, group) -> bool:
    torch.cuda.set_device(0)
    stream = torch.cuda.Stream()
    torch.cuda.set_stream(stream)
    n, vs, pad_bs = 2, 13, 2 * tp  # 26-byte rows: vector and scalar paths
    with DpSamplingComm(
        tp_size=tp,
        rank=rank,
        group=group,
        max_pad_bs=4 * tp,
        num_tokens_per_req=n,
        vocab_size=vs * tp,
        logits_dtype="float16",
        backend="onesided",
        device=0,
        timeout_s=60,
    ) as comm:
        for it in range(3):
            g = [torch.Generator().manual_seed(10 * it + s) for s in range(tp)]
            xs = [torch.randn(pad_bs * n, vs, generator=g[s]).half() for s in range(tp)]
            r = pad_bs // tp
            p = torch.arange(r * n, dtype=torch.int32).reshape(r, n) + 100 * rank
            # every rank allocates and copies its inputs before any rank issues an op
            # (see ipc_dpsample.testing.run_threads)
            x_d, p_d, a_d = xs[rank].cuda(), p.cuda(), (p + 7).cuda()
            ln_d, lp_d = torch.full((r,), rank, dtype=torch.int32).cuda(), p.float().cuda()
            stream.synchronize()
            group.barrier(timeout_s=60, what="inputs ready")
            y = comm.swap_batch_vocab(x_d, pad_bs=pad_bs)
            outs = comm.gather_verify_outputs(p_d, a_d, ln_d, pad_bs=pad_bs)
            lp = comm.gather_verify_logprobs(lp_d, pad_bs=pad_bs)
            group.barrier(timeout_s=60, what="launched")
            stream.synchronize()
            comm.check()
            rows = r * n
            ref = torch.cat([x[rank * rows : (rank + 1) * rows] for x in xs], dim=1)
            assert torch.equal(y.cpu(), ref)
            assert outs[0].shape == (pad_bs, n) and lp.shape == (pad_bs, n)
            assert torch.equal(
                outs[2].cpu(), torch.arange(tp, dtype=torch.int32).repeat_interleave(r)
            )
            group.barrier(timeout_s=60, what="round")
    return True


if __name__ == "__main__":
    tp = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    assert all(run_threads(tp, body, timeout_s=600))
    print(f"sanitize_smoke tp={tp}: OK")

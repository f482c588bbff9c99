#!/usr/bin/env python3
"""A short in-process run of every one-sided kernel path (eager, then captured in a
CUDA graph and replayed with new inputs), for compute-sanitizer:
``compute-sanitizer --tool memcheck python3 scripts/sanitize_smoke.py [tp]``.
Exits non-zero if any output differs from the reference."""

from __future__ import annotations

import os
import sys
import threading

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import torch

from ipc_dpsample import DpSamplingComm
from ipc_dpsample.testing import run_threads

_CAPTURE_LOCK = threading.Lock()  # one stream capture at a time in this process


def _issue(comm, ins, pad_bs):
    x_d, p_d, a_d, ln_d, lp_d = ins
    return (
        comm.swap_batch_vocab(x_d, pad_bs=pad_bs),
        comm.gather_verify_outputs(p_d, a_d, ln_d, pad_bs=pad_bs),
        comm.gather_verify_logprobs(lp_d, pad_bs=pad_bs),
    )


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
        r, rows = pad_bs // tp, pad_bs // tp * n
        graph, lock = None, _CAPTURE_LOCK
        for it in range(5):  # 0-2 eager; 3 captures a CUDA graph, 3-4 replay it
            g = [torch.Generator().manual_seed(10 * it + s) for s in range(tp)]
            xs = [torch.randn(pad_bs * n, vs, generator=g[s]).half() for s in range(tp)]
            ps = [
                torch.arange(r * n, dtype=torch.int32).reshape(r, n) + 100 * s + it
                for s in range(tp)
            ]
            # every rank allocates and copies its inputs before any rank issues an op
            # (see ipc_dpsample.testing.run_threads)
            if graph is None:
                x_d, p_d, a_d = xs[rank].cuda(), ps[rank].cuda(), (ps[rank] + 7).cuda()
                ln_d = torch.full((r,), rank + it, dtype=torch.int32).cuda()
                lp_d = ps[rank].float().cuda()
            else:  # new values in the captured input buffers
                x_d.copy_(xs[rank].cuda())
                p_d.copy_(ps[rank].cuda())
                a_d.copy_((ps[rank] + 7).cuda())
                ln_d.fill_(rank + it)
                lp_d.copy_(ps[rank].float().cuda())
            stream.synchronize()
            group.barrier(timeout_s=60, what="inputs ready")

            ins = (x_d, p_d, a_d, ln_d, lp_d)
            if it < 3:
                y, outs, lp = _issue(comm, ins, pad_bs)
            elif graph is None:  # capture (nothing runs), then replay below
                graph = torch.cuda.CUDAGraph()
                with (
                    lock,
                    torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"),
                ):
                    y, outs, lp = _issue(comm, ins, pad_bs)
                group.barrier(timeout_s=60, what="captured")
            if graph is not None:
                graph.replay()
            group.barrier(timeout_s=60, what="launched")
            stream.synchronize()
            comm.check()
            ref = torch.cat([x[rank * rows : (rank + 1) * rows] for x in xs], dim=1)
            assert torch.equal(y.cpu(), ref), f"swap differs (round {it})"
            want_p = torch.cat(ps)
            assert torch.equal(outs[0].cpu(), want_p), f"predict differs (round {it})"
            assert torch.equal(outs[1].cpu(), want_p + 7), f"accept_index differs (round {it})"
            want_len = (torch.arange(tp, dtype=torch.int32) + it).repeat_interleave(r)
            assert torch.equal(outs[2].cpu(), want_len), f"accept_length differs (round {it})"
            assert torch.equal(lp.cpu(), want_p.float()), f"logprobs differ (round {it})"
            group.barrier(timeout_s=60, what="round")
        del graph
    return True


if __name__ == "__main__":
    tp = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    assert all(run_threads(tp, body, timeout_s=600))
    print(f"sanitize_smoke tp={tp}: OK")

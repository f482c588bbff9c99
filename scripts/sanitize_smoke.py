#!/usr/bin/env python3
"""A short in-process run of every one-sided kernel path (eager, then captured in a
CUDA graph and replayed with new inputs), all four ops, every padded request real
and only a prefix real (a host ``bs`` eagerly, a device ``bs`` rewritten before each
replay), for compute-sanitizer:
``compute-sanitizer --tool memcheck python3 scripts/sanitize_smoke.py [tp]``.
Exits non-zero if any output differs from the reference."""

from __future__ import annotations

import os
import sys
import threading

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import torch

from ipc_dpsample import DpSamplingComm
from ipc_dpsample.layout import real_reqs
from ipc_dpsample.testing import run_threads

_CAPTURE_LOCK = threading.Lock()  # one stream capture at a time in this process


def _issue(comm, ins, pad_bs, bs):
    x_d, p_d, a_d, ln_d, lp_d = ins
    return (
        comm.swap_batch_vocab(x_d, pad_bs=pad_bs, bs=bs),
        comm.gather_verify_outputs(p_d, a_d, ln_d, pad_bs=pad_bs, bs=bs),
        comm.gather_verify_logprobs(lp_d, pad_bs=pad_bs, bs=bs),
        comm.argmax_batch_vocab(x_d, pad_bs=pad_bs, bs=bs),
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
        r = pad_bs // tp
        graph, lock = None, _CAPTURE_LOCK
        bs_d = torch.zeros(1, dtype=torch.int32, device="cuda")
        # 0-2 eager (every request real, then host bs); 3 captures a CUDA graph with a
        # device bs, 3-5 replay it with a new bs written into that tensor each time
        plan = [None, pad_bs - 1, 1, pad_bs, r + 1, 0]
        for it, bs in enumerate(plan):
            g = [torch.Generator().manual_seed(10 * it + s) for s in range(tp)]
            xs = [torch.randn(pad_bs * n, vs, generator=g[s]).half() for s in range(tp)]
            ps = [
                torch.arange(r * n, dtype=torch.int32).reshape(r, n) + 100 * s + it
                for s in range(tp)
            ]
            # every rank allocates and copies its inputs before any rank issues an op
            # (see ipc_dpsample.testing.run_threads)
            if it < 3:
                x_d, p_d, a_d = xs[rank].cuda(), ps[rank].cuda(), (ps[rank] + 7).cuda()
                ln_d = torch.full((r,), rank + it, dtype=torch.int32).cuda()
                lp_d = ps[rank].float().cuda()
            else:  # new values in the captured input buffers
                x_d.copy_(xs[rank].cuda())
                p_d.copy_(ps[rank].cuda())
                a_d.copy_((ps[rank] + 7).cuda())
                ln_d.fill_(rank + it)
                lp_d.copy_(ps[rank].float().cuda())
                bs_d.fill_(bs)
            stream.synchronize()
            group.barrier(timeout_s=60, what="inputs ready")

            ins = (x_d, p_d, a_d, ln_d, lp_d)
            if it < 3:
                outs = _issue(comm, ins, pad_bs, bs)
            elif graph is None:  # capture (nothing runs), then replay below
                graph = torch.cuda.CUDAGraph()
                with (
                    lock,
                    torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"),
                ):
                    outs = _issue(comm, ins, pad_bs, bs_d)
                group.barrier(timeout_s=60, what="captured")
            if graph is not None:
                graph.replay()
            group.barrier(timeout_s=60, what="launched")
            stream.synchronize()
            comm.check()
            _check(outs, xs, ps, rank=rank, tp=tp, n=n, pad_bs=pad_bs, bs=bs, it=it)
            group.barrier(timeout_s=60, what="round")
        del graph
    return True


def _check(outs, xs, ps, *, rank, tp, n, pad_bs, bs, it) -> None:
    """Real rows equal the reference (that phantom rows stay unwritten is checked with
    poisoned buffers by tests/test_onesided_bs_argmax_gpu.py)."""
    r, rows = pad_bs // tp, pad_bs // tp * n
    real = pad_bs if bs is None else bs  # real requests of the whole batch
    mine = real_reqs(r, bs, rank) * n  # real rows of this rank's swap output
    y, (p, a, ln), lp, (tok, alp) = outs
    y, p, a, ln, lp, tok, alp = (t.cpu() for t in (y, p, a, ln, lp, tok, alp))
    ref = torch.cat([x[rank * rows : (rank + 1) * rows] for x in xs], dim=1)
    where = f"(round {it}, bs={bs})"
    assert torch.equal(y[:mine], ref[:mine]), f"swap differs {where}"
    full = ref[:mine].float()
    assert torch.equal(tok[:mine], full.argmax(dim=1).int()), f"argmax differs {where}"
    want_lp = torch.log_softmax(full, dim=1).gather(1, full.argmax(dim=1, keepdim=True))[:, 0]
    assert torch.allclose(alp[:mine], want_lp, rtol=1e-5, atol=1e-5), f"argmax lp {where}"
    want_p = torch.cat(ps)
    want_len = (torch.arange(tp, dtype=torch.int32) + it).repeat_interleave(r)
    for name, got, want in (
        ("predict", p, want_p),
        ("accept_index", a, want_p + 7),
        ("accept_length", ln, want_len),
        ("logprobs", lp, want_p.float()),
    ):
        assert torch.equal(got[:real], want[:real]), f"{name} differs {where}"


if __name__ == "__main__":
    tp = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    assert all(run_threads(tp, body, timeout_s=600))
    print(f"sanitize_smoke tp={tp}: OK")

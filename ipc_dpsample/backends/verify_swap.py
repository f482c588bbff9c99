"""``verify_batch_vocab`` by moving the logits: the GPU backends' path for the batches
their verify kernels cannot decide (:func:`ipc_dpsample.backends.verify_plan.
kernel_path_refusal`: a request with top-p or min-p but no top-k).

TokenSpeed's own Batch-DP route, on the backend's own ops: ``swap_batch_vocab`` gives the
rank its requests' full rows, the package's torch sampler
(:func:`ipc_dpsample.sampling.verify_rows`, bit for bit the reference) verifies them, and
``gather_verify_outputs`` / ``gather_verify_logprobs`` give every rank the whole batch.
Exact, but it moves ``V / tp * itemsize`` bytes per row per peer and reads the
parameters on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..arrays import ArrayInfo, as_torch, describe, resolve_stream, torch_view
from ..layout import VerifyParams
from .base import Backend, RealRows

__all__ = ["verify_by_swap"]


def verify_by_swap(
    backend: Backend,
    x: Any,
    info: ArrayInfo,
    candidates: Any,
    candidates_info: ArrayInfo,
    *,
    pad_bs: int,
    params: VerifyParams,
    return_logprobs: bool,
    bs: RealRows,
    stream: Any,
    tp: int,
    rank: int,
    device: int,
    before_gather: Callable[[], None] | None = None,
) -> tuple[Any, ...]:
    """Swap, sample the rank's rows with :func:`~ipc_dpsample.sampling.verify_rows`,
    gather: what ``verify_batch_vocab`` returns, as views in ``x``'s array type.

    ``before_gather``, when given, runs on the host after the sampler is issued and
    before the gathers: the one-sided backend passes a barrier of its rank threads
    there. The sampler allocates device memory (torch's caching allocator, the first
    time a shape is seen), and CUDA orders work issued after an allocation behind the
    kernels already running in other streams of the device; a peer thread's gather,
    spinning for this rank's gather, would then hold it back until the timeout. With
    every rank past its sampler before any gather is issued, nothing issued after an
    allocation is waited for by a kernel already running."""
    import torch

    from ..sampling import verify_rows

    rows = backend.swap_batch_vocab(x, info, pad_bs=pad_bs, bs=bs, stream=stream)
    handle = resolve_stream(info.kind, stream, device)
    r = pad_bs // tp
    mine = min(max(params.bs - rank * r, 0), r)
    own = slice(rank * r, (rank + 1) * r)
    dev = torch.device("cuda", device)
    # the op's stream as a torch stream: torch's own current one when it is that
    # stream (also the legacy default stream, handle 0), else a wrapper of the handle
    current = torch.cuda.current_stream(dev)
    op_stream = (
        current if current.cuda_stream == handle else torch.cuda.ExternalStream(handle, device=dev)
    )
    with torch.cuda.device(dev), torch.cuda.stream(op_stream):

        def per_req(a: Any) -> Any:
            return torch.from_numpy(a[own].copy()).to(dev, non_blocking=False)

        outs = verify_rows(
            as_torch(rows, info.kind),
            as_torch(candidates, candidates_info.kind)[own],
            temperature=per_req(params.temperature),
            seed=per_req(params.seed),
            offset=per_req(params.offset),
            top_k=per_req(params.top_k.astype("int32")),
            top_p=per_req(params.top_p),
            min_p=per_req(params.min_p),
            reqs_per_rank=r,
            vocab_limit=params.vocab_limit,
            bs=mine,
            return_logprobs=return_logprobs,
        )
    # torch allocated the local results on the op's stream: its caching allocator reuses
    # their memory only in that stream's order, i.e. after the gathers read them
    local = [torch_view(info.kind, t.contiguous()) for t in outs]
    if before_gather is not None:
        before_gather()
    linfo = describe(local[0], "predict")
    gathered = backend.gather_verify_outputs(
        local[0], local[1], local[2], linfo, pad_bs=pad_bs, bs=bs, stream=stream
    )
    if not return_logprobs:
        return gathered
    lp = backend.gather_verify_logprobs(
        local[3], describe(local[3], "logprobs"), pad_bs=pad_bs, bs=bs, stream=stream
    )
    return (*gathered, lp)

"""``verify_batch_vocab`` on the NCCL backend, on real GPUs: the case matrix of
``tests/test_verify_onesided_gpu.py`` (every mode, the special rows, ``bs`` as a host int
and a device scalar, ``vocab_limit``, torch and CuPy arrays; top-p / min-p without top-k
through the swap path) against :func:`ipc_dpsample.layout.reference_verify_batch_vocab`,
outputs poisoned before each call. tp = 1 runs on one GPU (the records go straight to
the combine; then once more with the own block routed through NCCL self send/recv);
tp = 2 and 4 run one process per GPU, and there ranks that pass another temperature or
another candidate must raise on every rank. Run:

    PYTHONPATH=$PWD python3 -m pytest tests/test_nccl_verify_gpu.py -v -rs
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from _gpu_common import gpu_skip_reason
from test_verify_onesided_gpu import _cases, gpu_case, warm_sampler

from ipc_dpsample import DpSampleError, DpSamplingComm, ThreadGroup
from ipc_dpsample.identity import nccl_available
from ipc_dpsample.testing import run_ranks

_REASON = gpu_skip_reason() or (None if nccl_available() else "needs cupy.cuda.nccl (libnccl)")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def _device(rank: int) -> int:
    import cupy
    import torch

    dev = int(os.environ.get("LOCAL_RANK", rank)) % cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(dev).use()
    torch.cuda.set_device(dev)
    return dev


def _nccl_comm(group: Any, rank: int, tp: int, dev: int, **kw: Any) -> DpSamplingComm:
    return DpSamplingComm(
        tp_size=tp, rank=rank, group=group, backend="nccl", device=dev, timeout_s=60.0, **kw
    )


def _nccl_cases(tp: int, dtype: str) -> list[Any]:
    """The one-sided matrix less the swap-route calls with phantom requests: gpu_case
    requires their rows untouched, but the NCCL gathers move every row and the swap
    route's sampler writes phantom rows (the contract leaves them undefined)."""
    return [c for c in _cases(tp, dtype) if not (c.mode in ("min_p", "top_p") and c.bs)]


def matrix_body(rank: int, tp: int, group: Any) -> dict[str, int]:
    """Every case of every dtype; returns how many calls took each path."""
    import torch

    dev = _device(rank)
    paths: dict[str, int] = {}
    with torch.cuda.stream(torch.cuda.Stream()):
        for d, dtype in enumerate(("float32", "bfloat16", "float16")):
            n = (3, 1, 4)[d]
            warm_sampler(dtype, n, 250 * tp)
            with _nccl_comm(
                group, rank, tp, dev, max_pad_bs=4 * tp, num_tokens_per_req=n,
                vocab_size=250 * tp, logits_dtype=dtype,
            ) as comm:  # fmt: skip
                assert comm.backend == "nccl", comm.explain()
                for i, case in enumerate(_nccl_cases(tp, dtype)):
                    path = gpu_case(comm, rank, tp, (51, d, i), case).split(":")[0]
                    paths[path] = paths.get(path, 0) + 1
    return paths


def test_tp1_matches_the_reference() -> None:
    out = matrix_body(0, 1, ThreadGroup.create(1)[0])
    assert out["kernels"] >= 15 and out["swap"] >= 3, out


def test_tp1_own_block_through_nccl_self_send_recv() -> None:
    """route_self_through_nccl: the records travel to this rank through NCCL into the
    receive buffer instead of being combined in place."""
    import torch

    from ipc_dpsample.backends.nccl import NcclBackend

    dev = _device(0)
    comm = _nccl_comm(ThreadGroup.create(1)[0], 0, 1, dev, max_pad_bs=8, num_tokens_per_req=3,
                      vocab_size=250, logits_dtype="bfloat16")  # fmt: skip
    try:
        comm._backend.close()
        comm._backend = NcclBackend(comm.config, comm._group, dev, route_self_through_nccl=True)
        with torch.cuda.stream(torch.cuda.Stream()):
            kernel_modes = ("greedy", "temperature", "top_k", "top_k_top_p")
            cases = [c for c in _nccl_cases(1, "bfloat16") if c.mode in kernel_modes]
            for i, case in enumerate(cases):
                assert gpu_case(comm, 0, 1, (52, i), case) == "kernels"
    finally:
        comm.close()


def _run(world: int, body: Any, *args: Any) -> list[Any]:
    reason = gpu_skip_reason(world)
    if reason is not None:
        pytest.skip(reason)
    return run_ranks(world, body, *args, timeout_s=600.0)


@pytest.mark.multirank
@pytest.mark.parametrize("tp", [2, 4])
def test_multirank_matches_the_reference(tp: int) -> None:
    out = _run(tp, matrix_body)
    assert all(o["kernels"] >= 15 and o["swap"] >= 3 for o in out), out


def mismatch_body(rank: int, tp: int, group: Any, what: str) -> str:
    import torch

    dev = _device(rank)
    pad_bs, v = 2 * tp, 64 * tp
    with _nccl_comm(
        group, rank, tp, dev, max_pad_bs=pad_bs, num_tokens_per_req=2, vocab_size=v,
        logits_dtype="float32",
    ) as comm:  # fmt: skip
        x = torch.randn(pad_bs * 2, v // tp, device="cuda")
        cand = torch.zeros((pad_bs, 2), dtype=torch.int32, device="cuda")
        temperature = np.full(pad_bs, 0.7, np.float32)
        if rank == tp - 1:
            if what == "temperature":
                temperature[0] = 0.9
            else:  # a row of rank 0's: only rank 0's combine sees it, the others the mark
                cand[0, 1] = 5
        kw = dict(temperature=temperature, seed=np.arange(pad_bs), offset=np.arange(pad_bs))
        comm.verify_batch_vocab(x, cand, pad_bs=pad_bs, **kw)
        torch.cuda.synchronize()
        with pytest.raises(DpSampleError) as info:
            comm.check()
        return str(info.value)


@pytest.mark.multirank
@pytest.mark.parametrize("what", ["temperature", "candidates"])
def test_multirank_different_arguments_raise_on_every_rank(what: str) -> None:
    msgs = _run(2, mismatch_body, what)
    for msg in msgs:
        assert "verify_batch_vocab arguments" in msg and "call sequences diverged" in msg, msg

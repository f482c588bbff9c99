"""TokenSpeed drop-in behaviour (issue 16), on CPU ranks over gloo: the lazy dtype,
prepare_verify_outputs' first-dtype-wins rule, gather-only communicators, the
``fallback_comm_backend`` object (one call of it per op), and the free function
``swap_batch_vocab``. Runs self-spawned (the three bodies one after another on one
spawned world of two ranks, :mod:`_shared_world`), under torchrun and under mpirun."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from _shared_world import SharedWorlds

from ipc_dpsample import DpSamplingComm, DtypeMismatchError, swap_batch_vocab
from ipc_dpsample.layout import reference_gather, reference_swap_batch_vocab

pytestmark = pytest.mark.multirank


def _bits(t: torch.Tensor) -> np.ndarray:
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.view(torch.int16).numpy()
    return t.view(torch.int32).numpy() if t.dtype == torch.float32 else t.numpy()


def _inputs(seed: int, tp: int, pad_bs: int, n: int, vs: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tp, pad_bs * n, vs, generator=g) * 7).to(dtype)


class CountingCollectives:
    """TokenSpeed's CommBackend shape over torch.distributed, counting its calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def all_gather_into_tensor(self, output: Any, input: Any, group: Any) -> None:
        import torch.distributed as dist

        self.calls.append("all_gather_into_tensor")
        dist.all_gather_into_tensor(output, input, group=group)

    def all_to_all_single(self, output: Any, input: Any, group: Any) -> None:
        import torch.distributed as dist

        self.calls.append("all_to_all_single")
        dist.all_to_all_single(output, input, group=group)


def _comm(rank: int, tp: int, group: Any, **kw: Any) -> DpSamplingComm:
    args: dict[str, Any] = dict(
        tp_size=tp, rank=rank, group=group, max_pad_bs=4 * tp, num_tokens_per_req=2,
        vocab_size=6 * tp, device="cpu", timeout_s=20.0,
    )  # fmt: skip
    args.update(kw)
    return DpSamplingComm(**args)


def lazy_dtype_body(rank: int, tp: int, group: Any) -> bool:
    pad_bs, n, vs = 2 * tp, 2, 6
    for dtype in (torch.bfloat16, torch.float32):
        with _comm(rank, tp, group, logits_dtype=None) as comm:
            assert comm.logits_dtype is None and comm.backend == "torch"
            xs = _inputs(3, tp, pad_bs, n, vs, dtype)
            y = comm.swap_batch_vocab(xs[rank].clone(), pad_bs=pad_bs)
            ref = reference_swap_batch_vocab(
                [_bits(x) for x in xs], tp=tp, num_tokens_per_req=n, pad_bs=pad_bs
            )[rank]
            np.testing.assert_array_equal(_bits(y), ref)
            name = str(dtype).removeprefix("torch.")
            assert comm.logits_dtype == name
            comm.prepare_verify_outputs(torch.float16)  # after a swap: a no-op
            assert comm.logits_dtype == name
            other = torch.float16
            with pytest.raises(DtypeMismatchError, match=f"float16 != .*{name}"):
                comm.swap_batch_vocab(xs[rank].to(other), pad_bs=pad_bs)
            assert isinstance(DtypeMismatchError("x"), RuntimeError)
    # a gather-only communicator: prepare, then gathers, no swap ever
    with _comm(rank, tp, group, logits_dtype=None) as comm:
        comm.prepare_verify_outputs(torch.float32)
        r = pad_bs // tp
        lps = [torch.randn(r, n, generator=torch.Generator().manual_seed(s)) for s in range(tp)]
        out = comm.gather_verify_logprobs(lps[rank].t().contiguous().t(), pad_bs=pad_bs)
        np.testing.assert_array_equal(out.numpy(), reference_gather([x.numpy() for x in lps]))
    return True


def test_lazy_dtype_prepare_and_gather_only_comms() -> None:
    assert WORLDS.results(2, "lazy_dtype") in ([True, True], [True])


def fallback_body(rank: int, tp: int, group: Any) -> list[str]:
    coll = CountingCollectives()
    pad_bs, n, vs = 2 * tp, 2, 6
    r = pad_bs // tp
    with _comm(rank, tp, group, logits_dtype=None, fallback_comm_backend=coll) as comm:
        assert comm.backend == "torch" and "fallback_comm_backend" in comm.explain()
        assert not comm.is_initialized and comm.is_open
        xs = _inputs(5, tp, pad_bs, n, vs, torch.bfloat16)
        before = len(coll.calls)
        y = comm.swap_batch_vocab(xs[rank].clone(), pad_bs=pad_bs)
        assert coll.calls[before:] == ["all_to_all_single"]
        ref = reference_swap_batch_vocab(
            [_bits(x) for x in xs], tp=tp, num_tokens_per_req=n, pad_bs=pad_bs
        )[rank]
        np.testing.assert_array_equal(_bits(y), ref)
        g = torch.Generator().manual_seed(9)
        p = torch.randint(-9, 9, (tp, r, n), generator=g, dtype=torch.int32)
        a = torch.randint(-9, 9, (tp, r, n), generator=g, dtype=torch.int32)
        ln = torch.randint(0, 9, (tp, r), generator=g, dtype=torch.int32)
        before = len(coll.calls)
        outs = comm.gather_verify_outputs(p[rank], a[rank], ln[rank], pad_bs=pad_bs)
        assert coll.calls[before:] == ["all_gather_into_tensor"]  # exactly one call
        for got, full in zip(outs, (p, a, ln), strict=True):
            np.testing.assert_array_equal(got.numpy(), reference_gather(list(full.numpy())))
        before = len(coll.calls)
        lp = torch.randn(tp, r, n, generator=g)
        out = comm.gather_verify_logprobs(lp[rank], pad_bs=pad_bs)
        assert coll.calls[before:] == ["all_gather_into_tensor"]
        np.testing.assert_array_equal(out.numpy(), lp.reshape(pad_bs, n).numpy())
        ids, _ = comm.argmax_batch_vocab(xs[rank].clone(), pad_bs=pad_bs)
        full = xs.permute(1, 0, 2).reshape(pad_bs * n, tp * vs)[rank * r * n : (rank + 1) * r * n]
        np.testing.assert_array_equal(ids.numpy(), torch.argmax(full.float(), 1).numpy())
        # ranks that call different ops raise on every rank (headers in the blocks)
        before = len(coll.calls)
        with pytest.raises(Exception, match="call sequences diverged"):
            if rank == 0:
                comm.gather_verify_logprobs(lp[rank], pad_bs=pad_bs)
            else:
                comm.gather_verify_outputs(p[rank], a[rank], ln[rank], pad_bs=pad_bs)
    return coll.calls


def test_fallback_comm_backend_moves_every_op_in_one_call() -> None:
    for calls in WORLDS.results(2, "fallback"):
        assert calls.count("all_gather_into_tensor") == 3 and calls.count("all_to_all_single") == 2


def free_function_body(rank: int, tp: int, group: Any) -> bool:
    assert group is None, "runs on a world of tp ranks (the default group)"
    for dtype in (torch.float32, torch.bfloat16):
        for n in (1, 4):
            pad_bs, vs = 2 * tp, 5
            xs = _inputs(11 * n, tp, pad_bs, n, vs, dtype)
            for backend in (None, CountingCollectives()):
                y = swap_batch_vocab(
                    xs[rank].clone(), tp_size=tp, pad_bs=pad_bs, num_tokens_per_req=n,
                    vocab_size=vs * tp, group=None,
                    rank=rank, backend=backend,
                )  # fmt: skip
                ref = reference_swap_batch_vocab(
                    [_bits(x) for x in xs], tp=tp, num_tokens_per_req=n, pad_bs=pad_bs
                )[rank]
                assert y.dtype == dtype and tuple(y.shape) == ref.shape
                np.testing.assert_array_equal(_bits(y), ref)
    with pytest.raises(ValueError, match=r"local_logits shape \(3, 5\) != expected"):
        swap_batch_vocab(
            torch.zeros(3, 5), tp_size=tp, pad_bs=2 * tp, num_tokens_per_req=1,
            vocab_size=5 * tp, group=None,
        )  # fmt: skip
    return True


def test_free_function_swap_batch_vocab_matches_the_reference() -> None:
    assert all(WORLDS.results(2, "free_function"))


#: The bodies above, in file order, on one world of two ranks.
WORLDS = SharedWorlds(
    {
        2: [
            ("lazy_dtype", lazy_dtype_body, ()),
            ("fallback", fallback_body, ()),
            ("free_function", free_function_body, ()),
        ]
    }
)

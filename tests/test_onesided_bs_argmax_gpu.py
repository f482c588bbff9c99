"""Real rows (``bs``) and ``argmax_batch_vocab`` on the one-sided backend, on a real GPU:
ranks as threads of this process (one stream each) and as processes sharing the GPU
through CUDA IPC.

Every result is compared with the NumPy reference on fresh random data; outputs
are poisoned (0xFF bytes) before each op, and the rows of phantom requests must
still hold the poison afterwards (the one-sided kernels neither read nor write
them).
"""

from __future__ import annotations

import os

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import random
import threading

import numpy as np
import pytest
from _gpu_common import (
    all_inputs,
    all_verify,
    argmax_inputs,
    bits,
    gpu_skip_reason,
    onesided_comm,
    reference_argmax,
    swap_reference_torch,
)

from ipc_dpsample import DpSampleError
from ipc_dpsample.layout import real_reqs
from ipc_dpsample.testing import run_ranks, run_threads

_REASON = gpu_skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]
POISON32 = -1  # 0xFFFFFFFF as int32; as float32 a NaN with all bits set
_CAPTURE_LOCK = threading.Lock()


_comm = onesided_comm


def _settle(group, what):
    import torch

    torch.cuda.current_stream().synchronize()
    group.barrier(timeout_s=60, what=what)


def _poison(comm, group):
    _settle(group, "before poison")
    comm._backend.poison_for_testing()
    group.barrier(timeout_s=60, what="poisoned")


def _bs_values(rng, pad_bs, tp):
    r = pad_bs // tp
    picks = {0, 1, pad_bs, rng.randint(0, pad_bs)}
    if tp > 1:
        picks.add(r)  # only rank 0 has real requests
        picks.add(r * (tp - 1) + 1)  # the last rank has one
    return sorted(picks)


def _check_ops(comm, group, rank, tp, pad_bs, n, vs, dtype, seed, bs, device_bs):
    """Swap, both gathers and argmax at ``bs``; real rows against the reference,
    phantom rows still poisoned."""
    import torch

    r = pad_bs // tp
    mine = real_reqs(r, bs, rank)
    bs_arg = torch.tensor([bs], dtype=torch.int32, device="cuda") if device_bs else bs
    xs = all_inputs(seed, tp, pad_bs, n, vs, dtype)
    x = xs[rank].cuda()
    p, a, ln, lp = all_verify(seed + 1, tp, pad_bs, n)
    verify_in = (p[rank].cuda(), a[rank].cuda(), ln[rank].cuda())
    lp_in = lp[rank].cuda()
    limit = tp * vs - (vs // 3)
    ax = argmax_inputs(seed + 2, tp, pad_bs, n, vs, dtype, limit)
    ax_in = ax[rank].cuda()

    _poison(comm, group)
    y = comm.swap_batch_vocab(x, pad_bs=pad_bs, bs=bs_arg)
    _settle(group, "swap")
    comm.check()
    ref = swap_reference_torch(xs, rank, tp, pad_bs, n)
    got = bits(y)
    np.testing.assert_array_equal(got[: mine * n], bits(ref)[: mine * n])
    assert (got[mine * n :] == -1).all(), "a phantom swap row was written"

    _poison(comm, group)
    outs = comm.gather_verify_outputs(*verify_in, pad_bs=pad_bs, bs=bs_arg)
    _settle(group, "gather")
    comm.check()
    for o, full in zip(outs, (p, a, ln), strict=True):
        o = o.cpu().numpy()
        want = full.reshape(pad_bs, *full.shape[2:]).numpy()
        np.testing.assert_array_equal(o[:bs], want[:bs])
        assert (o[bs:] == POISON32).all(), "a phantom gathered row was written"

    _poison(comm, group)
    olp = comm.gather_verify_logprobs(lp_in, pad_bs=pad_bs, bs=bs_arg)
    _settle(group, "logprobs")
    comm.check()
    got = bits(olp)
    np.testing.assert_array_equal(got[:bs], bits(lp.reshape(-1, n))[:bs])
    assert (got[bs:] == POISON32).all()

    _poison(comm, group)
    ids, lps = comm.argmax_batch_vocab(ax_in, pad_bs=pad_bs, vocab_limit=limit, bs=bs_arg)
    _settle(group, "argmax")
    comm.check()
    ref_ids, ref_lps = reference_argmax(ax, tp, pad_bs, n, dtype, limit)[rank]
    ids, lps = ids.cpu().numpy(), lps.cpu().numpy()
    np.testing.assert_array_equal(ids[: mine * n], ref_ids[: mine * n])
    np.testing.assert_allclose(lps[: mine * n], ref_lps[: mine * n], atol=1e-5, equal_nan=True)
    assert (ids[mine * n :] == POISON32).all(), "a phantom argmax row was written"


def _bs_matrix_body(rank, tp, group):
    import torch

    torch.cuda.set_device(0)
    rng = random.Random(99)  # the same draws on every rank
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for dtype, n, vs in (("bfloat16", 4, 40), ("float16", 1, 13), ("float32", 3, 517)):
            with _comm(
                group,
                rank,
                tp,
                max_pad_bs=4 * tp,
                num_tokens_per_req=n,
                vocab_size=vs * tp,
                logits_dtype=dtype,
            ) as comm:
                pad_bs = 4 * tp
                for k, bs in enumerate(_bs_values(rng, pad_bs, tp)):
                    for device_bs in (False, True):
                        seed = 1000 * k + 7 * device_bs
                        _check_ops(comm, group, rank, tp, pad_bs, n, vs, dtype, seed, bs, device_bs)
    return True


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
def test_real_rows_and_argmax_match_the_reference_and_leave_phantom_rows_alone(tp):
    assert all(run_threads(tp, _bs_matrix_body, timeout_s=600))


def _graph_body(rank, tp, group, replays):
    """Swap, gathers and argmax captured once with a device ``bs``; every replay
    writes a new ``bs`` and new inputs (with kernels: no same-device copy while a
    peer may be in flight) and checks every real row."""
    import torch

    torch.cuda.set_device(0)
    n, vs, pad_bs, dtype = 2, 48, 4 * tp, "bfloat16"
    r, limit = pad_bs // tp, tp * 48 - 5
    rng = random.Random(5)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        comm = _comm(
            group, rank, tp, max_pad_bs=pad_bs, num_tokens_per_req=n, vocab_size=vs * tp,
            logits_dtype=dtype,
        )  # fmt: skip
        bs_dev = torch.full((1,), pad_bs, dtype=torch.int32, device="cuda")
        plans = []
        for i in range(replays + 1):
            xs = all_inputs(31 * i, tp, pad_bs, n, vs, dtype)
            p, a, ln, lp = all_verify(31 * i + 1, tp, pad_bs, n)
            ax = argmax_inputs(31 * i + 2, tp, pad_bs, n, vs, dtype, limit)
            bs = pad_bs if i == 0 else rng.randint(0, pad_bs)
            dev = [t[rank].cuda() for t in (xs, p, a, ln, lp, ax)]
            plans.append((bs, xs, p, a, ln, lp, ax, dev, torch.tensor([bs], dtype=torch.int32)))
        static = [t.clone() for t in plans[0][7]]
        bs_src = [pl[8].cuda() for pl in plans]
        # warm up eagerly (loads every kernel), then capture all four ops
        for t in [*static, bs_dev]:
            torch.mul(t, 1, out=t)
        _settle(group, "warm-up inputs")
        comm.swap_batch_vocab(static[0], pad_bs=pad_bs, bs=bs_dev)
        comm.gather_verify_outputs(*static[1:4], pad_bs=pad_bs, bs=bs_dev)
        comm.gather_verify_logprobs(static[4], pad_bs=pad_bs, bs=bs_dev)
        comm.argmax_batch_vocab(static[5], pad_bs=pad_bs, vocab_limit=limit, bs=bs_dev)
        group.barrier(timeout_s=60, what="warm-up issued")
        _settle(group, "warm-up done")
        graph = torch.cuda.CUDAGraph()
        with (
            _CAPTURE_LOCK,  # one rank captures at a time (capture runs nothing)
            torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"),
        ):
            y = comm.swap_batch_vocab(static[0], pad_bs=pad_bs, bs=bs_dev)
            outs = comm.gather_verify_outputs(*static[1:4], pad_bs=pad_bs, bs=bs_dev)
            olp = comm.gather_verify_logprobs(static[4], pad_bs=pad_bs, bs=bs_dev)
            ids, lps = comm.argmax_batch_vocab(
                static[5], pad_bs=pad_bs, vocab_limit=limit, bs=bs_dev
            )
        _settle(group, "captured")
        failures = []
        for i in range(1, replays + 1):
            bs, xs, p, a, ln, lp, ax, dev, _ = plans[i]
            for s, d in zip(static, dev, strict=True):
                torch.mul(d, 1, out=s)
            torch.mul(bs_src[i], 1, out=bs_dev)
            _settle(group, f"inputs of replay {i}")
            graph.replay()
            group.barrier(timeout_s=60, what=f"replay {i} issued")
            _settle(group, f"replay {i} done")
            comm.check()
            mine = real_reqs(r, bs, rank)
            ref = swap_reference_torch(xs, rank, tp, pad_bs, n)
            got = {
                "swap": (bits(y)[: mine * n], bits(ref)[: mine * n]),
                "predict": (outs[0].cpu().numpy()[:bs], p.reshape(pad_bs, n).numpy()[:bs]),
                "accept": (outs[1].cpu().numpy()[:bs], a.reshape(pad_bs, n).numpy()[:bs]),
                "length": (outs[2].cpu().numpy()[:bs], ln.reshape(pad_bs).numpy()[:bs]),
                "logprobs": (bits(olp)[:bs], bits(lp.reshape(-1, n))[:bs]),
            }
            ref_ids, ref_lps = reference_argmax(ax, tp, pad_bs, n, dtype, limit)[rank]
            got["ids"] = (ids.cpu().numpy()[: mine * n], ref_ids[: mine * n])
            for name, (g, w) in got.items():
                if not np.array_equal(g, w):
                    failures.append((i, bs, name))
            if not np.allclose(
                lps.cpu().numpy()[: mine * n], ref_lps[: mine * n], atol=1e-5, equal_nan=True
            ):
                failures.append((i, bs, "argmax logprobs"))
        group.barrier(timeout_s=60, what="before close")
        comm.close()
    return failures


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_graph_replayed_50_times_with_a_new_device_bs_each_time(tp):
    out = run_threads(tp, _graph_body, 50, timeout_s=600)
    assert out == [[]] * tp, out


def _bs_mismatch_body(rank, tp, group, device_bs):
    import time

    import torch

    torch.cuda.set_device(0)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        comm = _comm(
            group, rank, tp, max_pad_bs=2 * tp, num_tokens_per_req=2, vocab_size=8 * tp,
            logits_dtype="float32", timeout_s=2.0,
        )  # fmt: skip
        bs = 2 * tp - rank % 2  # ranks 0 and 1 differ
        bs_arg = torch.tensor([bs], dtype=torch.int32, device="cuda") if device_bs else bs
        x = torch.randn(2 * tp * 2, 8, device="cuda")
        _settle(group, "inputs ready")
        t0 = time.monotonic()
        comm.swap_batch_vocab(x, pad_bs=2 * tp, bs=bs_arg)
        group.barrier(timeout_s=60, what="launched")
        stream.synchronize()
        try:
            comm.check()
            result = None
        except DpSampleError as exc:
            result = (type(exc).__name__, str(exc), time.monotonic() - t0)
        group.barrier(timeout_s=60, what="before close")
        comm.close()
    return result


@pytest.mark.parametrize("device_bs", [False, True], ids=["host-int", "device-scalar"])
def test_ranks_passing_different_bs_raise_on_every_rank(device_bs):
    out = run_threads(2, _bs_mismatch_body, device_bs, timeout_s=120)
    for rank, res in enumerate(out):
        assert res is not None, f"rank {rank} did not raise"
        name, msg, elapsed = res
        assert name == "DpSampleError", msg
        assert "bs=" in msg and "call sequences diverged" in msg, msg
        assert elapsed < 2.0 + 1.5, f"rank {rank} took {elapsed:.1f} s: {msg}"


def _op_mismatch_body(rank, tp, group):
    import torch

    torch.cuda.set_device(0)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        comm = _comm(
            group, rank, tp, max_pad_bs=2 * tp, num_tokens_per_req=2, vocab_size=8 * tp,
            logits_dtype="float32", timeout_s=2.0,
        )  # fmt: skip
        x = torch.randn(2 * tp * 2, 8, device="cuda")
        _settle(group, "inputs ready")
        if rank == 0:
            comm.argmax_batch_vocab(x, pad_bs=2 * tp)
        else:
            comm.swap_batch_vocab(x, pad_bs=2 * tp)
        group.barrier(timeout_s=60, what="launched")
        stream.synchronize()
        try:
            comm.check()
            result = None
        except DpSampleError as exc:
            result = str(exc)
        group.barrier(timeout_s=60, what="before close")
        comm.close()
    return result


def test_argmax_on_one_rank_and_swap_on_another_raise_on_every_rank():
    out = run_threads(2, _op_mismatch_body, timeout_s=120)
    for rank, msg in enumerate(out):
        assert msg is not None, f"rank {rank} did not raise"
        assert "call sequences diverged" in msg or "did not take part" in msg, msg
    assert any("argmax_batch_vocab" in m and "swap_batch_vocab" in m for m in out), out


def _bad_bs_body(rank, tp, group):
    import torch

    torch.cuda.set_device(0)
    with _comm(
        group, rank, tp, max_pad_bs=4, num_tokens_per_req=2, vocab_size=8, logits_dtype="float32"
    ) as comm:
        x = torch.randn(8, 8, device="cuda")
        bad = [
            (-1, ValueError, r"bs=-1 out of range: expected 0 <= bs <= pad_bs=4"),
            (5, ValueError, r"bs=5 out of range"),
            (2.0, TypeError, r"bs=2\.0"),
            (torch.tensor([2], dtype=torch.int64, device="cuda"), TypeError, "int32"),
            (torch.tensor([2, 3], dtype=torch.int32, device="cuda"), ValueError, r"\(\) or \(1,\)"),
            (torch.tensor([2], dtype=torch.int32), ValueError, "cuda:0"),
        ]
        for value, exc, pattern in bad:
            with pytest.raises(exc, match=pattern):
                comm.swap_batch_vocab(x, pad_bs=4, bs=value)
            y = comm.swap_batch_vocab(x, pad_bs=4, bs=3)  # a valid call right after
            torch.cuda.synchronize()
            np.testing.assert_array_equal(bits(y)[:6], bits(x)[:6])
    return True


def test_bad_bs_raises_naming_the_expected_value_and_a_valid_call_works():
    assert run_threads(1, _bad_bs_body, timeout_s=120) == [True]


def _mp_argmax_body(rank, tp, group):
    import torch

    torch.cuda.set_device(0)
    n, vs, pad_bs = 4, 1000, 4 * tp
    with _comm(
        group, rank, tp, max_pad_bs=pad_bs, num_tokens_per_req=n, vocab_size=vs * tp,
        logits_dtype="bfloat16", backend="auto",
    ) as comm:  # fmt: skip
        assert comm.backend == "onesided", comm.explain()
        for it, bs in enumerate((pad_bs, pad_bs // 2 + 1, 0)):
            ax = argmax_inputs(77 + it, tp, pad_bs, n, vs, "bfloat16", vs * tp - 3)
            x = ax[rank].cuda()
            torch.cuda.synchronize()
            comm._group.barrier(timeout_s=60, what="inputs")
            ids, lps = comm.argmax_batch_vocab(x, pad_bs=pad_bs, vocab_limit=vs * tp - 3, bs=bs)
            torch.cuda.synchronize()
            comm.check()
            ref_ids, ref_lps = reference_argmax(ax, tp, pad_bs, n, "bfloat16", vs * tp - 3)[rank]
            k = real_reqs(pad_bs // tp, bs, rank) * n
            np.testing.assert_array_equal(ids.cpu().numpy()[:k], ref_ids[:k])
            np.testing.assert_allclose(
                lps.cpu().numpy()[:k], ref_lps[:k], atol=1e-5, equal_nan=True
            )
            comm._group.barrier(timeout_s=60, what="checked")
    return True


@pytest.mark.parametrize("tp", [2, 4])
def test_argmax_and_bs_across_processes_sharing_one_gpu(tp):
    out = run_ranks(
        tp, _mp_argmax_body, timeout_s=600, env={"IPC_DPSAMPLE_TEST_PG_BACKEND": "gloo"}
    )
    assert out == [True] * tp


# -- TokenSpeed usage under CUDA graphs (issue 16) ----------------------------------------
def _tokenspeed_graph_body(rank, tp, group, pair):
    """``pair=False``: one communicator built with ``logits_dtype=None`` whose FIRST
    swap is captured (the capture fixes the dtype), with a gather, replayed 5 times
    with new values. ``pair=True``: TokenSpeed's executor comm (only swaps, dtype from
    the first swap) and sampler comm (only gathers, after prepare_verify_outputs) on
    the same ranks, captured into one graph."""
    import torch

    torch.cuda.set_device(0)
    n, vs, pad_bs = 2, 32, 2 * tp
    r = pad_bs // tp
    stream = torch.cuda.Stream()
    failures = []
    with torch.cuda.stream(stream):
        kw = dict(max_pad_bs=pad_bs, num_tokens_per_req=n, vocab_size=vs * tp, logits_dtype=None)
        executor = _comm(group, rank, tp, **kw)
        sampler = _comm(group, rank, tp, **kw) if pair else executor
        if pair:
            sampler.prepare_verify_outputs(torch.float32)
        x = torch.zeros(pad_bs * n, vs, dtype=torch.bfloat16, device="cuda")
        p = torch.zeros(r, n, dtype=torch.int32, device="cuda")
        a, ln = torch.zeros_like(p), torch.zeros(r, dtype=torch.int32, device="cuda")
        plans = [
            (all_inputs(300 + i, tp, pad_bs, n, vs, "bfloat16"), all_verify(400 + i, tp, pad_bs, n))
            for i in range(5)
        ]
        dev = [(xs[rank].cuda(), [t[rank].cuda() for t in v[:3]]) for xs, v in plans]
        for t in (x, p, a, ln):
            torch.mul(t, 1, out=t)
        _settle(group, "allocated")
        graph = torch.cuda.CUDAGraph()
        with (
            _CAPTURE_LOCK,
            torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"),
        ):
            y = executor.swap_batch_vocab(x, pad_bs=pad_bs)  # fixes bfloat16 in the capture
            outs = sampler.gather_verify_outputs(p, a, ln, pad_bs=pad_bs)
        assert executor.logits_dtype == "bfloat16"
        _settle(group, "captured")
        for i, ((xs, v), (xd, vd)) in enumerate(zip(plans, dev, strict=True)):
            torch.mul(xd, 1, out=x)
            for src, dst in zip(vd, (p, a, ln), strict=True):
                torch.mul(src, 1, out=dst)
            _settle(group, f"inputs {i}")
            graph.replay()
            group.barrier(timeout_s=60, what=f"replay {i}")
            _settle(group, f"replayed {i}")
            executor.check()
            sampler.check()
            if not np.array_equal(bits(y), bits(swap_reference_torch(xs, rank, tp, pad_bs, n))):
                failures.append((i, "swap"))
            for o, full in zip(outs, v[:3], strict=True):
                if not np.array_equal(
                    o.cpu().numpy(), full.reshape(pad_bs, -1).squeeze(-1).numpy()
                ):
                    failures.append((i, "gather"))
        group.barrier(timeout_s=60, what="before close")
        executor.close()
        if pair:
            sampler.close()
    return failures


@pytest.mark.parametrize("pair", [False, True], ids=["lazy-dtype", "executor+sampler"])
def test_tokenspeed_style_capture_with_a_lazy_dtype_replays_new_values(pair):
    out = run_threads(2, _tokenspeed_graph_body, pair, timeout_s=300)
    assert out == [[], []], out

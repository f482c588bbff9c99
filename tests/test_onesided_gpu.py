"""One-sided backend on a real GPU: several ranks as threads of this process (one
stream each, raw pointers) and as processes sharing the GPU through CUDA IPC.

Every result is checked bit-exactly against the NumPy reference on fresh random
data, with outputs poisoned before each op.
"""

from __future__ import annotations

import os

# before CUDA initialises: every in-process rank's stream gets its own hardware queue
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import random
import threading
import time

import numpy as np
import pytest
from _gpu_common import (
    all_inputs,
    all_verify,
    bits,
    gpu_skip_reason,
    onesided_comm,
    swap_reference_torch,
)

from ipc_dpsample import DpSampleError, PeerTimeoutError
from ipc_dpsample.layout import (
    reference_gather,
    reference_swap_batch_vocab,
)
from ipc_dpsample.testing import run_ranks, run_threads

_REASON = gpu_skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


_comm = onesided_comm


def _sync_poison(comm, group):
    """Between ops: every rank idle, then poison every output region."""
    import torch

    torch.cuda.current_stream().synchronize()
    group.barrier(timeout_s=60, what="test poison")
    comm._backend.poison_for_testing()
    group.barrier(timeout_s=60, what="test poison done")


def _check_round(comm, group, rank, tp, pad_bs, n, vs, dtype, seed, poison=True):
    import torch

    if poison:
        _sync_poison(comm, group)
    xs = all_inputs(seed, tp, pad_bs, n, vs, dtype)
    y = comm.swap_batch_vocab(xs[rank].cuda(), pad_bs=pad_bs)
    torch.cuda.current_stream().synchronize()
    comm.check()
    ref = reference_swap_batch_vocab(
        [bits(x) for x in xs], tp=tp, num_tokens_per_req=n, pad_bs=pad_bs
    )[rank]
    assert y.shape == ref.shape
    np.testing.assert_array_equal(bits(y), ref)

    if poison:
        _sync_poison(comm, group)
    p, a, ln, lp = all_verify(seed + 1, tp, pad_bs, n)
    op, oa, ol = comm.gather_verify_outputs(
        p[rank].cuda(), a[rank].cuda(), ln[rank].cuda(), pad_bs=pad_bs
    )
    torch.cuda.current_stream().synchronize()
    comm.check()
    np.testing.assert_array_equal(op.cpu().numpy(), reference_gather(list(p.numpy())))
    np.testing.assert_array_equal(oa.cpu().numpy(), reference_gather(list(a.numpy())))
    np.testing.assert_array_equal(ol.cpu().numpy(), reference_gather(list(ln.numpy())))

    if poison:
        _sync_poison(comm, group)
    olp = comm.gather_verify_logprobs(lp[rank].cuda(), pad_bs=pad_bs)
    torch.cuda.current_stream().synchronize()
    comm.check()
    np.testing.assert_array_equal(bits(olp), bits(lp.reshape(-1, n)))


# (dtype, N, max_pad_bs per tp, pad_bs per tp, V/tp)
_CASES = [
    ("bfloat16", 4, 4, 4, 64),
    ("bfloat16", 1, 4, 2, 13),  # 26-byte rows: scalar/2-byte tails, misaligned rows
    ("float16", 3, 2, 1, 37),
    ("float16", 4, 4, 3, 1000),
    ("float32", 1, 3, 3, 7),  # 28-byte rows
    ("float32", 4, 4, 2, 2048),  # large rows: several chunks per row
]


def _matrix_body(rank, tp, group):
    import torch

    torch.cuda.set_device(0)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i, (dtype, n, maxr, r, vs) in enumerate(_CASES):
            with _comm(
                group,
                rank,
                tp,
                max_pad_bs=maxr * tp,
                num_tokens_per_req=n,
                vocab_size=vs * tp,
                logits_dtype=dtype,
            ) as comm:
                assert comm.backend == "onesided", comm.explain()
                assert comm.fast_path_enabled
                for it in range(2):
                    _check_round(comm, group, rank, tp, r * tp, n, vs, dtype, 1000 * i + it)
    return True


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
def test_inprocess_matrix(tp):
    assert all(run_threads(tp, _matrix_body, timeout_s=300))


def _alternating_body(
    rank, tp, group, n_ops, delays, results, fixed_output=False, swaps_only=False
):
    """Alternate swap / gather / logprobs n_ops times, ranks randomly delayed on the
    host and on the device, a slow consumer reading each output after a delay;
    every output is compared with the reference. ``fixed_output`` runs every swap
    the way it runs once ops are captured in CUDA graphs (entry barrier, then one
    fixed output region), issued eagerly so the delays apply. ``swaps_only`` issues
    swaps back to back: the pattern in which a single receive region is overwritten
    by a peer's next swap while a slow consumer still reads it."""
    import torch

    torch.cuda.set_device(0)
    rng = random.Random(1234 + rank)
    n, vs, pad_bs = 4, 96, 4 * tp
    stream = torch.cuda.Stream()
    bad = 0
    error = None
    first_bad = None
    with (
        torch.cuda.stream(stream),
        _comm(
            group,
            rank,
            tp,
            max_pad_bs=8 * tp,
            num_tokens_per_req=n,
            vocab_size=vs * tp,
            logits_dtype="bfloat16",
            timeout_s=5.0,
        ) as comm,
    ):
        if fixed_output:
            comm._backend._graphed = True  # what the first captured op switches on
        # Every input, reference and snapshot buffer exists before the first op: a
        # rank thread that allocates (a cold caching allocator calls cudaMalloc)
        # while a peer's kernel waits for it can stall both until the timeout (the
        # run_threads rules; seen once here at 925c442: a rank timed out at op 2).
        plan = []
        for i in range(n_ops):
            kind = 0 if swaps_only else i % 3
            if kind == 0:
                xs = all_inputs(7 * i, tp, pad_bs, n, vs, "bfloat16", device="cuda")
                args = (xs[rank].contiguous(),)
                ref = swap_reference_torch(xs, rank, tp, pad_bs, n).contiguous()
            elif kind == 1:
                p, a, ln, _ = all_verify(7 * i, tp, pad_bs, n, device="cuda")
                args = (p[rank].contiguous(), a[rank].contiguous(), ln[rank].contiguous())
                ref = torch.cat([p.reshape(-1), a.reshape(-1), ln.reshape(-1)])
            else:
                *_, lp = all_verify(7 * i, tp, pad_bs, n, device="cuda")
                args = (lp[rank].contiguous(),)
                ref = lp.reshape(-1, n).contiguous()
            plan.append((kind, args, ref, torch.empty_like(ref)))
        # Load every kernel the loop launches besides the library's own (which load at
        # construction) before the first op: CUDA loads modules lazily, and loading one
        # may synchronise the context, which a peer's kernel spinning for this rank
        # blocks until the timeout (CUDA Programming Guide, "Lazy Loading": kernels
        # that wait for each other must be loaded first). Seen here at 3f2ced2 as a
        # stall at op 0 and as 199 unchecked failed ops after one.
        for _, _, ref, snap in plan[:3]:
            torch.mul(ref, 1, out=snap)
        torch.cuda._sleep(1)
        stream.synchronize()
        group.barrier(timeout_s=60, what="inputs of every op allocated")
        try:
            for i, (kind, args, _, snap) in enumerate(plan):
                if delays and rng.random() < 0.3:
                    time.sleep(rng.uniform(0, 0.002))
                if delays and rng.random() < 0.3:
                    torch.cuda._sleep(rng.randint(0, 200_000))
                if kind == 0:
                    out = comm.swap_batch_vocab(*args, pad_bs=pad_bs)
                elif kind == 1:
                    out = comm.gather_verify_outputs(*args, pad_bs=pad_bs)
                else:
                    out = comm.gather_verify_logprobs(*args, pad_bs=pad_bs)
                if delays and rng.random() < 0.5:
                    torch.cuda._sleep(rng.randint(0, 4_000_000))  # slow consumer, up to ~2 ms
                # the consumer reads the output on the stream into this op's snapshot,
                # with a kernel (x * 1 is exact here), not copy_: a same-device memcpy is
                # one of CUDA's implicitly synchronising calls
                if kind == 1:
                    k0, k1 = out[0].numel(), out[0].numel() + out[1].numel()
                    torch.mul(out[0].reshape(-1), 1, out=snap[:k0])
                    torch.mul(out[1].reshape(-1), 1, out=snap[k0:k1])
                    torch.mul(out[2], 1, out=snap[k1:])
                else:
                    torch.mul(out, 1, out=snap)
                # every rank has launched op i before anyone blocks on the GPU: a host
                # thread waiting in a sync must never be what keeps a peer from launching
                group.barrier(timeout_s=60, what=f"op {i} launched")
                comm.check()
        except DpSampleError as exc:
            error = f"{type(exc).__name__}: {exc}"
        finally:
            stream.synchronize()
            group.barrier(timeout_s=60, what="end of alternating run")
        if error is None:
            try:  # an op that failed after the last host call reports here
                comm.check()
            except DpSampleError as exc:
                error = f"{type(exc).__name__}: {exc}"
        for i, (kind, _, ref, snap) in enumerate(plan):  # every op, after the run
            if not torch.equal(snap, ref):
                bad += 1
                if first_bad is None:
                    wrong = (snap != ref).nonzero()
                    first_bad = (i, kind, int(wrong.shape[0]), wrong[:4].tolist())
        if error is not None:
            error += f" (first wrong op: {first_bad})"
    if bad and error is None:
        error = f"first wrong op: {first_bad}"
    results[rank] = (bad, error)
    return bad, error


@pytest.mark.parametrize("delays", [False, True])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_200_alternating_ops_with_random_delays_are_all_correct(tp, delays):
    results = {}
    out = run_threads(tp, _alternating_body, 200, delays, results, timeout_s=600)
    assert out == [(0, None)] * tp, "\n".join(f"rank {r}: {o}" for r, o in enumerate(out))


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_graph_mode_fixed_output_with_entry_barrier_has_no_race(tp):
    """The graph-mode swap writes one region; its entry barrier must make that as
    safe as the ping-pong regions under the same delays and slow consumers."""
    results = {}
    out = run_threads(tp, _alternating_body, 200, True, results, True, timeout_s=600)
    assert out == [(0, None)] * tp, "\n".join(f"rank {r}: {o}" for r, o in enumerate(out))


def _mode_mismatch_body(rank, tp, group):
    import torch

    torch.cuda.set_device(0)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        comm = _comm(
            group,
            rank,
            tp,
            max_pad_bs=2 * tp,
            num_tokens_per_req=2,
            vocab_size=8 * tp,
            logits_dtype="float32",
            timeout_s=2.0,
        )
        if rank == 0:
            comm._backend._graphed = True  # rank 0 behaves as if it had captured a graph
        x = torch.randn(2 * tp * 2, 8, device="cuda")
        t0 = time.monotonic()
        comm.swap_batch_vocab(x, pad_bs=2 * tp)
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


@pytest.mark.skipif(
    os.environ.get("IPC_DPSAMPLE_GRAPH_SWAP", "barrier") == "copy",
    reason="IPC_DPSAMPLE_GRAPH_SWAP=copy: graph-mode swaps use the eager protocol",
)
def test_graph_and_eager_mode_disagreement_raises_on_every_rank():
    """A rank in CUDA-graph mode (fixed output) and one in eager mode (ping-pong)
    must never exchange data: the mode is part of the signature."""
    out = run_threads(2, _mode_mismatch_body, timeout_s=120)
    for rank, res in enumerate(out):
        assert res is not None, f"rank {rank} did not raise"
        name, msg, elapsed = res
        assert name in ("DpSampleError", "PeerTimeoutError"), msg
        assert elapsed < 2.0 + 1.5, f"rank {rank} took {elapsed:.1f} s: {msg}"
    # the graph-mode rank sees the eager rank's flag and names the disagreement
    assert "call sequences diverged" in out[0][1] and "CUDA-graph mode" in out[0][1], out[0][1]


@pytest.mark.parametrize("fixed_output", [False, True], ids=["ping-pong", "graph-mode"])
def test_back_to_back_swaps_with_slow_consumers_are_all_correct(fixed_output):
    results = {}
    out = run_threads(4, _alternating_body, 200, True, results, fixed_output, True, timeout_s=600)
    assert out == [(0, None)] * 4, "\n".join(f"rank {r}: {o}" for r, o in enumerate(out))


def test_single_buffer_design_has_the_race_this_design_removes(monkeypatch):
    """Forcing one data region and no entry barrier (the original design) makes the
    back-to-back swap run above fail: a peer's next swap overwrites an output that a
    slow consumer has not read yet (wrong data), or a timeout."""
    monkeypatch.setenv("IPC_DPSAMPLE_TEST_SINGLE_BUFFER", "1")
    results = {}
    out = run_threads(4, _alternating_body, 200, True, results, False, True, timeout_s=600)
    failures = sum(bad for bad, _ in out) + sum(1 for _, err in out if err)
    assert failures > 0, f"single-buffer run showed no race: {out}"


_capture_lock = threading.Lock()


def _graph_body(rank, tp, group):
    import torch

    torch.cuda.set_device(0)
    n, vs, pad_bs = 4, 40, 2 * tp
    stream = torch.cuda.Stream()
    with (
        torch.cuda.stream(stream),
        _comm(
            group,
            rank,
            tp,
            max_pad_bs=4 * tp,
            num_tokens_per_req=n,
            vocab_size=vs * tp,
            logits_dtype="float16",
        ) as comm,
    ):
        x = torch.empty(pad_bs * n, vs, dtype=torch.float16, device="cuda")
        r = pad_bs // tp
        p = torch.empty(r, n, dtype=torch.int32, device="cuda")
        a, ln = torch.empty_like(p), torch.empty(r, dtype=torch.int32, device="cuda")
        lp = torch.empty(r, n, dtype=torch.float32, device="cuda")
        # eager warm-up (collective), then capture one at a time (capture runs nothing);
        # every rank allocates before any rank issues (see run_threads)
        x.normal_()
        p.fill_(1), a.fill_(2), ln.fill_(3), lp.fill_(4)
        stream.synchronize()
        group.barrier(timeout_s=60, what="allocated")
        comm.swap_batch_vocab(x, pad_bs=pad_bs)
        comm.gather_verify_outputs(p, a, ln, pad_bs=pad_bs)
        comm.gather_verify_logprobs(lp, pad_bs=pad_bs)
        group.barrier(timeout_s=60, what="warm-up launched")
        stream.synchronize()
        group.barrier(timeout_s=60, what="before capture")
        g = torch.cuda.CUDAGraph()
        with _capture_lock:
            with torch.cuda.graph(g, stream=stream, capture_error_mode="thread_local"):
                y = comm.swap_batch_vocab(x, pad_bs=pad_bs)
                y_snap = y.clone()
                op, oa, ol = comm.gather_verify_outputs(p, a, ln, pad_bs=pad_bs)
                vo_snap = torch.cat([op.reshape(-1), oa.reshape(-1), ol])
                olp = comm.gather_verify_logprobs(lp, pad_bs=pad_bs)
                lp_snap = olp.clone()
        group.barrier(timeout_s=60, what="after capture")
        for it in range(12):
            xs = all_inputs(50 + it, tp, pad_bs, n, vs, "float16", device="cuda")
            pv, av, lv, lpv = all_verify(90 + it, tp, pad_bs, n, device="cuda")
            with torch.cuda.stream(stream):
                x.copy_(xs[rank])
                p.copy_(pv[rank]), a.copy_(av[rank]), ln.copy_(lv[rank]), lp.copy_(lpv[rank])
                y_snap.fill_(float("nan")), vo_snap.fill_(-1), lp_snap.fill_(float("nan"))
            # allocations and same-device copies serialise streams (CUDA's implicit
            # synchronisation): no rank prepares while a peer's op is in flight
            stream.synchronize()
            group.barrier(timeout_s=60, what="inputs ready")
            with torch.cuda.stream(stream):
                g.replay()
            group.barrier(timeout_s=60, what="replay launched")
            stream.synchronize()
            comm.check()
            assert torch.equal(y_snap, swap_reference_torch(xs, rank, tp, pad_bs, n)), it
            ref = torch.cat([pv.reshape(-1), av.reshape(-1), lv.reshape(-1)])
            assert torch.equal(vo_snap, ref), it
            assert torch.equal(lp_snap, lpv.reshape(-1, n)), it
        # an eager op after graph replays still returns the right data
        xs = all_inputs(999, tp, pad_bs, n, vs, "float16", device="cuda")
        x2 = xs[rank].contiguous()
        stream.synchronize()
        group.barrier(timeout_s=60, what="eager inputs ready")
        y2 = comm.swap_batch_vocab(x2, pad_bs=pad_bs)
        group.barrier(timeout_s=60, what="eager op launched")
        stream.synchronize()
        assert torch.equal(y2, swap_reference_torch(xs, rank, tp, pad_bs, n))
        group.barrier(timeout_s=60, what="end")
        del g
    return True


@pytest.mark.parametrize("tp", [2, 4])
def test_torch_cuda_graph_replay_with_new_inputs(tp):
    assert all(run_threads(tp, _graph_body, timeout_s=300))


def _cupy_graph_body(rank, tp, group):
    import cupy

    n, vs, pad_bs = 2, 24, 2 * tp
    r = pad_bs // tp
    cupy.cuda.Device(0).use()
    stream = cupy.cuda.Stream(non_blocking=True)
    with (
        stream,
        _comm(
            group,
            rank,
            tp,
            max_pad_bs=2 * tp,
            num_tokens_per_req=n,
            vocab_size=vs * tp,
            logits_dtype="float32",
        ) as comm,
    ):
        x = cupy.zeros((pad_bs * n, vs), dtype=cupy.float32)
        lp = cupy.zeros((r, n), dtype=cupy.float32)
        y_snap = cupy.empty((r * n, vs * tp), dtype=cupy.float32)  # no allocation in capture
        lp_snap = cupy.empty((pad_bs, n), dtype=cupy.float32)
        stream.synchronize()
        group.barrier(timeout_s=60, what="allocated")  # see _graph_body
        comm.swap_batch_vocab(x, pad_bs=pad_bs)
        comm.gather_verify_logprobs(lp, pad_bs=pad_bs)
        group.barrier(timeout_s=60, what="warm-up launched")
        stream.synchronize()
        group.barrier(timeout_s=60, what="before capture")
        with _capture_lock:
            stream.begin_capture(mode=cupy.cuda.runtime.streamCaptureModeThreadLocal)
            y = comm.swap_batch_vocab(x, pad_bs=pad_bs)
            cupy.copyto(y_snap, y)
            olp = comm.gather_verify_logprobs(lp, pad_bs=pad_bs)
            cupy.copyto(lp_snap, olp)
            graph = stream.end_capture()
        group.barrier(timeout_s=60, what="after capture")
        for it in range(8):
            xs = all_inputs(300 + it, tp, pad_bs, n, vs, "float32")
            *_, lps = all_verify(400 + it, tp, pad_bs, n)
            x.set(xs[rank].numpy(), stream=stream)
            lp.set(lps[rank].numpy(), stream=stream)
            y_snap.fill(float("nan"))
            lp_snap.fill(float("nan"))
            stream.synchronize()
            group.barrier(timeout_s=60, what="inputs ready")  # see _graph_body
            graph.launch(stream)
            group.barrier(timeout_s=60, what="replay launched")
            stream.synchronize()
            comm.check()
            ref = reference_swap_batch_vocab(
                [v.numpy() for v in xs], tp=tp, num_tokens_per_req=n, pad_bs=pad_bs
            )[rank]
            np.testing.assert_array_equal(cupy.asnumpy(y_snap), ref)
            np.testing.assert_array_equal(cupy.asnumpy(lp_snap), lps.reshape(-1, n).numpy())
        group.barrier(timeout_s=60, what="end")
    return True


def test_cupy_stream_capture_replay_with_new_inputs():
    assert all(run_threads(2, _cupy_graph_body, timeout_s=300))


def _interop_body(rank, tp, group, framework):
    import cupy

    n, vs, pad_bs = 3, 20, 2 * tp
    cupy.cuda.Device(0).use()
    stream = cupy.cuda.Stream(non_blocking=True)
    with (
        stream,
        _comm(
            group,
            rank,
            tp,
            max_pad_bs=2 * tp,
            num_tokens_per_req=n,
            vocab_size=vs * tp,
            logits_dtype="float16",
        ) as comm,
    ):
        for it in range(3):
            xs = all_inputs(it, tp, pad_bs, n, vs, "float16")
            p, a, ln, lp = all_verify(it + 10, tp, pad_bs, n)
            x_c = cupy.asarray(xs[rank].numpy())
            args = [cupy.asarray(v[rank].numpy()) for v in (p, a, ln, lp)]
            if framework == "numba":
                from numba import cuda

                x_c = cuda.as_cuda_array(x_c)
                args = [cuda.as_cuda_array(v) for v in args]
            stream.synchronize()
            _sync_poison(comm, group)
            kw = {"stream": stream} if framework == "numba" else {}
            y = comm.swap_batch_vocab(x_c, pad_bs=pad_bs, **kw)
            outs = comm.gather_verify_outputs(*args[:3], pad_bs=pad_bs, **kw)
            olp = comm.gather_verify_logprobs(args[3], pad_bs=pad_bs, **kw)
            stream.synchronize()
            comm.check()
            host = (lambda v: v.copy_to_host()) if framework == "numba" else cupy.asnumpy
            assert type(y).__module__.split(".")[0] == framework
            ref = reference_swap_batch_vocab(
                [v.numpy() for v in xs], tp=tp, num_tokens_per_req=n, pad_bs=pad_bs
            )[rank]
            np.testing.assert_array_equal(host(y), ref)
            np.testing.assert_array_equal(host(outs[0]), reference_gather(list(p.numpy())))
            np.testing.assert_array_equal(host(outs[1]), reference_gather(list(a.numpy())))
            np.testing.assert_array_equal(host(outs[2]), reference_gather(list(ln.numpy())))
            np.testing.assert_array_equal(host(olp), reference_gather(list(lp.numpy())))
            group.barrier(timeout_s=60, what="round")
    return True


@pytest.mark.parametrize("framework", ["cupy", "numba"])
def test_cupy_and_numba_inputs_return_their_own_array_type(framework):
    if framework == "numba":
        pytest.importorskip("numba.cuda", reason="needs numba with CUDA")
    assert all(run_threads(2, _interop_body, framework, timeout_s=300))


def _skip_body(rank, tp, group, skipper, timeout_s):
    import torch

    torch.cuda.set_device(0)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        comm = _comm(
            group,
            rank,
            tp,
            max_pad_bs=tp,
            num_tokens_per_req=2,
            vocab_size=8 * tp,
            logits_dtype="float32",
            timeout_s=timeout_s,
        )
        x = torch.randn(2 * tp, 8, device="cuda")
        result = None
        if rank != skipper:
            t0 = time.monotonic()
            comm.swap_batch_vocab(x, pad_bs=tp)
            stream.synchronize()
            try:
                comm.check()
            except PeerTimeoutError as exc:
                result = (time.monotonic() - t0, exc.peer, exc.op, str(exc))
            # later calls keep raising; the GPU stays usable
            with pytest.raises(PeerTimeoutError):
                comm.gather_verify_logprobs(torch.zeros(1, 2, device="cuda"), pad_bs=tp)
            assert float(torch.ones(1000, device="cuda").sum()) == 1000.0
        group.barrier(timeout_s=60, what="before close")
        comm.close()
    return result


def test_skipped_op_raises_peer_timeout_naming_the_peer():
    timeout_s = 2.0
    out = run_threads(3, _skip_body, 2, timeout_s, timeout_s=120)
    for rank in (0, 1):
        assert out[rank] is not None, f"rank {rank} did not raise PeerTimeoutError"
        elapsed, peer, op, msg = out[rank]
        assert peer == 2 and op == "swap_batch_vocab", msg
        assert elapsed < timeout_s + 1.0, f"rank {rank} took {elapsed:.2f} s"
        assert "peer rank 2" in msg
    assert out[2] is None


def _mismatch_body(rank, tp, group, mode):
    import torch

    torch.cuda.set_device(0)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        comm = _comm(
            group,
            rank,
            tp,
            max_pad_bs=4 * tp,
            num_tokens_per_req=2,
            vocab_size=8 * tp,
            logits_dtype="float32",
            timeout_s=10.0,
        )
        pad_bs = 4 * tp if rank == 0 or mode != "pad_bs" else 2 * tp
        t0 = time.monotonic()
        if mode == "op" and rank == 1:
            z = torch.zeros(pad_bs // tp, 2, device="cuda")
            comm.gather_verify_logprobs(z, pad_bs=pad_bs)
        else:
            comm.swap_batch_vocab(torch.randn(pad_bs * 2, 8, device="cuda"), pad_bs=pad_bs)
        stream.synchronize()
        try:
            comm.check()
            result = None
        except DpSampleError as exc:
            result = (type(exc).__name__, str(exc), time.monotonic() - t0)
        group.barrier(timeout_s=60, what="before close")
        comm.close()
    return result


@pytest.mark.parametrize("mode", ["pad_bs", "op"])
def test_runtime_mismatch_raises_on_every_rank(mode):
    out = run_threads(2, _mismatch_body, mode, timeout_s=120)
    for rank, res in enumerate(out):
        assert res is not None, f"rank {rank} did not raise"
        name, msg, elapsed = res
        assert name == "DpSampleError", msg
        assert "call sequences diverged" in msg
        assert elapsed < 5.0, f"mismatch took {elapsed:.1f} s (should not wait for the timeout)"


def _second_stream_body(rank, tp, group):
    import torch

    torch.cuda.set_device(0)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    comm = _comm(
        group,
        rank,
        tp,
        max_pad_bs=tp,
        num_tokens_per_req=1,
        vocab_size=4 * tp,
        logits_dtype="float32",
    )
    x = torch.randn(tp, 4, device="cuda")
    refused = False
    with torch.cuda.stream(s1):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: keep the first op in flight
        comm.swap_batch_vocab(x, pad_bs=tp)
    with torch.cuda.stream(s2):
        try:
            comm.swap_batch_vocab(x, pad_bs=tp)
        except DpSampleError as exc:
            refused = "still in flight" in str(exc)
    s1.synchronize()
    comm.check()
    group.barrier(timeout_s=60, what="x")
    # after the first op finished, another stream may take over
    with torch.cuda.stream(s2):
        y = comm.swap_batch_vocab(x, pad_bs=tp)
        s2.synchronize()
    comm.check()
    assert y.shape == (1, 4 * tp)
    group.barrier(timeout_s=60, what="y")
    comm.close()
    return refused


def test_second_stream_while_op_in_flight_is_refused():
    assert run_threads(2, _second_stream_body, timeout_s=120) == [True, True]


def _lifecycle_body(rank, tp, group, cycles):
    import cupy
    import torch

    torch.cuda.set_device(0)
    free = []
    stream = torch.cuda.Stream()  # in-process ranks need one stream each
    torch.cuda.set_stream(stream)
    for c in range(cycles + 1):
        comm = _comm(
            group,
            rank,
            tp,
            max_pad_bs=8 * tp,
            num_tokens_per_req=4,
            vocab_size=1024 * tp,
            logits_dtype="bfloat16",
        )
        x = torch.randn(32 * tp, 1024, device="cuda").to(torch.bfloat16)
        comm.swap_batch_vocab(x, pad_bs=8 * tp)
        stream.synchronize()
        comm.check()
        comm.close()
        comm.close()  # idempotent
        with pytest.raises(DpSampleError, match="closed"):
            comm.swap_batch_vocab(x, pad_bs=8 * tp)
        group.barrier(timeout_s=60, what="cycle")
        if c == 0 or c == cycles:
            free.append(cupy.cuda.runtime.memGetInfo()[0])
    return free


def test_create_close_cycles_return_memory():
    out = run_threads(2, _lifecycle_body, 50, timeout_s=600)
    first, last = out[0]
    assert abs(first - last) < (4 << 20), f"free memory went {first} -> {last}"


# -- several processes sharing the GPU through real CUDA IPC handles ----------------
def _mp_body(rank, tp, group):
    import cupy
    import torch

    torch.cuda.set_device(0)
    for i, (dtype, n, maxr, r, vs) in enumerate(_CASES[:4]):
        with _comm(
            group,
            rank,
            tp,
            max_pad_bs=maxr * tp,
            num_tokens_per_req=n,
            vocab_size=vs * tp,
            logits_dtype=dtype,
            backend="auto",
        ) as comm:
            assert comm.backend == "onesided", comm.explain()
            for it in range(2):
                _check_round(comm, comm._group, rank, tp, r * tp, n, vs, dtype, 10 * i + it)
    # create/close cycles: IPC mappings and memory return to baseline
    free = []
    for c in range(21):
        with _comm(
            group,
            rank,
            tp,
            max_pad_bs=tp,
            num_tokens_per_req=2,
            vocab_size=64 * tp,
            logits_dtype="float32",
        ) as comm:
            comm.swap_batch_vocab(torch.randn(2 * tp, 64, device="cuda"), pad_bs=tp)
            torch.cuda.synchronize()
            comm._group.barrier(timeout_s=60, what="cycle")
        if c in (0, 20):
            free.append(cupy.cuda.runtime.memGetInfo()[0])
    return free


@pytest.mark.parametrize("tp", [2, 4])
def test_multiprocess_ipc_on_one_gpu(tp):
    out = run_ranks(tp, _mp_body, timeout_s=600, env={"IPC_DPSAMPLE_TEST_PG_BACKEND": "gloo"})
    for first, last in out:
        assert abs(first - last) < (8 << 20), f"free memory went {first} -> {last}"

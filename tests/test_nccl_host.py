"""NCCL backend, the whole host path on the CPU (:mod:`fakes.host`): ranks are
threads, "NCCL" is an in-process fabric, kernels run in the g++ emulator through
the real prepared launches. Every output is compared bit-exactly with
ipc_dpsample.layout."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from fakes.cuda import FakeDriver
from fakes.emulator import emulator
from fakes.host import event_of, host_backends

from ipc_dpsample import DpSampleError
from ipc_dpsample.arrays import describe
from ipc_dpsample.backends.base import RealRows
from ipc_dpsample.backends.nccl import NcclBackend, packed_width
from ipc_dpsample.layout import (
    real_reqs,
    reference_gather_verify_outputs,
    reference_swap_batch_vocab,
)


@pytest.fixture
def hosts(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, FakeDriver]:
    return host_backends(monkeypatch, emulator())


def _logits(rng: np.random.Generator, world: int, rows: int, vs: int, dtype: str) -> list[Any]:
    bits = np.uint32 if dtype == "float32" else np.uint16
    return [
        rng.integers(1, np.iinfo(bits).max, size=(rows, vs), dtype=bits, endpoint=True)
        for _ in range(world)
    ]


def swap_and_check(
    backend: NcclBackend,
    rank: int,
    world: int,
    pad_bs: int,
    vs: int,
    dtype: str,
    seed: int,
    stream: Any = None,
    bs: RealRows | None = None,
    value: int | None = None,
) -> None:
    """One swap on fresh inputs (same on every rank); the rows of this rank's real
    requests (``value`` of a device ``bs``, else ``bs.bs``) must equal the
    reference; the output is poisoned afterwards."""
    rng = np.random.default_rng(seed)
    n = backend.cfg.num_tokens_per_req
    inputs = _logits(rng, world, pad_bs * n, vs, dtype)
    x = inputs[rank]
    out = backend.swap_batch_vocab(x, describe(x), pad_bs=pad_bs, bs=bs, stream=stream)
    expected = reference_swap_batch_vocab(inputs, tp=world, num_tokens_per_req=n, pad_bs=pad_bs)
    real_bs = value if value is not None else (None if bs is None else bs.bs)
    real = real_reqs(pad_bs // world, real_bs, rank) * n
    np.testing.assert_array_equal(out[:real], expected[rank][:real])
    out[...] = 0x7E7E  # poison for the next call


def gathers_and_check(
    backend: NcclBackend,
    rank: int,
    world: int,
    pad_bs: int,
    seed: int,
    stream: Any = None,
    bs: RealRows | None = None,
) -> None:
    rng = np.random.default_rng(seed)
    n, r = backend.cfg.num_tokens_per_req, pad_bs // world

    def ints(*shape: int) -> np.ndarray:
        return rng.integers(-(2**31), 2**31, size=shape, dtype=np.int64).astype(np.int32)

    p = [ints(r, n) for _ in range(world)]
    a = [ints(r, n) for _ in range(world)]
    ln = [ints(r) for _ in range(world)]
    lp = [ints(r, n).view(np.float32) for _ in range(world)]
    outs = backend.gather_verify_outputs(
        p[rank], a[rank], ln[rank], describe(p[rank]), pad_bs=pad_bs, bs=bs, stream=stream
    )
    for got, want in zip(outs, reference_gather_verify_outputs(p, a, ln), strict=True):
        np.testing.assert_array_equal(got, want)  # every row moves, real or not
        got[...] = -1
    olp = backend.gather_verify_logprobs(
        lp[rank], describe(lp[rank]), pad_bs=pad_bs, bs=bs, stream=stream
    )
    np.testing.assert_array_equal(olp.view(np.int32), np.concatenate(lp).view(np.int32))
    olp.view(np.int32)[...] = -1


@pytest.mark.parametrize(
    ("world", "vs", "dtype", "route_self"),
    [
        (2, 13, "float16", False),
        (3, 64, "bfloat16", False),
        (3, 7, "float32", False),
        (2, 13, "bfloat16", True),
        (1, 13, "float16", False),
        (1, 40, "float32", True),
    ],
)
def test_host_path_moves_every_byte(
    hosts: Any, world: int, vs: int, dtype: str, route_self: bool
) -> None:
    make, driver = hosts

    def body(rank: int, backend: NcclBackend, log: list[tuple[str, int, int]]) -> None:
        n = backend.cfg.num_tokens_per_req
        itemsize = 4 if dtype == "float32" else 2
        for step, pad_bs in enumerate([4 * world, world, 2 * world, 4 * world]):
            log.clear()
            driver.launches().clear()
            swap_and_check(backend, rank, world, pad_bs, vs, dtype, seed=step)
            chunk = pad_bs // world * n * vs * itemsize
            peers = [p for p in range(world) if route_self or p != rank]
            assert sorted(log) == sorted(
                [("send", p, 16) for p in peers]
                + [("recv", p, 16) for p in peers]
                + [("send", p, chunk) for p in peers]
                + [("recv", p, chunk) for p in peers]
            )
            assert len(log) == 4 * len(peers)
            # one prepared launch per kernel: the header, then one permute
            names = [k for k, _ in driver.launches()]
            assert len(names) == 2 and names[0] == "nccl_header"
            assert names[1].startswith("nccl_permute<")
            log.clear()
            driver.launches().clear()
            gathers_and_check(backend, rank, world, pad_bs, seed=100 + step)
            width = packed_width(4 * world, world, n)
            assert log == [("allGather", -1, 4 * width)] * 2  # fixed size: pad_bs-independent
            assert [k for k, _ in driver.launches()] == ["nccl_pack", "nccl_unpack"] * 2
        backend.check()

    make(world, body, route_self=route_self, vocab_size=vs * world, logits_dtype=dtype)


def test_host_path_misaligned_input_uses_narrower_vectors(hosts: Any) -> None:
    """An input view starting 2 bytes into its buffer: the permute falls back to a
    width that divides the input address, and the result is still exact."""
    make, driver = hosts

    def body(rank: int, backend: NcclBackend, log: Any) -> None:
        rng = np.random.default_rng(5)
        n, pad_bs, vs = 3, 2, 8
        inputs = _logits(rng, 2, pad_bs * n, vs, "float16")
        backing = np.zeros(pad_bs * n * vs + 1, dtype=np.uint16)
        x = backing[1:].reshape(pad_bs * n, vs)
        x[...] = inputs[rank]
        driver.launches().clear()
        out = backend.swap_batch_vocab(x, describe(x), pad_bs=pad_bs, bs=None, stream=None)
        expected = reference_swap_batch_vocab(inputs, tp=2, num_tokens_per_req=n, pad_bs=pad_bs)
        np.testing.assert_array_equal(out, expected[rank])
        assert driver.launches()[1][0] == "nccl_permute<u16>"

    make(2, body, vocab_size=16, logits_dtype="float16")


def test_host_path_prepare_switches_dtype(hosts: Any) -> None:
    make, _ = hosts

    def body(rank: int, backend: NcclBackend, log: Any) -> None:
        for step, dtype in enumerate(["float32", "bfloat16", "float16"]):
            backend.prepare(dtype)
            swap_and_check(backend, rank, 2, 4, 5, dtype, seed=step)
        backend.check()

    make(2, body, vocab_size=10)


def test_host_path_gather_mismatch_raises_on_every_rank(hosts: Any) -> None:
    make, _ = hosts

    def body(rank: int, backend: NcclBackend, log: Any) -> str:
        gathers_and_check(backend, rank, 3, 6, seed=1)  # two good ops first: seq #3 next
        swap_and_check(backend, rank, 3, 3, 2, "float32", seed=2)
        ints = np.arange(2 * 3, dtype=np.int32).reshape(2, 3)
        if rank == 1:
            backend.gather_verify_logprobs(
                ints.view(np.float32), describe(ints), pad_bs=6, stream=None
            )
        else:
            backend.gather_verify_outputs(
                ints, ints, ints[:, 0].copy(), describe(ints), pad_bs=6, stream=None
            )
        with pytest.raises(DpSampleError) as info:
            backend.check()
        log.clear()
        with pytest.raises(DpSampleError, match="call sequences diverged"):  # sticky
            backend.gather_verify_outputs(
                ints, ints, ints[:, 0].copy(), describe(ints), pad_bs=6, stream=None
            )
        assert log == []  # raised before any NCCL call
        return str(info.value)

    msgs = make(3, body, vocab_size=6, logits_dtype="float32")
    assert msgs[0].startswith(
        "rank 1 called gather_verify_logprobs(pad_bs=6, bs=6, N=3) #3 while rank 0 called "
        "gather_verify_outputs(pad_bs=6, bs=6, N=3) #3 (nccl backend, seen by rank 0)"
    )
    assert msgs[1].startswith("rank 0 called gather_verify_outputs(pad_bs=6, bs=6, N=3) #3 while")
    assert "seen by rank 1" in msgs[1]
    assert (
        msgs[2].startswith("rank 1 called gather_verify_logprobs") and "seen by rank 2" in msgs[2]
    )


def test_host_path_swap_dtype_mismatch_raises_on_every_rank(hosts: Any) -> None:
    make, _ = hosts

    def body(rank: int, backend: NcclBackend, log: Any) -> str:
        dtype = "bfloat16" if rank == 0 else "float16"
        backend.prepare(dtype)
        x = np.ones((2 * 3, 4), dtype=np.uint16)
        backend.swap_batch_vocab(x, describe(x), pad_bs=2, stream=None)
        with pytest.raises(DpSampleError) as info:
            backend.check()
        return str(info.value)

    msgs = make(2, body, vocab_size=8)
    assert msgs[0].startswith(
        "rank 1 called swap_batch_vocab(pad_bs=2, bs=2, N=3, float16) #0 while rank 0 called "
        "swap_batch_vocab(pad_bs=2, bs=2, N=3, bfloat16) #0 (nccl backend, seen by rank 0)"
    )
    assert msgs[1].startswith("rank 0 called swap_batch_vocab(pad_bs=2, bs=2, N=3, bfloat16) #0")
    assert "seen by rank 1" in msgs[1]


def test_host_path_close_destroys_and_frees(hosts: Any) -> None:
    make, _ = hosts
    logs: list[Any] = []

    def body(rank: int, backend: NcclBackend, log: Any) -> None:
        logs.append(log)

    make(2, body, vocab_size=4, logits_dtype="float16")
    assert len(logs) == 2 and all(log[-1] == ("destroy", -1, 0) for log in logs)


# -- one op in flight per communicator (DESIGN.md point 9) ------------------------------------
A, B = 0x1000, 0x2000  # two stream handles


def _swap_op(backend: NcclBackend, stream: int) -> Any:
    x = np.ones((backend.cfg.max_pad_bs * backend.cfg.num_tokens_per_req, 4), dtype=np.uint16)
    return backend.swap_batch_vocab(x, describe(x), pad_bs=backend.cfg.max_pad_bs, stream=stream)


def _gather_op(backend: NcclBackend, stream: int) -> Any:
    lp = np.zeros((backend.cfg.max_pad_bs // backend.tp, 3), dtype=np.float32)
    return backend.gather_verify_logprobs(
        lp, describe(lp), pad_bs=backend.cfg.max_pad_bs, stream=stream
    )


@pytest.mark.parametrize("op", [_swap_op, _gather_op])
def test_second_stream_refused_while_previous_op_in_flight(hosts: Any, op: Any) -> None:
    make, driver = hosts

    def body(rank: int, backend: NcclBackend, log: list[Any]) -> None:
        event = event_of(backend)
        swap_and_check(backend, rank, 2, 4, 5, "float16", seed=0, stream=A)
        assert event.records == [A] and event.queries == 0
        event.finished = False  # A's op still runs on the GPU
        log.clear()
        driver.launches().clear()
        with pytest.raises(DpSampleError) as info:
            op(backend, B)
        msg = str(info.value)
        assert msg.startswith(f"rank {rank}: op issued on stream 0x2000 while this ")
        assert "previous op on stream 0x1000 is still in flight: one op at a time" in msg
        assert log == [] and driver.launches() == []  # refused before any NCCL call or kernel
        assert event.records == [A] and event.queries == 1
        event.finished = True  # the caller synchronised
        swap_and_check(backend, rank, 2, 4, 5, "float16", seed=1, stream=B)
        gathers_and_check(backend, rank, 2, 4, seed=2, stream=B)
        assert event.records == [A, B, B, B]
        assert event.queries == 2  # once more for the change A -> B, not per op on B
        assert {s for _, s in driver.launches()} == {B}  # every kernel on the op's stream
        backend.check()

    make(2, body, vocab_size=10, logits_dtype="float16")


def test_same_stream_never_queries_the_event(hosts: Any) -> None:
    make, _ = hosts

    def body(rank: int, backend: NcclBackend, log: Any) -> None:
        event = event_of(backend)
        event.finished = False  # would refuse any stream change
        for step in range(3):
            swap_and_check(backend, rank, 2, 4, 5, "bfloat16", seed=step, stream=A)
            gathers_and_check(backend, rank, 2, 4, seed=10 + step, stream=A)
        assert event.queries == 0
        assert event.records == [A] * 9  # one record per op, nothing else
        backend.check()

    make(2, body, vocab_size=10, logits_dtype="bfloat16")


def test_capture_neither_queries_nor_records(hosts: Any) -> None:
    make, _ = hosts

    def body(rank: int, backend: NcclBackend, log: Any) -> None:
        event, runtime = event_of(backend), backend._runtime
        _swap_op(backend, A)
        event.finished = False
        runtime.capturing.add(B)
        log.clear()
        for op in (_swap_op, _gather_op, _gather_op):  # another stream, but being captured
            op(backend, B)
        assert log  # the NCCL calls were issued (captured)
        assert event.queries == 0 and event.records == [A]
        assert runtime.capture_queries == [A, B, B, B]
        runtime.capturing.clear()
        # the capture did not move the reference: an eager op on B is checked against A's
        with pytest.raises(DpSampleError, match=r"stream 0x2000 .* on stream 0x1000 is still"):
            _swap_op(backend, B)
        assert event.queries == 1
        event.finished = True
        _swap_op(backend, B)
        assert event.records == [A, B]

    make(2, body, vocab_size=8, logits_dtype="float16")

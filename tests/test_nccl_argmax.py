"""NCCL backend, ``argmax_batch_vocab`` end to end on the host path
(:mod:`fakes.host`): the real prepared launches of nccl_header, the argmax kernels
of kernels/argmax.cu and nccl_finish run in the g++ emulator, the partials travel
through the in-process NCCL; results are compared with
``reference_argmax_batch_vocab``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from fakes.cuda import FakeDriver
from fakes.emulator import emulator
from fakes.host import host_backends

from ipc_dpsample import DpSampleError
from ipc_dpsample.arrays import describe
from ipc_dpsample.backends.base import RealRows
from ipc_dpsample.backends.nccl import NcclBackend
from ipc_dpsample.layout import real_reqs, reference_argmax_batch_vocab

N = 3


@pytest.fixture
def hosts(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, FakeDriver]:
    return host_backends(monkeypatch, emulator())


def _bits(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values as ``dtype`` the way the reference reads them: bfloat16 as its
    uint16 bits (truncated), float16/float32 as numpy floats."""
    f32 = values.astype(np.float32)
    if dtype == "bfloat16":
        return (f32.view(np.uint32) >> 16).astype(np.uint16)
    return f32.astype(np.float16) if dtype == "float16" else f32


def _inputs(seed: int, world: int, pad_bs: int, vs: int, dtype: str) -> list[np.ndarray]:
    """Every rank's shard; row 0 ties across the shard boundary, row 1 holds a NaN
    on the last rank, row 2 is all -inf."""
    rng = np.random.default_rng(seed)
    full = rng.standard_normal((pad_bs * N, vs * world)).astype(np.float32) * 4
    full[0, :] = -1.0
    full[0, vs - 1] = full[0, min(vs, vs * world - 1)] = 7.0  # the first maximum wins
    full[1, -1] = np.nan
    full[2, :] = -np.inf
    return [
        _bits(np.ascontiguousarray(full[:, s * vs : (s + 1) * vs]), dtype) for s in range(world)
    ]


def argmax_and_check(
    backend: NcclBackend,
    rank: int,
    world: int,
    pad_bs: int,
    vs: int,
    dtype: str,
    seed: int,
    *,
    vocab_limit: int,
    bs: RealRows | None = None,
    value: int | None = None,
) -> None:
    """One argmax on fresh inputs; the rows of this rank's real requests must hold
    the reference's token ids exactly and its logprobs within 1e-5 (NaN where NaN)."""
    inputs = _inputs(seed, world, pad_bs, vs, dtype)
    x = inputs[rank]
    ids, lps = backend.argmax_batch_vocab(
        x, describe(x), pad_bs=pad_bs, vocab_limit=vocab_limit, bs=bs, stream=None
    )
    want_ids, want_lps = reference_argmax_batch_vocab(
        inputs, tp=world, num_tokens_per_req=N, pad_bs=pad_bs, dtype=dtype,
        vocab_limit=vocab_limit,
    )[rank]  # fmt: skip
    real_bs = value if value is not None else (None if bs is None else bs.bs)
    real = real_reqs(pad_bs // world, real_bs, rank) * N
    rn = pad_bs // world * N
    assert ids.shape == (rn,) and lps.shape == (rn,)
    np.testing.assert_array_equal(ids[:real].view(np.int32), want_ids[:real])
    got = lps[:real].view(np.float32)
    np.testing.assert_allclose(got, want_lps[:real], atol=1e-5, rtol=0, equal_nan=True)
    ids.view(np.int32)[...] = -7  # poison for the next call
    lps.view(np.float32)[...] = 1234.5


@pytest.mark.parametrize(
    ("world", "vs", "dtype", "route_self"),
    [
        (1, 16, "float32", False),
        (1, 9, "bfloat16", True),
        (2, 13, "float16", False),
        (3, 8, "bfloat16", False),
        (3, 5, "float32", True),
    ],
)
def test_argmax_end_to_end(hosts: Any, world: int, vs: int, dtype: str, route_self: bool) -> None:
    make, driver = hosts

    def body(rank: int, backend: NcclBackend, log: list[tuple[str, int, int]]) -> None:
        peers = [p for p in range(world) if p != rank]  # the own block never travels
        for step, (pad_bs, limit) in enumerate(
            [(4 * world, vs * world), (world, vs * world - 2), (2 * world, 1), (4 * world, vs)]
        ):
            log.clear()
            driver.launches().clear()
            argmax_and_check(backend, rank, world, pad_bs, vs, dtype, step, vocab_limit=limit)
            chunk = pad_bs // world * N * 12
            assert sorted(log) == sorted(
                [(d, p, size) for p in peers for d in ("send", "recv") for size in (16, chunk)]
            )
            assert [k for k, _ in driver.launches()] == [
                "nccl_header", "dp_argmax_partials", "dp_argmax_combine", "nccl_finish",
            ]  # fmt: skip
        backend.check()

    make(world, body, route_self=route_self, vocab_size=vs * world, logits_dtype=dtype)


@pytest.mark.parametrize("bs", [0, 1, 3, 7, 8])
def test_argmax_host_bs(hosts: Any, bs: int) -> None:
    """Only real rows are computed; the byte counts do not depend on bs."""
    make, _ = hosts
    world, vs, pad_bs = 2, 6, 8

    def body(rank: int, backend: NcclBackend, log: list[tuple[str, int, int]]) -> None:
        for step in range(2):
            log.clear()
            argmax_and_check(backend, rank, world, pad_bs, vs, "float16", step,
                             vocab_limit=vs * world, bs=RealRows(bs, 0, True))  # fmt: skip
            chunk = pad_bs // world * N * 12
            assert sorted(e for e in log if e[2] != 16) == [("recv", 1 - rank, chunk),
                                                            ("send", 1 - rank, chunk)]  # fmt: skip
        backend.check()

    make(world, body, vocab_size=vs * world, logits_dtype="float16")


def test_argmax_device_bs_is_read_per_call(hosts: Any) -> None:
    """The same RealRows every call, the scalar changed in between (as before a
    CUDA-graph replay): each call computes the real rows of the current value."""
    make, _ = hosts
    world, vs, pad_bs = 3, 4, 6

    def body(rank: int, backend: NcclBackend, log: Any) -> None:
        scalar = np.zeros(1, dtype=np.int32)
        rows = RealRows(pad_bs, int(scalar.ctypes.data), True)
        for step, value in enumerate([6, 3, 0, 5]):
            scalar[0] = value
            argmax_and_check(backend, rank, world, pad_bs, vs, "bfloat16", step,
                             vocab_limit=vs * world - 1, bs=rows, value=value)  # fmt: skip
        backend.check()

    make(world, body, vocab_size=vs * world, logits_dtype="bfloat16")


def test_argmax_phantom_rows_untouched_and_views_reused(hosts: Any) -> None:
    make, _ = hosts

    def body(rank: int, backend: NcclBackend, log: Any) -> None:
        x = _inputs(0, 2, 4, 4, "float32")[rank]
        first = backend.argmax_batch_vocab(x, describe(x), pad_bs=4, vocab_limit=8,
                                           bs=RealRows(3, 0, True), stream=None)  # fmt: skip
        first[0][...] = -7
        again = backend.argmax_batch_vocab(x, describe(x), pad_bs=4, vocab_limit=8,
                                           bs=RealRows(3, 0, True), stream=None)  # fmt: skip
        assert again[0].ctypes.data == first[0].ctypes.data  # the cached view
        real = real_reqs(2, 3, rank) * N
        assert (again[0][real:] == -7).all() and (again[0][:real] != -7).all()

    make(2, body, vocab_size=8, logits_dtype="float32")


def test_argmax_rejects_vocab_limit(hosts: Any) -> None:
    make, driver = hosts

    def body(rank: int, backend: NcclBackend, log: Any) -> None:
        x = np.zeros((4 * N, 4), dtype=np.float32)
        for limit in (0, 9):
            driver.launches().clear()
            with pytest.raises(ValueError, match=rf"vocab_limit={limit}; expected 1 <= "
                               r"vocab_limit <= V=8"):  # fmt: skip
                backend.argmax_batch_vocab(x, describe(x), pad_bs=4, vocab_limit=limit,
                                           stream=None)  # fmt: skip
            assert driver.launches() == [] and log == []

    make(2, body, vocab_size=8, logits_dtype="float32")


@pytest.mark.parametrize("what", ["bs", "device_bs", "dtype"])
def test_argmax_mismatch_raises_on_every_rank(hosts: Any, what: str) -> None:
    """Rank 1 disagrees; the byte counts stay equal, so every rank's header check
    sees it and every rank raises the divergence message."""
    make, _ = hosts
    world, vs = 3, 4

    def body(rank: int, backend: NcclBackend, log: Any) -> str:
        pad_bs, odd = 6, rank == 1
        dtype = "float16" if (what == "dtype" and odd) else "bfloat16"
        backend.prepare(dtype)
        scalar = np.array([4 if odd else 5], dtype=np.int32)
        bs = RealRows(4 if (what == "bs" and odd) else 5, 0, True)
        if what == "device_bs":
            bs = RealRows(pad_bs, int(scalar.ctypes.data), True)
        x = np.zeros((pad_bs * N, vs), dtype=np.uint16)
        backend.argmax_batch_vocab(x, describe(x), pad_bs=pad_bs, vocab_limit=12, bs=bs,
                                   stream=None)  # fmt: skip
        with pytest.raises(DpSampleError) as info:
            backend.check()
        with pytest.raises(DpSampleError, match="call sequences diverged"):  # sticky
            backend.argmax_batch_vocab(x, describe(x), pad_bs=pad_bs, vocab_limit=12, bs=bs,
                                       stream=None)  # fmt: skip
        return str(info.value)

    msgs = make(world, body, vocab_size=vs * world)
    for rank, msg in enumerate(msgs):
        assert f"seen by rank {rank})" in msg, msg
        assert "argmax_batch_vocab(pad_bs=6, bs=" in msg
        if what == "dtype":
            assert "float16" in msg and "bfloat16" in msg
        else:
            assert "bs=4, N=3, bfloat16" in msg and "bs=5, N=3, bfloat16" in msg

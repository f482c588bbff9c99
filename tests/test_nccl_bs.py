"""NCCL backend, real rows only (``bs``), on the host path (:mod:`fakes.host`):
host ``bs`` moves only real rows, a device ``bs`` moves fixed counts and is read
when the op runs, and ranks that disagree on ``bs`` raise on every rank."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from fakes.cuda import FakeDriver
from fakes.emulator import emulator
from fakes.host import host_backends
from test_nccl_host import gathers_and_check, swap_and_check

from ipc_dpsample import DpSampleError
from ipc_dpsample.arrays import describe
from ipc_dpsample.backends.base import RealRows
from ipc_dpsample.backends.nccl import NcclBackend
from ipc_dpsample.layout import real_reqs


@pytest.fixture
def hosts(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, FakeDriver]:
    return host_backends(monkeypatch, emulator())


def _data_log(log: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """The data steps of a swap's group (the 16-byte headers left out)."""
    return sorted(e for e in log if e[2] != 16)


@pytest.mark.parametrize(
    ("world", "pad_bs", "bs", "route_self"),
    [
        (3, 6, 0, False),  # nobody has a real request: headers only
        (3, 6, 1, False),  # rank 0 one request, ranks 1 and 2 none
        (3, 6, 3, False),  # rank 1 one of two, rank 2 none
        (3, 6, 6, False),  # bs == pad_bs: every row
        (3, 12, 5, False),
        (2, 4, 3, True),  # own block through NCCL too
        (1, 4, 2, False),
    ],
)
def test_host_bs_moves_only_real_rows(
    hosts: Any, world: int, pad_bs: int, bs: int, route_self: bool
) -> None:
    make, _ = hosts
    vs, dtype = 5, "bfloat16"

    def body(rank: int, backend: NcclBackend, log: list[tuple[str, int, int]]) -> None:
        n, reqs, rowbytes = backend.cfg.num_tokens_per_req, pad_bs // world, vs * 2
        for step in range(2):  # the second call reuses the cached plan and peer steps
            log.clear()
            rows = RealRows(bs, 0, True)
            swap_and_check(backend, rank, world, pad_bs, vs, dtype, seed=step, bs=rows)
            peers = [p for p in range(world) if route_self or p != rank]
            mine = real_reqs(reqs, bs, rank) * n * rowbytes
            want = [("send", p, real_reqs(reqs, bs, p) * n * rowbytes) for p in peers]
            want += [("recv", p, mine) for p in peers]
            assert _data_log(log) == sorted(e for e in want if e[2])  # zero-byte steps left out
            assert sorted(e for e in log if e[2] == 16) == sorted(
                [("send", p, 16) for p in peers] + [("recv", p, 16) for p in peers]
            )
            gathers_and_check(backend, rank, world, pad_bs, seed=50 + step, bs=rows)
        backend.check()

    make(world, body, route_self=route_self, vocab_size=vs * world, logits_dtype=dtype)


@pytest.mark.parametrize("route_self", [False, True])
def test_device_bs_moves_fixed_counts_and_reads_the_scalar_per_call(
    hosts: Any, route_self: bool
) -> None:
    """A device scalar: every row travels (as a graph replay would), and each call
    writes the real rows of the value the scalar holds when it runs."""
    make, _ = hosts
    world, pad_bs, vs, dtype = 2, 8, 3, "float32"

    def body(rank: int, backend: NcclBackend, log: list[tuple[str, int, int]]) -> None:
        n = backend.cfg.num_tokens_per_req
        chunk = pad_bs // world * n * vs * 4
        scalar = np.zeros(1, dtype=np.int32)
        rows = RealRows(pad_bs, int(scalar.ctypes.data), True)
        peers = [p for p in range(world) if route_self or p != rank]
        for step, value in enumerate([8, 5, 0, 3, 8]):  # the same RealRows every call
            scalar[0] = value
            log.clear()
            swap_and_check(backend, rank, world, pad_bs, vs, dtype, seed=step, bs=rows,
                           value=value)  # fmt: skip
            assert _data_log(log) == sorted(
                [("send", p, chunk) for p in peers] + [("recv", p, chunk) for p in peers]
            )
            gathers_and_check(backend, rank, world, pad_bs, seed=20 + step, bs=rows)
        backend.check()

    make(world, body, route_self=route_self, vocab_size=vs * world, logits_dtype=dtype)


def test_phantom_rows_are_not_written(hosts: Any) -> None:
    """Output rows of phantom requests keep whatever the buffer held."""
    make, _ = hosts

    def body(rank: int, backend: NcclBackend, log: Any) -> None:
        n, pad_bs, bs = 3, 4, 3
        x = np.full((pad_bs * n, 4), rank + 1, dtype=np.uint16)
        out = backend.swap_batch_vocab(x, describe(x), pad_bs=pad_bs, bs=RealRows(bs, 0, True),
                                       stream=None)  # fmt: skip
        out[...] = 0x7E7E
        backend.swap_batch_vocab(x, describe(x), pad_bs=pad_bs, bs=RealRows(bs, 0, True),
                                 stream=None)  # fmt: skip
        real = real_reqs(2, bs, rank) * n
        assert (out[:real, :4] == 1).all() and (out[:real, 4:] == 2).all()
        assert (out[real:] == 0x7E7E).all()

    make(2, body, vocab_size=8, logits_dtype="float16")


def _diverging_bs_body(op: str, device: bool) -> Any:
    def body(rank: int, backend: NcclBackend, log: Any) -> str:
        pad_bs, n = 6, 3
        value = 4 if rank == 2 else 5
        scalar = np.array([value], dtype=np.int32)
        rows = (
            RealRows(pad_bs, int(scalar.ctypes.data), True) if device else RealRows(value, 0, True)
        )
        ints = np.arange(2 * n, dtype=np.int32).reshape(2, n)
        if op == "outputs":
            backend.gather_verify_outputs(ints, ints, ints[:, 0].copy(), describe(ints),
                                          pad_bs=pad_bs, bs=rows, stream=None)  # fmt: skip
        elif op == "logprobs":
            lp = ints.view(np.float32)
            backend.gather_verify_logprobs(lp, describe(lp), pad_bs=pad_bs, bs=rows, stream=None)
        else:
            x = np.ones((pad_bs * n, 2), dtype=np.uint32)
            backend.swap_batch_vocab(x, describe(x), pad_bs=pad_bs, bs=rows, stream=None)
        with pytest.raises(DpSampleError) as info:
            backend.check()
        with pytest.raises(DpSampleError, match="call sequences diverged"):  # sticky
            backend.check()
        return str(info.value)

    return body


@pytest.mark.parametrize(
    ("op", "device"),
    [("outputs", False), ("logprobs", False), ("outputs", True), ("swap", True)],
)
def test_different_bs_raises_on_every_rank(hosts: Any, op: str, device: bool) -> None:
    """Rank 2 passes bs=4, ranks 0 and 1 bs=5 (host ints for the gathers, device
    scalars for any op: equal byte counts, so the headers expose it)."""
    make, _ = hosts
    msgs = make(3, _diverging_bs_body(op, device), vocab_size=6, logits_dtype="float32")
    name = {"outputs": "gather_verify_outputs", "logprobs": "gather_verify_logprobs"}.get(
        op, "swap_batch_vocab"
    )
    for rank, msg in enumerate(msgs):
        assert f"seen by rank {rank})" in msg, msg
        assert f"{name}(pad_bs=6, bs=4," in msg and f"{name}(pad_bs=6, bs=5," in msg, msg

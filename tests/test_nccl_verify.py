"""NCCL backend, ``verify_batch_vocab`` end to end on the host path (:mod:`fakes.host`):
ranks are threads, "NCCL" is the in-process fabric, and the real prepared launches of
nccl_header, kernels/verify.cu (``dp_verify_records``, ``dp_verify_combine``),
nccl_verify_finish and the gathers' pack/unpack run in the g++ emulator. Every call
uses fresh random logits, and every verify buffer and output is poisoned before it;
``predict``, ``accept_index`` and ``accept_length`` must equal
``ipc_dpsample.layout.reference_verify_batch_vocab`` bit for bit and the logprobs must
be within 1 float32 ulp. Ranks that pass other arguments raise; batches the kernels
cannot decide go to ``verify_by_swap``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from _verify_bodies import accepting_candidates
from fakes.cuda import FakeDriver
from fakes.emulator import emulator
from fakes.host import host_backends
from test_verify_kernels_cpu import _check, _encode, _logits, _params

from ipc_dpsample import DpSampleError
from ipc_dpsample.arrays import describe
from ipc_dpsample.backends.base import RealRows
from ipc_dpsample.backends.nccl import NcclBackend
from ipc_dpsample.backends.nccl import backend as nccl_backend
from ipc_dpsample.backends.nccl.geometry import VERIFY_BLOCK
from ipc_dpsample.backends.verify_plan import list_cap, record_words
from ipc_dpsample.layout import reference_verify_batch_vocab, verify_params

N = 3
POISON = 0x5A5A5A5A  # poison_for_testing(0x5A) in every int32 word
_KERNELS = ["nccl_header", "dp_verify_records", "dp_verify_combine", "nccl_verify_finish"]
_GATHER = ["nccl_pack", "nccl_unpack"]


@pytest.fixture
def hosts(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, FakeDriver]:
    return host_backends(monkeypatch, emulator())


def _inputs(
    key: tuple[int, ...], world: int, pad_bs: int, vs: int, dtype: str, mode: str, **kw: Any
) -> tuple[list[np.ndarray], dict[str, Any]]:
    """Every rank's shard (what a rank holds: bfloat16 as uint16 bits) and the
    per-request parameters, the same on every rank."""
    g = np.random.default_rng(list(key))
    full = _encode(_logits(g, pad_bs * N, vs * world, kw.get("scale", 2.0), kw["specials"]), dtype)
    shards = [np.ascontiguousarray(full[:, s * vs : (s + 1) * vs]) for s in range(world)]
    return shards, _params(g, pad_bs, mode)


def verify_and_check(
    backend: NcclBackend,
    rank: int,
    world: int,
    key: tuple[int, ...],
    *,
    pad_bs: int,
    vs: int,
    dtype: str,
    mode: str,
    bs: int | None = None,
    bs_on_device: bool = False,
    vocab_limit: int | None = None,
    want_lp: bool = True,
    specials: bool = False,
    stream: Any = None,
) -> tuple[tuple[Any, ...], int]:
    """One verify_batch_vocab on fresh inputs after poisoning every verify buffer; every
    real row of the whole batch must equal the reference. Returns the outputs and the
    call's list capacity."""
    v = vs * world
    shards, prm = _inputs(key, world, pad_bs, vs, dtype, mode, specials=specials)
    ref_kw = dict(tp=world, pad_bs=pad_bs, dtype=dtype, vocab_limit=vocab_limit, bs=bs, **prm)
    first = reference_verify_batch_vocab(shards, np.zeros((pad_bs, N), np.int32), **ref_kw)
    cand = accepting_candidates((*key, 2), first[0], v)
    want = reference_verify_batch_vocab(shards, cand, **ref_kw, return_logprobs=want_lp)
    params = verify_params(
        pad_bs=pad_bs, num_tokens_per_req=N, vocab_size=v, vocab_limit=vocab_limit, bs=bs, **prm
    )
    scalar = np.array([pad_bs if bs is None else bs], np.int32)  # alive until the call ends
    if bs_on_device:
        rows = RealRows(pad_bs, int(scalar.ctypes.data), True)
    else:
        rows = RealRows.every(pad_bs) if bs is None else RealRows(bs, 0, True)
    x = shards[rank]
    backend.prepare(dtype)  # what the communicator checks the logits against
    backend.poison_for_testing(POISON & 0xFF)
    outs = backend.verify_batch_vocab(
        x, describe(x), cand, describe(cand), pad_bs=pad_bs, params=params,
        return_logprobs=want_lp, bs=rows, stream=stream,
    )  # fmt: skip
    assert backend.last_verify_path == "kernels"
    assert len(outs) == (4 if want_lp else 3)
    shapes = [(pad_bs, N), (pad_bs, N), (pad_bs,), (pad_bs, N)]
    assert [o.shape for o in outs] == shapes[: len(outs)]
    got = list(outs[:3])
    if want_lp:
        got.append(outs[3].view(np.float32))  # the host views show float32 as its bits
    real = pad_bs if bs is None else bs
    what = f"{mode} {dtype} tp={world} rank={rank} pad_bs={pad_bs} bs={bs} limit={vocab_limit}"
    _check(tuple(got), want, real, what)
    # phantom requests are not combined: their gathered rows are the local poison
    assert (outs[2][real:] == POISON).all(), what
    return outs, list_cap(params)


# -- results against the reference ------------------------------------------------------------
_MODES = ("greedy", "temperature", "top_k", "top_k_top_p", "top_k_min_p", "mixed")


#: every dtype at world 1; at worlds 2 and 3 float32 and one 2-byte dtype each (the
#: host's steps depend on the dtype only through its size; the kernels' unpacking of each
#: dtype is tested in test_verify_kernels_cpu)
@pytest.mark.parametrize(
    ("world", "vs", "route_self", "dtype"),
    [
        (1, 150, False, "float32"),
        (1, 150, False, "bfloat16"),
        (1, 150, False, "float16"),
        (2, 70, True, "float32"),
        (2, 70, True, "float16"),
        (3, 50, False, "float32"),
        (3, 50, False, "bfloat16"),
    ],
)
def test_verify_matches_reference(
    hosts: Any, world: int, vs: int, route_self: bool, dtype: str
) -> None:
    """Every mode on one communicator; the kernel sequence, the NCCL steps (the record
    size follows the call's largest top-k), the copies and the block size asked for."""
    make, driver = hosts
    emu = emulator()

    def body(rank: int, backend: NcclBackend, log: list[tuple[str, int, int]]) -> None:
        seen: Any = None
        for i, mode in enumerate(_MODES):
            log.clear()
            driver.launches().clear()
            backend._runtime.copies.clear()
            key = (world, vs, len(dtype), i)
            want_lp = mode != "top_k_top_p"
            pad_bs = 2 * world
            outs, cap = verify_and_check(backend, rank, world, key, pad_bs=pad_bs, vs=vs,
                                         dtype=dtype, mode=mode, want_lp=want_lp,
                                         specials=mode in ("greedy", "top_k", "mixed"))  # fmt: skip
            if seen is None:
                seen = outs[0]
            assert outs[0] is seen  # views of the persistent outputs, built once
            gathers = _GATHER * (2 if want_lp else 1)
            # the records kernel without top-k shared memory when no row has a list
            kernels = [k if cap or k != "dp_verify_records" else k + "_nolist" for k in _KERNELS]
            assert [k for k, _ in driver.launches()] == kernels + gathers
            chunk = pad_bs // world * N * record_words(cap) * 4
            peers = [p for p in range(world) if p != rank or route_self]
            moved = sorted(e for e in log if e[0] != "allGather")
            assert moved == sorted(
                [(d, p, size) for p in peers for d in ("send", "recv") for size in (16, chunk)]
            ), (mode, moved)
            assert [e[0] for e in log if e[0] == "allGather"] == ["allGather"] * (len(gathers) // 2)
            copies = [(nbytes, kind) for nbytes, kind, _ in backend._runtime.copies]
            own = [] if (world == 1 or route_self) else [(chunk, 3)]
            assert copies == [(pad_bs * 32, 1), *own]  # DvParams H2D, the own block D2D
        backend.check()

    make(world, body, route_self=route_self, vocab_size=vs * world, logits_dtype=dtype,
         max_pad_bs=4 * world)  # fmt: skip
    asked = {(name, block) for name, _, block in emu.blocks if name.startswith("dp_verify")}
    assert asked == {
        (name, VERIFY_BLOCK)
        for name in ("dp_verify_records", "dp_verify_records_nolist", "dp_verify_combine")
    }


def test_verify_tp4_whole_shards_past_vocab_limit(hosts: Any) -> None:
    make, _ = hosts
    world, vs = 4, 48

    def body(rank: int, backend: NcclBackend, log: Any) -> None:
        verify_and_check(backend, rank, world, (4, 0), pad_bs=world, vs=vs, dtype="float32",
                         mode="mixed", specials=True, vocab_limit=vs + 5)  # fmt: skip
        verify_and_check(backend, rank, world, (4, 1), pad_bs=2 * world, vs=vs,
                         dtype="bfloat16", mode="top_k_top_p")  # fmt: skip
        backend.check()

    make(world, body, vocab_size=vs * world, logits_dtype="float32", max_pad_bs=2 * world)


def test_verify_real_rows_and_vocab_limit(hosts: Any) -> None:
    """bs < pad_bs as a host int (ranks without a real request included) and as a
    device scalar (read when the kernels run), vocab_limit cutting a shard."""
    make, _ = hosts
    world, vs, pad_bs = 3, 53, 6

    def body(rank: int, backend: NcclBackend, log: Any) -> None:
        for i, (bs, dev) in enumerate([(4, False), (1, False), (0, False), (5, True), (2, True)]):
            verify_and_check(backend, rank, world, (5, i), pad_bs=pad_bs, vs=vs,
                             dtype="float16", mode="mixed", bs=bs, bs_on_device=dev,
                             vocab_limit=vs * world - 30 + i, specials=True)  # fmt: skip
        backend.check()

    make(world, body, vocab_size=vs * world, logits_dtype="float16", max_pad_bs=pad_bs)


# -- ranks that disagree ---------------------------------------------------------------------
def _disagree(make: Any, world: int, change: Any) -> list[tuple[str, str]]:
    """One temperature batch where ``change(rank, cand, prm)`` alters one rank's
    arguments; every rank synchronises (a no-op here), then returns the messages of
    ``check()`` and of its next call, which must raise before launching anything."""
    vs, pad_bs = 40, 2 * world

    def body(rank: int, backend: NcclBackend, log: Any) -> tuple[str, str]:
        shards, prm = _inputs((6,), world, pad_bs, vs, "float32", "temperature", specials=False)
        cand = np.zeros((pad_bs, N), np.int32)
        change(rank, cand, prm)
        params = verify_params(pad_bs=pad_bs, num_tokens_per_req=N, vocab_size=vs * world,
                               **prm)  # fmt: skip
        x = shards[rank]
        args = (x, describe(x), cand, describe(cand))
        kw = dict(pad_bs=pad_bs, params=params, return_logprobs=False,
                  bs=RealRows.every(pad_bs), stream=None)  # fmt: skip
        backend.verify_batch_vocab(*args, **kw)
        with pytest.raises(DpSampleError) as first:
            backend.check()
        log.clear()
        with pytest.raises(DpSampleError) as again:  # sticky, and nothing moves
            backend.verify_batch_vocab(*args, **kw)
        assert log == []
        return str(first.value), str(again.value)

    return make(world, body, vocab_size=vs * world, logits_dtype="float32", max_pad_bs=2 * world)


def _owner_and_marked(msgs: list[tuple[str, str]], owner: int, odd: int) -> None:
    """``owner``'s combine saw rank ``odd``'s records differ; every other rank raises
    through the mark in ``owner``'s gather header."""
    for rank, (msg, again) in enumerate(msgs):
        assert msg == again, (msg, again)  # sticky
        assert "this communicator is now unusable" in msg
        if rank == owner:
            assert msg.startswith(
                f"rank {odd} called verify_batch_vocab(pad_bs=6, bs=6, N=3, float32) #0 with "
                "different verify_batch_vocab arguments (candidates, temperature, top_k, top_p, "
                f"min_p, seed, offset, vocab_limit or return_logprobs) than rank {owner} passed "
                f"to verify_batch_vocab(pad_bs=6, bs=6, N=3, float32) #0 (nccl backend, seen by "
                f"rank {owner})"
            ), msg
        else:
            assert msg.startswith(
                f"rank {owner} found records with different verify_batch_vocab arguments "
                "(candidates, temperature, top_k, top_p, min_p, seed, offset, vocab_limit or "
                "return_logprobs) in its verify_batch_vocab call #0 (the op before "
                "gather_verify_outputs(pad_bs=6, bs=6, N=3) #1) and marked its headers (nccl "
                f"backend, seen by rank {rank})"
            ), msg


def test_verify_different_temperature_raises_on_every_rank(hosts: Any) -> None:
    """Rank 2 passes another temperature for request 0 (owned by rank 0): the records
    carry a digest of their request's parameters, so rank 0's combine sees it; it marks
    the headers of the same call's gather, so ranks 1 and 2 raise as well."""
    make, _ = hosts

    def change(rank: int, cand: np.ndarray, prm: dict[str, Any]) -> None:
        if rank == 2:
            prm["temperature"] = prm["temperature"].copy()
            prm["temperature"][0] += 0.25

    _owner_and_marked(_disagree(make, 3, change), owner=0, odd=2)


def test_verify_different_candidate_raises_on_every_rank(hosts: Any) -> None:
    """Rank 1 passes another draft for request 5 (owned by rank 2): only rank 2's
    combine sees it, ranks 0 and 1 raise through the mark, never returning the outputs
    silently."""
    make, _ = hosts

    def change(rank: int, cand: np.ndarray, prm: dict[str, Any]) -> None:
        if rank == 1:
            cand[5, 1] = 17

    _owner_and_marked(_disagree(make, 3, change), owner=2, odd=1)


def test_verify_value_refused_by_the_kernels_is_reported(hosts: Any) -> None:
    """The kernels check every parameter again when they read it; a value the host
    validation would refuse (set behind its back here) is reported, never used."""
    make, _ = hosts
    world, vs, pad_bs = 2, 40, 4

    def body(rank: int, backend: NcclBackend, log: Any) -> str:
        shards, prm = _inputs((9,), world, pad_bs, vs, "float32", "temperature", specials=False)
        params = verify_params(pad_bs=pad_bs, num_tokens_per_req=N, vocab_size=vs * world,
                               **prm)  # fmt: skip
        params.temperature[3] = np.nan
        x, cand = shards[rank], np.zeros((pad_bs, N), np.int32)
        backend.verify_batch_vocab(
            x, describe(x), cand, describe(cand), pad_bs=pad_bs, params=params,
            return_logprobs=False, bs=RealRows.every(pad_bs), stream=None,
        )  # fmt: skip
        with pytest.raises(DpSampleError) as info:
            backend.check()
        return str(info.value)

    for rank, msg in enumerate(make(world, body, vocab_size=vs * world, logits_dtype="float32")):
        assert msg.startswith(
            f"rank {rank}: the verify kernels refused temperature of request 3 in "
            "verify_batch_vocab(pad_bs=4, bs=4, N=3, float32) #0 (expected a finite value >= 0"
        ), msg


# -- the other routes ---------------------------------------------------------------------------
def test_verify_top_p_without_top_k_takes_the_swap(
    hosts: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    make, driver = hosts
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(
        nccl_backend, "verify_by_swap", lambda *a, **k: calls.append(k) or ("swapped",)
    )
    world, vs, pad_bs = 2, 30, 4

    def body(rank: int, backend: NcclBackend, log: Any) -> None:
        shards, prm = _inputs((7,), world, pad_bs, vs, "float32", "temperature", specials=False)
        prm["top_p"] = np.array([1, 1, 0.9, 1], np.float32)  # request 2: top-p, no top-k
        params = verify_params(pad_bs=pad_bs, num_tokens_per_req=N, vocab_size=vs * world,
                               **prm)  # fmt: skip
        x, cand = shards[rank], np.zeros((pad_bs, N), np.int32)
        driver.launches().clear()
        out = backend.verify_batch_vocab(
            x, describe(x), cand, describe(cand), pad_bs=pad_bs, params=params,
            return_logprobs=True, bs=RealRows.every(pad_bs), stream=5,
        )  # fmt: skip
        assert out == ("swapped",)
        assert backend.last_verify_path == (
            "swap: request 2 has top_p=0.9 / min_p=0 without top-k, which needs the row's "
            "whole key order"
        )
        assert driver.launches() == [] and log == []

    make(world, body, vocab_size=vs * world, logits_dtype="float32")
    assert len(calls) == world
    for rank, kw in enumerate(sorted(calls, key=lambda k: k["rank"])):
        assert kw["rank"] == rank and kw["tp"] == world and kw["device"] == 0
        assert kw["pad_bs"] == pad_bs and kw["stream"] == 5 and kw["return_logprobs"]


def test_verify_refuses_cuda_graph_capture(hosts: Any) -> None:
    make, driver = hosts
    world, vs, pad_bs = 2, 30, 4

    def body(rank: int, backend: NcclBackend, log: Any) -> None:
        shards, prm = _inputs((8,), world, pad_bs, vs, "float32", "top_k", specials=False)
        params = verify_params(pad_bs=pad_bs, num_tokens_per_req=N, vocab_size=vs * world,
                               **prm)  # fmt: skip
        x, cand = shards[rank], np.zeros((pad_bs, N), np.int32)
        backend._runtime.capturing.add(9)
        driver.launches().clear()
        with pytest.raises(DpSampleError, match="verify_batch_vocab cannot be captured in a "
                           "CUDA graph in this version: it reads the per-request parameters "
                           "on the host"):  # fmt: skip
            backend.verify_batch_vocab(
                x, describe(x), cand, describe(cand), pad_bs=pad_bs, params=params,
                return_logprobs=False, bs=RealRows.every(pad_bs), stream=9,
            )  # fmt: skip
        assert driver.launches() == [] and log == [] and backend._runtime.copies == []
        backend._runtime.capturing.clear()
        # the communicator is intact: the same call outside the capture works
        verify_and_check(backend, rank, world, (8,), pad_bs=pad_bs, vs=vs, dtype="float32",
                         mode="top_k", stream=9)  # fmt: skip
        backend.check()

    make(world, body, vocab_size=vs * world, logits_dtype="float32")

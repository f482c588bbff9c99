"""NCCL backend kernels (kernels/nccl.cu) run on the CPU by the g++ emulator
(:mod:`fakes.emulator`): index math, real-row handling, header checks and the seq
bookkeeping of every kernel against the NumPy reference. test_nccl_gpu.py runs the
same kernels for real."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from fakes.emulator import Emulator, emulator

from ipc_dpsample.backends.nccl import (
    ERROR_WORDS,
    HDR_WORDS,
    format_error_block,
    packed_width,
    permute_launch,
    permute_name,
    vector_width,
)
from ipc_dpsample.backends.nccl.plan import tag_of
from ipc_dpsample.layout import (
    real_reqs,
    reference_gather_verify_outputs,
    reference_swap_batch_vocab,
)
from ipc_dpsample.protocol import Dtype, Op


@pytest.fixture(scope="module")
def emu() -> Emulator:
    return emulator()


def _addr(a: Any) -> int:
    return int(a.ctypes.data)


def _tag(op: Op, dtype: str = "int32") -> int:
    return tag_of(op, Dtype.of(dtype))


def _counter(seq: int) -> np.ndarray:
    """The op counter word (padded to 16 bytes as in the backend)."""
    return np.array([seq, -1, -1, -1], dtype=np.int32)


@pytest.mark.parametrize("device_bs", [False, True])
def test_header_kernel(emu: Emulator, device_bs: bool) -> None:
    dst = np.full(HDR_WORDS, -9, dtype=np.int32)
    scalar = np.array([5], dtype=np.int32)
    bs, bs_ptr = (8, _addr(scalar)) if device_bs else (6, 0)  # host bs is then an upper bound
    emu.launch("nccl_header", 1, 1, bs, bs_ptr, _addr(dst), _tag(Op.SWAP, "float16"), 8,
               _addr(_counter(17)))  # fmt: skip
    assert dst.tolist() == [_tag(Op.SWAP, "float16"), 8, 5 if device_bs else 6, 17]


@pytest.mark.parametrize("mismatch", [False, True])
def test_finish_kernel_checks_and_advances(emu: Emulator, mismatch: bool) -> None:
    tp, me, seq = 3, 1, 4
    mine = np.array([_tag(Op.ARGMAX, "bfloat16"), 6, 5, seq], dtype=np.int32)
    hdr_recv = np.tile(mine, (tp, 1))
    hdr_recv[me] = -1  # own slot unused
    if mismatch:
        hdr_recv[2, 2] = 6  # rank 2 passed another bs
    counter = _counter(seq)
    err = np.zeros(ERROR_WORDS, dtype=np.int32)
    emu.launch("nccl_finish", 1, 1, _addr(hdr_recv), tp, me, _addr(mine), _addr(counter),
               _addr(err), me)  # fmt: skip
    assert counter[0] == seq + 1
    if mismatch:
        assert err[:4].tolist() == [1, Op.ARGMAX, me, 2]
        msg = format_error_block(err.tolist(), n=3)
        assert "rank 2 called argmax_batch_vocab(pad_bs=6, bs=6, N=3, bfloat16) #4" in msg
    else:
        assert (err == 0).all()


PERMUTE_CASES = [
    (2, 0, 13, "float16", False),  # 26-byte rows: 2-byte vectors
    (3, 1, 64, "bfloat16", False),  # 16-byte vectors
    (4, 3, 13, "float32", False),  # 4-byte vectors
    (3, 2, 1000, "float16", True),  # own block from staging
    (2, 1, 3, "bfloat16", False),  # 6-byte rows
    (1, 0, 8, "float16", True),
]
# a single rank cannot disagree with itself: no mismatch case at tp=1
PERMUTE_MISMATCH_CASES = [
    (*c, m) for c in PERMUTE_CASES for m in (False, True) if c[0] > 1 or not m
]


@pytest.mark.parametrize(
    ("tp", "me", "vs", "dtype", "route_self", "mismatch"), PERMUTE_MISMATCH_CASES
)
@pytest.mark.parametrize("force_bytes", [False, True])
@pytest.mark.parametrize("bs_kind", ["every", "partial"])
def test_emulated_permute(
    emu: Emulator,
    tp: int,
    me: int,
    vs: int,
    dtype: str,
    route_self: bool,
    mismatch: bool,
    force_bytes: bool,
    bs_kind: str,
) -> None:
    rng = np.random.default_rng(tp * 100 + vs)
    n, r, seq = 3, 2, 41
    pad_bs, rows = r * tp, r * 3
    bs = pad_bs if bs_kind == "every" else me * r + 1  # this rank: 1 real request of 2
    bits = np.uint16 if dtype != "float32" else np.uint32
    rowbytes = vs * np.dtype(bits).itemsize
    inputs = [
        rng.integers(1, np.iinfo(bits).max, size=(pad_bs * n, vs), dtype=bits, endpoint=True)
        for _ in range(tp)
    ]
    expected = reference_swap_batch_vocab(inputs, tp=tp, num_tokens_per_req=n, pad_bs=pad_bs)[me]
    staging = np.stack([x[me * rows : (me + 1) * rows] for x in inputs])
    if not route_self:
        staging[me] = 0x5A5A  # never read
    out = np.full((rows, tp * vs), 0x7E7E, dtype=bits)
    counter = _counter(seq)
    # the header as nccl_header wrote it: bs resolved (device scalar or host value)
    mine = np.array([_tag(Op.SWAP, dtype), pad_bs, bs, seq], dtype=np.int32)
    hdr_recv = np.tile(mine, (tp, 1))
    bad = (me + 1) % tp
    if mismatch:
        hdr_recv[bad, 0] = _tag(Op.SWAP, "float16" if dtype == "bfloat16" else "bfloat16")
    err = np.zeros(ERROR_WORDS, dtype=np.int32)
    self_src = 0 if route_self else _addr(inputs[me]) + me * rows * rowbytes
    width = 1 if force_bytes else vector_width(rowbytes, _addr(out), _addr(staging), self_src)
    launch = permute_launch(rows, tp, rowbytes, width)
    emu.launch(
        permute_name(width), launch.grid, launch.block, self_src, _addr(out), _addr(staging),
        -1 if route_self else me, tp, rows, rowbytes, launch.tps_log2, r, n, _addr(hdr_recv),
        _addr(mine), _addr(counter), _addr(err), me,
    )  # fmt: skip
    real = real_reqs(r, bs, me) * n
    np.testing.assert_array_equal(out[:real], expected[:real])
    assert (out[real:] == 0x7E7E).all()  # phantom rows: not written
    assert counter[0] == seq + 1 and (counter[1:] == -1).all()
    if mismatch:
        assert err[:4].tolist() == [1, Op.SWAP, me, bad]
        assert err[4:8].tolist() == mine.tolist() and err[8:12].tolist() == hdr_recv[bad].tolist()
    else:
        assert (err == 0).all()


# a single rank cannot disagree with itself: mismatches from tp = 3, 4 only
GATHER_CASES = [(1, None)] + [
    (tp, m) for tp in (3, 4) for m in (None, "pad_bs", "op", "bs", "device_bs")
]


@pytest.mark.parametrize(("tp", "mismatch"), GATHER_CASES)
def test_emulated_pack_allgather_unpack(emu: Emulator, tp: int, mismatch: str | None) -> None:
    rng = np.random.default_rng(tp)
    n, seq, r = 4, 9, 2
    max_pad_bs, pad_bs = 4 * tp, r * tp
    bs = pad_bs - 1
    width = packed_width(max_pad_bs, tp, n)

    def ints(*shape: int) -> Any:
        return rng.integers(-(2**31), 2**31, size=shape, dtype=np.int64).astype(np.int32)

    p = [ints(r, n) for _ in range(tp)]
    a = [ints(r, n) for _ in range(tp)]
    ln = [ints(r) for _ in range(tp)]
    recv = np.full((tp, width), -7, dtype=np.int32)
    counters = [_counter(seq) for _ in range(tp)]
    scalar = np.array([bs], dtype=np.int32)
    for src in range(tp):
        odd = mismatch is not None and src == tp - 1
        op = Op.GATHER_LOGPROBS if odd and mismatch == "op" else Op.GATHER_OUTPUTS
        their_pad = pad_bs + tp if odd and mismatch == "pad_bs" else pad_bs
        their_bs, bs_ptr = bs, 0
        if odd and mismatch == "bs":
            their_bs = bs - 1
        if mismatch == "device_bs":  # every rank passes a device scalar; the odd one's differs
            their_bs, bs_ptr = pad_bs, _addr(np.array([bs - 2], np.int32) if odd else scalar)
        emu.launch(
            "nccl_pack", 1, 64, _addr(p[src]), _addr(a[src]), _addr(ln[src]), their_bs, bs_ptr,
            _addr(recv) + src * width * 4, r * n, r * n, r, _tag(op), their_pad,
            _addr(counters[src]),
        )  # fmt: skip
    assert recv[0, :HDR_WORDS].tolist() == [_tag(Op.GATHER_OUTPUTS), pad_bs, bs, seq]
    assert (recv[:, HDR_WORDS + 2 * r * n + r :] == -7).all()  # fixed width, tail unwritten
    outs = [np.full((max_pad_bs, n), -1, np.int32) for _ in range(2)]
    outs.append(np.full((max_pad_bs,), -1, np.int32))
    err = np.zeros(ERROR_WORDS, dtype=np.int32)
    counter = counters[0]
    emu.launch(
        "nccl_unpack", 2, 32, _addr(recv), width, tp, 0, _addr(outs[0]), r * n, _addr(outs[1]),
        r * n, _addr(outs[2]), r, _addr(counter), _addr(err),
    )  # fmt: skip
    for got, want in zip(outs, reference_gather_verify_outputs(p, a, ln), strict=True):
        np.testing.assert_array_equal(got[:pad_bs], want)  # every row moves, real or not
        assert (got[pad_bs:] == -1).all()
    assert counter[0] == seq + 1
    if mismatch is None:
        assert (err == 0).all()
    else:
        assert err[:4].tolist() == [1, Op.GATHER_OUTPUTS, 0, tp - 1]
        msg = format_error_block(err.tolist(), n)
        assert msg.startswith(f"rank {tp - 1} called ")
        if mismatch in ("bs", "device_bs"):
            other = bs - 1 if mismatch == "bs" else bs - 2
            assert f"gather_verify_outputs(pad_bs={pad_bs}, bs={other}, N={n})" in msg


def test_emulated_logprobs_gather_single_segment(emu: Emulator) -> None:
    tp, n, r, rmax, seq = 3, 2, 3, 3, 0
    width = packed_width(rmax * tp, tp, n)
    rng = np.random.default_rng(0)
    lp = [rng.integers(1, 2**32, size=(r, n), dtype=np.uint32, endpoint=False) for _ in range(tp)]
    recv = np.zeros((tp, width), dtype=np.int32)
    for src in range(tp):
        emu.launch(
            "nccl_pack", 3, 8, _addr(lp[src]), 0, 0, r * tp, 0, _addr(recv) + src * width * 4,
            r * n, 0, 0, _tag(Op.GATHER_LOGPROBS), r * tp, _addr(_counter(seq)),
        )  # fmt: skip
    out = np.full((rmax * tp, n), 0xFFFFFFFF, dtype=np.uint32)
    err = np.zeros(ERROR_WORDS, dtype=np.int32)
    emu.launch(
        "nccl_unpack", 1, 32, _addr(recv), width, tp, tp - 1, _addr(out), r * n, 0, 0, 0, 0,
        _addr(_counter(seq)), _addr(err),
    )  # fmt: skip
    np.testing.assert_array_equal(out, np.concatenate(lp))
    assert (err == 0).all()

"""NCCL backend on real GPUs.

* kernels alone (one GPU, no NCCL): the permute for tp = 2..4 layouts, pack ->
  simulated allGather -> unpack, and the header-mismatch reports, against the NumPy
  reference;
* a real tp=1 NCCL communicator: swap and both gathers, eager, replayed from a
  ``torch.cuda.graph`` and from a CuPy stream capture, torch and CuPy inputs; the
  same with this rank's block routed through NCCL self send/recv; real rows
  (host and device ``bs``, a captured swap replayed with a new device ``bs``);
  ``argmax_batch_vocab`` eager and replayed from a ``torch.cuda.graph`` with new
  logits and a new device ``bs``;
* one process per GPU (``run_ranks``), tp = 2 and 4: the same suite, mismatched
  calls reported on every rank, and ``auto`` choosing NCCL for a simulated
  two-host group.

Every result is compared bit-exactly with ipc_dpsample.layout on fresh random bit
patterns, outputs poisoned before each op. Run:

    PYTHONPATH=$PWD python3 -m pytest tests/test_nccl_gpu.py -v -rs
"""

from __future__ import annotations

import ctypes
import os
import struct
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from ipc_dpsample import BackendUnavailableError, DpSampleError, DpSamplingComm, ThreadGroup
from ipc_dpsample.arrays import describe
from ipc_dpsample.backends.base import RealRows
from ipc_dpsample.backends.nccl import (
    ERROR_BYTES,
    ERROR_WORDS,
    HDR_WORDS,
    NcclBackend,
    format_error_block,
    packed_width,
    permute_launch,
    permute_name,
    vector_width,
)
from ipc_dpsample.backends.nccl.geometry import NAME_EXPRESSIONS
from ipc_dpsample.backends.nccl.plan import tag_of
from ipc_dpsample.config import CommConfig
from ipc_dpsample.identity import cupy_device_count, nccl_available
from ipc_dpsample.layout import (
    real_reqs,
    reference_argmax_batch_vocab,
    reference_gather_verify_logprobs,
    reference_gather_verify_outputs,
    reference_swap_batch_vocab,
)
from ipc_dpsample.protocol import Call, Dtype, Op
from ipc_dpsample.testing import run_ranks

pytestmark = pytest.mark.gpu

OP_GATHER_OUTPUTS, OP_GATHER_LOGPROBS = int(Op.GATHER_OUTPUTS), int(Op.GATHER_LOGPROBS)
DIVERGED = r"call sequences diverged"


def swap_tag(dtype: str) -> int:
    return tag_of(Op.SWAP, Dtype.of(dtype))


_BITS = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.uint32}
_SIGNED = {np.uint16: np.int16, np.uint32: np.int32}


# -- skips ------------------------------------------------------------------------------
def _require_gpus(n: int = 1, *, nccl: bool = True) -> None:
    found = cupy_device_count()
    if found < 1:
        pytest.skip(f"needs a CUDA GPU visible to CuPy (found {found})")
    if nccl and not nccl_available():
        pytest.skip("needs cupy.cuda.nccl (libnccl could not be loaded)")
    if found < n:
        pytest.skip(f"needs {n} GPUs, found {found}")


def _require_torch_cuda() -> Any:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA (torch.cuda.is_available() is False)")
    return torch


# -- data --------------------------------------------------------------------------------
def _logit_bits(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Random nonzero bit patterns (NaN payloads and denormals included)."""
    t = _BITS[dtype]
    return rng.integers(1, np.iinfo(t).max, size=shape, dtype=t, endpoint=True)


def _int32s(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    return rng.integers(-(2**31), 2**31, size=shape, dtype=np.int64).astype(np.int32)


def _torch_dtype(dtype: str) -> Any:
    import torch

    return {
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "float32": torch.float32,
        "int32": torch.int32,
    }[dtype]


def _to_device(kind: str, bits: np.ndarray, dtype: str) -> Any:
    """A device array of ``dtype`` holding ``bits`` (uint16/uint32 patterns or int32)."""
    if kind == "torch":
        import torch

        signed = bits.view(_SIGNED.get(bits.dtype.type, bits.dtype.type))
        t = torch.from_numpy(np.ascontiguousarray(signed)).to(f"cuda:{_device()}")
        return t.view(_torch_dtype(dtype))
    import cupy

    arr = cupy.asarray(bits)
    return arr if dtype == "int32" else arr.view(np.dtype(dtype))


def _bits(x: Any) -> np.ndarray:
    """Bit pattern of a device array as uint16/uint32 (or int32 for int32 arrays)."""
    if type(x).__module__.startswith("torch"):
        import torch

        t = x.detach()
        if t.dtype in (torch.bfloat16, torch.float16):
            return t.view(torch.int16).cpu().numpy().view(np.uint16)
        if t.dtype == torch.float32:
            return t.view(torch.int32).cpu().numpy().view(np.uint32)
        return t.cpu().numpy()
    import cupy

    a = cupy.asnumpy(x)
    if a.dtype == np.float16:
        return a.view(np.uint16)
    if a.dtype == np.float32:
        return a.view(np.uint32)
    return a


def _refill(dst: Any, bits: np.ndarray) -> None:
    """Copy bit patterns into a static device input, through an integer view."""
    if type(dst).__module__.startswith("torch"):
        import torch

        signed = bits.view(_SIGNED.get(bits.dtype.type, bits.dtype.type))
        src = torch.from_numpy(np.ascontiguousarray(signed)).to(dst.device)
        dst.view(src.dtype).copy_(src)
    else:
        import cupy

        dst.view(bits.dtype)[...] = cupy.asarray(bits)


def _poison(x: Any) -> None:
    if type(x).__module__.startswith("torch"):
        x.fill_(float("nan") if x.is_floating_point() else -1)
    else:
        x.fill(np.nan if x.dtype.kind == "f" else -1)


def _ptr(x: Any) -> int:
    return int(x.data_ptr()) if type(x).__module__.startswith("torch") else int(x.data.ptr)


def _device() -> int:
    import cupy

    return int(cupy.cuda.runtime.getDevice())


def _sync() -> None:
    import cupy

    cupy.cuda.runtime.deviceSynchronize()


# -- what a communicator must do, for any rank of any tp -----------------------------------
Ops = Any  # DpSamplingComm or _BackendOps


class _BackendOps:
    """The communicator surface over a bare NcclBackend (for options the public
    constructor does not expose)."""

    def __init__(self, backend: NcclBackend):
        self.backend = backend

    def swap_batch_vocab(
        self, x: Any, *, pad_bs: int, bs: RealRows | None = None, stream: Any = None
    ) -> Any:
        return self.backend.swap_batch_vocab(x, describe(x), pad_bs=pad_bs, bs=bs, stream=stream)

    def gather_verify_outputs(
        self,
        p: Any,
        a: Any,
        ln: Any,
        *,
        pad_bs: int,
        bs: RealRows | None = None,
        stream: Any = None,
    ) -> tuple[Any, Any, Any]:
        return self.backend.gather_verify_outputs(
            p, a, ln, describe(p), pad_bs=pad_bs, bs=bs, stream=stream
        )

    def gather_verify_logprobs(
        self, lp: Any, *, pad_bs: int, bs: RealRows | None = None, stream: Any = None
    ) -> Any:
        return self.backend.gather_verify_logprobs(
            lp, describe(lp), pad_bs=pad_bs, bs=bs, stream=stream
        )

    def argmax_batch_vocab(
        self,
        x: Any,
        *,
        pad_bs: int,
        vocab_limit: int,
        bs: RealRows | None = None,
        stream: Any = None,
    ) -> tuple[Any, Any]:
        return self.backend.argmax_batch_vocab(
            x, describe(x), pad_bs=pad_bs, vocab_limit=vocab_limit, bs=bs, stream=stream
        )

    def check(self) -> None:
        self.backend.check()

    def close(self) -> None:
        self.backend.close()


class _Case:
    """One rank's view of one communicator configuration."""

    def __init__(self, rank: int, tp: int, n: int, vocab: int, dtype: str, kind: str, seed: int):
        self.rank, self.tp, self.n, self.vocab = rank, tp, n, vocab
        self.dtype, self.kind = dtype, kind
        self.rng = np.random.default_rng(seed)  # same seed on every rank: same inputs

    def swap_inputs(self, pad_bs: int) -> list[np.ndarray]:
        shape = (pad_bs * self.n, self.vocab // self.tp)
        return [_logit_bits(self.rng, shape, self.dtype) for _ in range(self.tp)]

    def swap_expected(self, inputs: list[np.ndarray], pad_bs: int) -> np.ndarray:
        return reference_swap_batch_vocab(
            inputs, tp=self.tp, num_tokens_per_req=self.n, pad_bs=pad_bs
        )[self.rank]

    def verify_inputs(self, pad_bs: int) -> tuple[list[np.ndarray], ...]:
        r, n, tp = pad_bs // self.tp, self.n, self.tp
        p = [_int32s(self.rng, (r, n)) for _ in range(tp)]
        a = [_int32s(self.rng, (r, n)) for _ in range(tp)]
        ln = [_int32s(self.rng, (r,)) for _ in range(tp)]
        lp = [_logit_bits(self.rng, (r, n), "float32") for _ in range(tp)]
        return p, a, ln, lp

    def dev(self, bits: np.ndarray, dtype: str) -> Any:
        return _to_device(self.kind, bits, dtype)


def _check_swap(ops: Ops, case: _Case, pad_bs: int, stream: Any = None) -> Any:
    inputs = case.swap_inputs(pad_bs)
    out = ops.swap_batch_vocab(
        case.dev(inputs[case.rank], case.dtype), pad_bs=pad_bs, stream=stream
    )
    _sync()
    expected = case.swap_expected(inputs, pad_bs)
    assert tuple(out.shape) == expected.shape
    np.testing.assert_array_equal(_bits(out), expected)
    return out


def _check_gathers(ops: Ops, case: _Case, pad_bs: int, stream: Any = None) -> list[Any]:
    p, a, ln, lp = case.verify_inputs(pad_bs)
    me = case.rank
    outs = ops.gather_verify_outputs(
        case.dev(p[me], "int32"),
        case.dev(a[me], "int32"),
        case.dev(ln[me], "int32"),
        pad_bs=pad_bs,
        stream=stream,
    )
    olp = ops.gather_verify_logprobs(case.dev(lp[me], "float32"), pad_bs=pad_bs, stream=stream)
    _sync()
    for got, want in zip(outs, reference_gather_verify_outputs(p, a, ln), strict=True):
        assert tuple(got.shape) == want.shape
        np.testing.assert_array_equal(_bits(got), want)
    np.testing.assert_array_equal(_bits(olp), reference_gather_verify_logprobs(lp))
    return [*outs, olp]


def _pad_sizes(max_pad_bs: int, tp: int) -> list[int]:
    """Full, smallest, a middle size, then full again (outputs reused and re-checked)."""
    mid = max(tp, max_pad_bs // 2 // tp * tp)
    return [max_pad_bs, tp, mid, max_pad_bs, tp]


def eager_suite(ops: Ops, case: _Case, max_pad_bs: int) -> None:
    """Swap and both gathers at several pad_bs, each output poisoned before it is
    produced again; the same pad_bs must give the same storage."""
    seen: dict[tuple[str, int], list[Any]] = {}
    for pad_bs in _pad_sizes(max_pad_bs, case.tp):
        for what, run in (("swap", _check_swap), ("gathers", _check_gathers)):
            before = seen.get((what, pad_bs))
            if before is not None:
                for x in before:
                    _poison(x)
                _sync()
            got = run(ops, case, pad_bs)
            got = got if isinstance(got, list) else [got]
            if before is not None:
                assert [_ptr(x) for x in got] == [_ptr(x) for x in before]
            seen[(what, pad_bs)] = got
    ops.check()


def torch_graph_suite(ops: Ops, case: _Case, pad_bs: int, replays: int = 3) -> None:
    """Capture swap + both gathers in one torch.cuda.graph; replay with new inputs
    copied into the static tensors and every output poisoned."""
    import torch

    assert case.kind == "torch"
    me = case.rank
    x = case.dev(case.swap_inputs(pad_bs)[me], case.dtype)
    p, a, ln, lp = case.verify_inputs(pad_bs)
    sp, sa, sl = (case.dev(v[me], "int32") for v in (p, a, ln))
    slp = case.dev(lp[me], "float32")

    def ops_once() -> list[Any]:
        out = ops.swap_batch_vocab(x, pad_bs=pad_bs)
        outs = ops.gather_verify_outputs(sp, sa, sl, pad_bs=pad_bs)
        olp = ops.gather_verify_logprobs(slp, pad_bs=pad_bs)
        return [out, *outs, olp]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: NCCL connections, kernel loads, views
            ops_once()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = ops_once()
    for _ in range(replays):
        inputs = case.swap_inputs(pad_bs)
        p, a, ln, lp = case.verify_inputs(pad_bs)
        _refill(x, inputs[me])
        for dst, src in ((sp, p), (sa, a), (sl, ln), (slp, lp)):
            _refill(dst, src[me])
        for o in outs:
            _poison(o)
        graph.replay()
        torch.cuda.synchronize()
        np.testing.assert_array_equal(_bits(outs[0]), case.swap_expected(inputs, pad_bs))
        for got, want in zip(outs[1:4], reference_gather_verify_outputs(p, a, ln), strict=True):
            np.testing.assert_array_equal(_bits(got), want)
        np.testing.assert_array_equal(_bits(outs[4]), reference_gather_verify_logprobs(lp))
    ops.check()
    del graph


def cupy_graph_suite(ops: Ops, case: _Case, pad_bs: int, replays: int = 3) -> None:
    """The same with CuPy arrays, captured from a non-blocking CuPy stream (the op
    gets the stream explicitly for the swap, implicitly for the gathers)."""
    import cupy

    assert case.kind == "cupy"
    me = case.rank
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        x = case.dev(case.swap_inputs(pad_bs)[me], case.dtype)
        p, a, ln, lp = case.verify_inputs(pad_bs)
        sp, sa, sl = (case.dev(v[me], "int32") for v in (p, a, ln))
        slp = case.dev(lp[me], "float32")

        def ops_once() -> list[Any]:
            out = ops.swap_batch_vocab(x, pad_bs=pad_bs, stream=stream)
            outs = ops.gather_verify_outputs(sp, sa, sl, pad_bs=pad_bs)
            olp = ops.gather_verify_logprobs(slp, pad_bs=pad_bs)
            return [out, *outs, olp]

        warm = ops_once()
        stream.synchronize()
        stream.begin_capture()
        try:
            outs = ops_once()
        finally:
            graph = stream.end_capture()
    assert [_ptr(o) for o in outs] == [_ptr(o) for o in warm]
    for _ in range(replays):
        inputs = case.swap_inputs(pad_bs)
        p, a, ln, lp = case.verify_inputs(pad_bs)
        with stream:
            _refill(x, inputs[me])
            for dst, src in ((sp, p), (sa, a), (sl, ln), (slp, lp)):
                _refill(dst, src[me])
            for o in outs:
                _poison(o)
        graph.launch(stream=stream)
        stream.synchronize()
        np.testing.assert_array_equal(_bits(outs[0]), case.swap_expected(inputs, pad_bs))
        for got, want in zip(outs[1:4], reference_gather_verify_outputs(p, a, ln), strict=True):
            np.testing.assert_array_equal(_bits(got), want)
        np.testing.assert_array_equal(_bits(outs[4]), reference_gather_verify_logprobs(lp))
    ops.check()


def _full_suite(ops: Ops, case: _Case, max_pad_bs: int) -> None:
    eager_suite(ops, case, max_pad_bs)
    if case.kind == "torch":
        torch_graph_suite(ops, case, max_pad_bs)
        torch_graph_suite(ops, case, case.tp)
    else:
        cupy_graph_suite(ops, case, max_pad_bs)


def _comm(
    tp: int, rank: int, group: Any, *, device: int, dtype: str | None, vocab: int, **kw: Any
) -> DpSamplingComm:
    kw.setdefault("backend", "nccl")
    kw.setdefault("max_pad_bs", 4 * tp)
    kw.setdefault("num_tokens_per_req", 3)
    return DpSamplingComm(
        tp_size=tp,
        rank=rank,
        group=group,
        vocab_size=vocab,
        logits_dtype=dtype,
        device=device,
        timeout_s=60.0,
        **kw,
    )


# -- kernels alone (one GPU, no NCCL) --------------------------------------------------------
class _Kernels:
    """The backend's kernels driven by hand, with every buffer a CuPy array."""

    def __init__(self) -> None:
        import cupy

        from ipc_dpsample.kernel_cache import get_kernel

        self.cupy = cupy
        self.get = lambda name: get_kernel(
            "nccl.cu", name, _device(), name_expressions=NAME_EXPRESSIONS
        )

    def counter(self, seq: int) -> Any:
        """The op counter word (+ padding)."""
        return self.cupy.asarray(np.array([seq, -1, -1, -1], dtype=np.int32))


@pytest.mark.parametrize(
    ("tp", "me", "vs", "dtype", "route_self"),
    [
        (2, 0, 13, "float16", False),  # 26-byte rows: 2-byte vectors
        (3, 1, 64, "bfloat16", False),  # 128-byte rows: 16-byte vectors
        (4, 3, 13, "float32", False),  # 52-byte rows: 4-byte vectors
        (3, 2, 1000, "float16", True),  # own block from staging
        (2, 1, 3, "bfloat16", False),  # 6-byte rows
    ],
)
@pytest.mark.parametrize("mismatch", [False, True])
def test_permute_kernel_layout_and_header_check(
    tp: int, me: int, vs: int, dtype: str, route_self: bool, mismatch: bool
) -> None:
    _require_gpus(nccl=False)
    k = _Kernels()
    cupy = k.cupy
    rng = np.random.default_rng(7 + tp + vs)
    n, r, seq = 3, 2, 41
    pad_bs = r * tp
    rows = r * n
    itemsize = np.dtype(_BITS[dtype]).itemsize
    rowbytes = vs * itemsize
    inputs = [_logit_bits(rng, (pad_bs * n, vs), dtype) for _ in range(tp)]
    expected = reference_swap_batch_vocab(inputs, tp=tp, num_tokens_per_req=n, pad_bs=pad_bs)[me]
    staging_np = np.stack([x[me * rows : (me + 1) * rows] for x in inputs])
    if not route_self:
        staging_np[me] = 0x5A5A  # never read
    staging = cupy.asarray(staging_np)
    x = cupy.asarray(inputs[me])
    out = cupy.full((rows, tp * vs), 0x7E7E, dtype=_BITS[dtype])
    counter = k.counter(seq)
    my_hdr_np = np.array([swap_tag(dtype), pad_bs, pad_bs, seq], dtype=np.int32)
    my_hdr = cupy.asarray(my_hdr_np)
    hdr_recv_np = np.tile(my_hdr_np, (tp, 1))
    bad = (me + 1) % tp
    if mismatch:
        other = "float16" if dtype == "bfloat16" else "bfloat16"
        hdr_recv_np[bad, 0] = swap_tag(other)
    hdr_recv = cupy.asarray(hdr_recv_np)
    err = cupy.zeros(ERROR_WORDS, dtype=cupy.int32)
    self_rank = -1 if route_self else me
    self_src = 0 if route_self else x.data.ptr + me * rows * rowbytes
    width = vector_width(rowbytes, out.data.ptr, staging.data.ptr, self_src)
    launch = permute_launch(rows, tp, rowbytes, width)
    k.get(permute_name(width))(
        (launch.grid,),
        (launch.block,),
        (
            self_src,
            out.data.ptr,
            staging.data.ptr,
            self_rank,
            tp,
            rows,
            rowbytes,
            launch.tps_log2,
            r,
            n,
            hdr_recv.data.ptr,
            my_hdr.data.ptr,
            counter.data.ptr,
            err.data.ptr,
            me,
        ),
    )
    _sync()
    np.testing.assert_array_equal(cupy.asnumpy(out), expected)
    assert cupy.asnumpy(counter).tolist() == [seq + 1, -1, -1, -1]
    words = cupy.asnumpy(err).tolist()
    if mismatch:
        assert words[:4] == [1, 1, me, bad]
        assert words[4:8] == my_hdr_np.tolist()
        assert words[8:12] == hdr_recv_np[bad].tolist()
        msg = format_error_block(words, n)
        assert f"rank {bad} called swap_batch_vocab(pad_bs={pad_bs}, bs={pad_bs}" in msg
        assert f"seen by rank {me})" in msg
    else:
        assert words == [0] * ERROR_WORDS


@pytest.mark.parametrize(("tp", "mismatch"), [(1, None), (3, None), (3, "pad_bs"), (3, "op")])
def test_pack_allgather_unpack_kernels(tp: int, mismatch: str | None) -> None:
    """Pack on every simulated rank, lay the slots side by side as allGather would,
    unpack on rank 0, compare with the reference; a peer with another pad_bs or op
    is reported (and, W being fixed, nothing is read out of bounds)."""
    _require_gpus(nccl=False)
    k = _Kernels()
    cupy = k.cupy
    rng = np.random.default_rng(11 + tp)
    n, max_pad_bs, seq = 4, 4 * tp, 9
    pad_bs = 2 * tp
    r = pad_bs // tp
    width = packed_width(max_pad_bs, tp, n)
    p = [_int32s(rng, (r, n)) for _ in range(tp)]
    a = [_int32s(rng, (r, n)) for _ in range(tp)]
    ln = [_int32s(rng, (r,)) for _ in range(tp)]
    recv = cupy.full((tp, width), -7, dtype=cupy.int32)
    counters = [k.counter(seq) for _ in range(tp)]
    for src in range(tp):
        dp, da, dl = (cupy.asarray(v[src]) for v in (p, a, ln))
        their_pad = pad_bs + tp if (mismatch == "pad_bs" and src == tp - 1) else pad_bs
        op = OP_GATHER_LOGPROBS if (mismatch == "op" and src == tp - 1) else OP_GATHER_OUTPUTS
        k.get("nccl_pack")(
            (1,),
            (256,),
            (
                dp.data.ptr,
                da.data.ptr,
                dl.data.ptr,
                their_pad,
                0,
                recv.data.ptr + src * width * 4,
                r * n,
                r * n,
                r,
                op,
                their_pad,
                counters[src].data.ptr,
            ),
        )
    _sync()
    slots = cupy.asnumpy(recv)
    assert slots[0, :HDR_WORDS].tolist() == [OP_GATHER_OUTPUTS, pad_bs, pad_bs, seq]
    body = slots[0, HDR_WORDS:]
    np.testing.assert_array_equal(body[: r * n], p[0].reshape(-1))
    np.testing.assert_array_equal(body[r * n : 2 * r * n], a[0].reshape(-1))
    np.testing.assert_array_equal(body[2 * r * n : 2 * r * n + r], ln[0])
    assert (body[2 * r * n + r :] == -7).all()  # the tail of the fixed width is not written

    outs = [cupy.full(shape, -1, dtype=cupy.int32) for shape in ((max_pad_bs, n),) * 2]
    outs.append(cupy.full((max_pad_bs,), -1, dtype=cupy.int32))
    err = cupy.zeros(ERROR_WORDS, dtype=cupy.int32)
    counter = counters[0]
    per = 2 * r * n + r
    k.get("nccl_unpack")(
        (max(1, -(-tp * per // 256)),),
        (256,),
        (
            recv.data.ptr,
            width,
            tp,
            0,
            outs[0].data.ptr,
            r * n,
            outs[1].data.ptr,
            r * n,
            outs[2].data.ptr,
            r,
            counter.data.ptr,
            err.data.ptr,
        ),
    )
    _sync()
    for got, want in zip(outs, reference_gather_verify_outputs(p, a, ln), strict=True):
        np.testing.assert_array_equal(cupy.asnumpy(got)[:pad_bs], want)
        assert (cupy.asnumpy(got)[pad_bs:] == -1).all()
    assert int(cupy.asnumpy(counter)[0]) == seq + 1
    words = cupy.asnumpy(err).tolist()
    if mismatch is None:
        assert words == [0] * ERROR_WORDS
    else:
        assert words[:4] == [1, OP_GATHER_OUTPUTS, 0, tp - 1]
        msg = format_error_block(words, n)
        assert "seen by rank 0)" in msg
        if mismatch == "pad_bs":
            assert f"rank {tp - 1} called gather_verify_outputs(pad_bs={pad_bs + tp}," in msg
        else:
            assert f"rank {tp - 1} called gather_verify_logprobs(pad_bs={pad_bs}," in msg


# -- a real tp=1 NCCL communicator ------------------------------------------------------------
TP1_CASES = [
    ("torch", "bfloat16", 13),  # 26-byte rows
    ("torch", "bfloat16", 64),  # 16-byte vectors
    ("torch", "float16", 1000),
    ("torch", "float32", 13),
    ("torch", "bfloat16", 19008),  # V/tp of a 152k vocab at tp=8
    ("cupy", "float16", 13),
    ("cupy", "float32", 1000),
]


@pytest.mark.parametrize(("kind", "dtype", "vocab"), TP1_CASES)
def test_tp1_communicator(kind: str, dtype: str, vocab: int) -> None:
    _require_gpus()
    if kind == "torch":
        _require_torch_cuda()
    comm = _comm(1, 0, ThreadGroup.create(1)[0], device=0, dtype=dtype, vocab=vocab, max_pad_bs=8)
    try:
        assert comm.backend == "nccl", comm.explain()
        _full_suite(comm, _Case(0, 1, 3, vocab, dtype, kind, seed=vocab), 8)
    finally:
        comm.close()


@pytest.mark.parametrize(
    ("kind", "dtype", "vocab"),
    [("torch", "bfloat16", 13), ("cupy", "float16", 64), ("torch", "float32", 1000)],
)
def test_tp1_routed_through_nccl_self_send_recv(kind: str, dtype: str, vocab: int) -> None:
    """This rank's block goes through ncclSend/ncclRecv to itself and the staging
    buffer: on one GPU, the whole multi-rank data path, eager and captured."""
    _require_gpus()
    if kind == "torch":
        _require_torch_cuda()
    cfg = CommConfig(
        tp_size=1,
        rank=0,
        max_pad_bs=8,
        num_tokens_per_req=2,
        vocab_size=vocab,
        logits_dtype=dtype,
        backend="nccl",
    )
    ops = _BackendOps(NcclBackend(cfg, ThreadGroup.create(1)[0], 0, route_self_through_nccl=True))
    try:
        _full_suite(ops, _Case(0, 1, 2, vocab, dtype, kind, seed=3 * vocab), 8)
    finally:
        ops.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_tp1_lazy_dtype_is_fixed_by_the_first_swap(dtype: str) -> None:
    """TokenSpeed semantics on NCCL: logits_dtype=None, the first swap fixes the
    dtype, a later prepare is a no-op, another dtype raises naming both."""
    _require_gpus()
    _require_torch_cuda()
    from ipc_dpsample import DtypeMismatchError

    comm = _comm(1, 0, ThreadGroup.create(1)[0], device=0, dtype=None, vocab=40, max_pad_bs=4)
    try:
        assert comm.logits_dtype is None
        case = _Case(0, 1, 3, 40, dtype, "torch", seed=5)
        out = _check_swap(comm, case, 4)
        assert str(out.dtype) == f"torch.{dtype}" and comm.logits_dtype == dtype
        comm.prepare_verify_outputs("float32" if dtype != "float32" else "float16")
        assert comm.logits_dtype == dtype
        other = "float32" if dtype != "float32" else "bfloat16"
        with pytest.raises(DtypeMismatchError, match=rf"{other} != .*{dtype}"):
            _check_swap(comm, _Case(0, 1, 3, 40, other, "torch", seed=6), 4)
        _check_swap(comm, _Case(0, 1, 3, 40, dtype, "torch", seed=7), 4)
        comm.check()
    finally:
        comm.close()


def test_tp1_reported_error_is_raised_by_check_and_every_later_call() -> None:
    """The host path of a kernel-reported mismatch: the block is host memory the
    kernels write; check() and the next op raise, and keep raising."""
    _require_gpus()
    comm = _comm(1, 0, ThreadGroup.create(1)[0], device=0, dtype="float32", vocab=8)
    try:
        backend = comm._backend
        assert isinstance(backend, NcclBackend)
        comm.check()
        mine = Call(Op.GATHER_OUTPUTS, Dtype.INT32, 4, bs=4, seq=2).header()
        theirs = Call(Op.GATHER_LOGPROBS, Dtype.INT32, 4, bs=4, seq=2).header()
        words = [1, OP_GATHER_OUTPUTS, 0, 1, *mine, *theirs]
        ctypes.memmove(
            backend._err_host, struct.pack(f"<{ERROR_WORDS}i", *words, 0, 0, 0, 0), ERROR_BYTES
        )
        pattern = r"rank 1 called gather_verify_logprobs\(pad_bs=4, bs=4, N=3\) #2 while rank 0"
        with pytest.raises(DpSampleError, match=pattern):
            comm.check()
        import cupy

        case = _Case(0, 1, 3, 8, "float32", "cupy", seed=1)
        with pytest.raises(DpSampleError, match=pattern):
            _check_swap(comm, case, 4)
        lp = cupy.ones((4, 3), dtype=cupy.float32)
        with pytest.raises(DpSampleError, match=pattern):
            comm.gather_verify_logprobs(lp, pad_bs=4)
    finally:
        comm.close()
    assert not comm.is_open


def test_tp1_close_is_idempotent_and_views_outlive_it() -> None:
    _require_gpus()
    comm = _comm(1, 0, ThreadGroup.create(1)[0], device=0, dtype="float16", vocab=16)
    case = _Case(0, 1, 3, 16, "float16", "cupy", seed=2)
    out = _check_swap(comm, case, 4)
    before = _bits(out)
    comm.close()
    comm.close()
    np.testing.assert_array_equal(_bits(out), before)  # the view keeps its buffer alive
    with pytest.raises(DpSampleError, match=r"closed"):
        comm.check()


# -- real rows (bs) and argmax on a real tp=1 NCCL communicator ------------------------------
def _tp1_backend(vocab: int, dtype: str, route_self: bool, max_pad_bs: int = 8) -> _BackendOps:
    cfg = CommConfig(
        tp_size=1,
        rank=0,
        max_pad_bs=max_pad_bs,
        num_tokens_per_req=3,
        vocab_size=vocab,
        logits_dtype=dtype,
        backend="nccl",
    )
    group = ThreadGroup.create(1)[0]
    return _BackendOps(NcclBackend(cfg, group, 0, route_self_through_nccl=route_self))


def _device_scalar(kind: str, value: int) -> tuple[Any, int]:
    """An int32 device scalar holding ``value`` and its address."""
    bits = np.array([value], dtype=np.int32)
    s = _to_device(kind, bits, "int32")
    return s, _ptr(s)


def _set_scalar(s: Any, value: int) -> None:
    _refill(s, np.array([value], dtype=np.int32))


def _real_rows(pad_bs: int, value: int | None, n: int = 3) -> int:
    return real_reqs(pad_bs, value, 0) * n  # tp=1: this rank owns every request


@pytest.mark.parametrize(
    ("kind", "dtype", "vocab"), [("torch", "bfloat16", 13), ("cupy", "float32", 64)]
)
@pytest.mark.parametrize("route_self", [False, True])
def test_tp1_bs_host_and_device(kind: str, dtype: str, vocab: int, route_self: bool) -> None:
    """Host bs 0, 1, 3, 8 and a device scalar changed between calls: the real rows of
    the swap equal the reference, the gathers every row."""
    _require_gpus()
    if kind == "torch":
        _require_torch_cuda()
    ops = _tp1_backend(vocab, dtype, route_self)
    try:
        case = _Case(0, 1, 3, vocab, dtype, kind, seed=17)
        pad_bs = 8
        scalar, ptr = _device_scalar(kind, 0)
        plans: list[tuple[RealRows, int]] = [(RealRows(v, 0, True), v) for v in (0, 1, 3, 8)]
        plans += [(RealRows(pad_bs, ptr, True), v) for v in (5, 0, 8, 2)]
        for rows, value in plans:
            _set_scalar(scalar, value)
            _sync()
            inputs = case.swap_inputs(pad_bs)
            out = ops.swap_batch_vocab(case.dev(inputs[0], dtype), pad_bs=pad_bs, bs=rows)
            _sync()
            real = _real_rows(pad_bs, value)
            np.testing.assert_array_equal(
                _bits(out)[:real], case.swap_expected(inputs, pad_bs)[:real]
            )
            _poison(out)
            p, a, ln, lp = case.verify_inputs(pad_bs)
            outs = ops.gather_verify_outputs(
                case.dev(p[0], "int32"),
                case.dev(a[0], "int32"),
                case.dev(ln[0], "int32"),
                pad_bs=pad_bs,
                bs=rows,
            )
            olp = ops.gather_verify_logprobs(case.dev(lp[0], "float32"), pad_bs=pad_bs, bs=rows)
            _sync()
            for got, want in zip(outs, reference_gather_verify_outputs(p, a, ln), strict=True):
                np.testing.assert_array_equal(_bits(got), want)
            np.testing.assert_array_equal(_bits(olp), reference_gather_verify_logprobs(lp))
        ops.check()
    finally:
        ops.close()


def _argmax_input(kind: str, rng: np.random.Generator, rows: int, vocab: int, dtype: str) -> Any:
    """Random logits on the device (a tie, a NaN and an all -inf row included)."""
    vals = rng.standard_normal((rows, vocab)).astype(np.float32) * 4
    vals[0, :] = -1.0
    vals[0, vocab // 2] = vals[0, vocab - 1] = 7.0
    vals[1, -1] = np.nan
    if rows > 2:
        vals[2, :] = -np.inf
    if kind == "torch":
        import torch

        return torch.from_numpy(vals).to(f"cuda:{_device()}").to(_torch_dtype(dtype))
    import cupy

    return cupy.asarray(vals).astype(np.dtype(dtype))


def _argmax_reference_input(x: Any, dtype: str) -> np.ndarray:
    """What reference_argmax_batch_vocab reads: bfloat16 as uint16 bits, else floats."""
    bits = _bits(x)
    if dtype == "bfloat16":
        return bits
    return bits.view(np.float16) if dtype == "float16" else bits.view(np.float32)


def _check_argmax(
    ids: Any, lps: Any, x: Any, dtype: str, pad_bs: int, limit: int, value: int | None
) -> None:
    want_ids, want_lps = reference_argmax_batch_vocab(
        [_argmax_reference_input(x, dtype)],
        tp=1,
        num_tokens_per_req=3,
        pad_bs=pad_bs,
        dtype=dtype,
        vocab_limit=limit,
    )[0]
    real = _real_rows(pad_bs, value)
    assert tuple(ids.shape) == (pad_bs * 3,) and tuple(lps.shape) == (pad_bs * 3,)
    np.testing.assert_array_equal(_bits(ids)[:real], want_ids[:real])
    got = _bits(lps).view(np.float32)[:real]
    np.testing.assert_allclose(got, want_lps[:real], atol=1e-5, rtol=0, equal_nan=True)


ARGMAX_CASES = [
    ("torch", "bfloat16", 1000, False),
    ("torch", "float16", 13, True),
    ("torch", "float32", 19008, False),
    ("cupy", "float32", 64, False),
    ("cupy", "float16", 999, True),
]


@pytest.mark.parametrize(("kind", "dtype", "vocab", "route_self"), ARGMAX_CASES)
def test_tp1_argmax_eager(kind: str, dtype: str, vocab: int, route_self: bool) -> None:
    _require_gpus()
    if kind == "torch":
        _require_torch_cuda()
    ops = _tp1_backend(vocab, dtype, route_self)
    rng = np.random.default_rng(vocab)
    try:
        scalar, ptr = _device_scalar(kind, 0)
        steps = [
            (8, vocab, RealRows(8, 0, False), None),
            (4, vocab - 3, RealRows(3, 0, True), 3),
            (8, 1, RealRows(0, 0, True), 0),
            (8, vocab // 2, RealRows(8, ptr, True), 5),
            (2, vocab, RealRows(2, ptr, True), 1),
        ]
        for pad_bs, limit, rows, value in steps:
            if rows.on_device:
                _set_scalar(scalar, value)
            x = _argmax_input(kind, rng, pad_bs * 3, vocab, dtype)
            _sync()
            ids, lps = ops.argmax_batch_vocab(x, pad_bs=pad_bs, vocab_limit=limit, bs=rows)
            _sync()
            _check_argmax(ids, lps, x, dtype, pad_bs, limit, value)
            _poison(ids)
            _poison(lps)
        ops.check()
    finally:
        ops.close()


@pytest.mark.parametrize("route_self", [False, True])
def test_tp1_argmax_torch_graph_replays_new_values_and_bs(route_self: bool) -> None:
    """argmax_batch_vocab (device bs) captured in a torch.cuda.graph, replayed with new
    logits and a new bs written into the static tensors."""
    _require_gpus()
    torch = _require_torch_cuda()
    vocab, dtype, pad_bs, limit = 1000, "bfloat16", 8, 997
    ops = _tp1_backend(vocab, dtype, route_self)
    rng = np.random.default_rng(3)
    try:
        x = _argmax_input("torch", rng, pad_bs * 3, vocab, dtype)
        scalar, ptr = _device_scalar("torch", pad_bs)
        rows = RealRows(pad_bs, ptr, True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: plans, views, NCCL
                ops.argmax_batch_vocab(x, pad_bs=pad_bs, vocab_limit=limit, bs=rows)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ids, lps = ops.argmax_batch_vocab(x, pad_bs=pad_bs, vocab_limit=limit, bs=rows)
        for value in (8, 5, 1, 0, 7):
            x.copy_(_argmax_input("torch", rng, pad_bs * 3, vocab, dtype))
            scalar.fill_(value)
            _poison(ids)
            _poison(lps)
            graph.replay()
            torch.cuda.synchronize()
            _check_argmax(ids, lps, x, dtype, pad_bs, limit, value)
            real = _real_rows(pad_bs, value)
            assert (_bits(ids)[real:] == -1).all()  # phantom rows: not written
        ops.check()
        del graph
    finally:
        ops.close()


def test_tp1_swap_cupy_graph_with_device_bs() -> None:
    """swap_batch_vocab with a device bs captured from a CuPy stream; replays see the
    scalar's new value (real rows right, phantom rows not written)."""
    _require_gpus()
    import cupy

    vocab, dtype, pad_bs = 64, "float16", 8
    ops = _tp1_backend(vocab, dtype, route_self=True)
    case = _Case(0, 1, 3, vocab, dtype, "cupy", seed=9)
    try:
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            x = case.dev(case.swap_inputs(pad_bs)[0], dtype)
            scalar, ptr = _device_scalar("cupy", pad_bs)
            rows = RealRows(pad_bs, ptr, True)
            ops.swap_batch_vocab(x, pad_bs=pad_bs, bs=rows, stream=stream)
            stream.synchronize()
            stream.begin_capture()
            try:
                out = ops.swap_batch_vocab(x, pad_bs=pad_bs, bs=rows, stream=stream)
            finally:
                graph = stream.end_capture()
        for value in (8, 3, 0, 6):
            inputs = case.swap_inputs(pad_bs)
            with stream:
                _refill(x, inputs[0])
                _set_scalar(scalar, value)
                _poison(out)
            graph.launch(stream=stream)
            stream.synchronize()
            real = _real_rows(pad_bs, value)
            got = _bits(out)
            np.testing.assert_array_equal(got[:real], case.swap_expected(inputs, pad_bs)[:real])
            assert (got[real:] == _bits(cupy.full((1,), np.nan, dtype=np.float16))[0]).all()
        ops.check()
        # NCCL keeps a communicator until every graph that captured its ops is
        # destroyed: with `graph` alive, close() must return (bounded, warning) and
        # the destroy finish once the graph goes (it hung close() on the H200)
        t0 = time.monotonic()
        with pytest.warns(RuntimeWarning, match="still held by CUDA graphs"):
            ops.close()
        assert time.monotonic() - t0 < 10
        pending = ops.backend.pending_destroy
        assert pending is not None
        del graph
        pending.join(30)
        assert not pending.is_alive(), "the NCCL destroy did not finish after the graph went"
    finally:
        ops.close()


def test_tp1_argmax_rejects_vocab_limit_and_mismatch_is_sticky() -> None:
    """vocab_limit outside 1..V raises before anything runs; a kernel-reported error
    (here written by hand) makes argmax raise too."""
    _require_gpus()
    import cupy

    ops = _tp1_backend(16, "float32", False)
    try:
        x = cupy.zeros((4 * 3, 16), dtype=cupy.float32)
        with pytest.raises(ValueError, match=r"vocab_limit=17; expected 1 <= vocab_limit <= V=16"):
            ops.argmax_batch_vocab(x, pad_bs=4, vocab_limit=17)
        mine = Call(Op.ARGMAX, Dtype.FLOAT32, 4, bs=4, seq=0).header()
        theirs = Call(Op.ARGMAX, Dtype.FLOAT32, 4, bs=3, seq=0).header()
        words = [1, int(Op.ARGMAX), 0, 1, *mine, *theirs, 0, 0, 0, 0]
        ctypes.memmove(ops.backend._err_host, struct.pack(f"<{ERROR_WORDS}i", *words), ERROR_BYTES)
        with pytest.raises(
            DpSampleError, match=r"rank 1 called argmax_batch_vocab\(pad_bs=4, bs=3"
        ):
            ops.argmax_batch_vocab(x, pad_bs=4, vocab_limit=16)
    finally:
        ops.close()


# -- one process per GPU -------------------------------------------------------------------------
def _rank_device(rank: int) -> int:
    import cupy

    local = int(os.environ.get("LOCAL_RANK", rank))
    dev = local % cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(dev).use()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.set_device(dev)
    except ImportError:
        pass
    return dev


def rank_suite_body(rank: int, world: int, group: Any, kind: str, dtype: str, vs: int) -> str:
    os.environ.pop("IPC_DPSAMPLE_BACKEND", None)
    dev = _rank_device(rank)
    vocab = vs * world
    comm = _comm(world, rank, group, device=dev, dtype=dtype, vocab=vocab)
    try:
        assert comm.backend == "nccl", comm.explain()
        _full_suite(comm, _Case(rank, world, 3, vocab, dtype, kind, seed=100 + vs), 4 * world)
        return comm.explain()
    finally:
        comm.close()


def _run(world: int, body: Callable[..., Any], *args: Any) -> list[Any]:
    _require_gpus(world)
    return run_ranks(world, body, *args, timeout_s=400.0)


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    ("kind", "dtype", "vs"),
    [("torch", "bfloat16", 13), ("torch", "float32", 1000), ("cupy", "float16", 64)],
)
def test_multirank_suite(world: int, kind: str, dtype: str, vs: int) -> None:
    _require_gpus(world)
    if kind == "torch":
        _require_torch_cuda()
    results = _run(world, rank_suite_body, kind, dtype, vs)
    assert all(r.startswith("nccl: requested explicitly") for r in results), results


def gather_mismatch_body(rank: int, world: int, group: Any, what: str) -> str:
    """Rank 0 disagrees (another gather, or another pad_bs); every rank must raise."""
    import cupy

    os.environ.pop("IPC_DPSAMPLE_BACKEND", None)
    dev = _rank_device(rank)
    comm = _comm(world, rank, group, device=dev, dtype="float32", vocab=2 * world)
    try:
        pad_bs = 2 * world
        if what == "pad_bs" and rank == 0:
            pad_bs = world
        r, n = pad_bs // world, 3
        ints = cupy.arange(r * n, dtype=cupy.int32).reshape(r, n) + 1
        if what == "op" and rank == 0:
            comm.gather_verify_logprobs(ints.astype(cupy.float32), pad_bs=pad_bs)
        else:
            comm.gather_verify_outputs(ints, ints + 1, ints[:, 0].copy(), pad_bs=pad_bs)
        _sync()
        with pytest.raises(DpSampleError, match=DIVERGED) as info:
            comm.check()
        # sticky, and raised before any NCCL call (so no rank can hang in the next op)
        with pytest.raises(DpSampleError, match=DIVERGED):
            comm.gather_verify_logprobs(ints.astype(cupy.float32), pad_bs=pad_bs)
        return str(info.value)
    finally:
        comm.close()


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("what", ["op", "pad_bs"])
def test_multirank_gather_mismatch_raises_on_every_rank(world: int, what: str) -> None:
    msgs = _run(world, gather_mismatch_body, what)
    for rank, msg in enumerate(msgs):
        assert f"seen by rank {rank})" in msg, msg
        if what == "op":
            assert "gather_verify_logprobs" in msg and "gather_verify_outputs" in msg
        else:
            assert f"pad_bs={world}," in msg and f"pad_bs={2 * world}," in msg


def swap_dtype_mismatch_body(rank: int, world: int, group: Any) -> str:
    """Rank 0 swaps bfloat16, the others float16: same byte count, so NCCL completes
    and the swap headers must expose it on every rank."""
    import torch

    os.environ.pop("IPC_DPSAMPLE_BACKEND", None)
    dev = _rank_device(rank)
    comm = _comm(world, rank, group, device=dev, dtype=None, vocab=8 * world)
    try:
        dtype = "bfloat16" if rank == 0 else "float16"
        comm.prepare_verify_outputs(dtype)
        pad_bs = world
        x = torch.ones(pad_bs * 3, 8, dtype=_torch_dtype(dtype), device=f"cuda:{dev}")
        comm.swap_batch_vocab(x, pad_bs=pad_bs)
        torch.cuda.synchronize()
        with pytest.raises(DpSampleError, match=r"rank \d+ called swap_batch_vocab") as info:
            comm.check()
        return str(info.value)
    finally:
        comm.close()


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 4])
def test_multirank_swap_dtype_mismatch_raises_on_every_rank(world: int) -> None:
    _require_gpus(world)
    _require_torch_cuda()
    msgs = _run(world, swap_dtype_mismatch_body)
    for rank, msg in enumerate(msgs):
        assert f"seen by rank {rank})" in msg
        assert "bfloat16" in msg and "float16" in msg


def auto_two_hosts_body(rank: int, world: int, group: Any) -> str:
    """Ranks claim different hosts (IPC_DPSAMPLE_HOST_ID): auto must pick NCCL."""
    os.environ.pop("IPC_DPSAMPLE_BACKEND", None)
    os.environ["IPC_DPSAMPLE_HOST_ID"] = f"simulated-host-{rank}"
    dev = _rank_device(rank)
    comm = _comm(world, rank, group, device=dev, dtype="float16", vocab=16 * world, backend="auto")
    try:
        assert comm.backend == "nccl", comm.explain()
        case = _Case(rank, world, 3, 16 * world, "float16", "cupy", seed=77)
        _check_swap(comm, case, 2 * world)
        _check_gathers(comm, case, 2 * world)
        comm.check()
        return comm.explain()
    finally:
        comm.close()


@pytest.mark.multirank
def test_auto_picks_nccl_for_a_simulated_two_host_group() -> None:
    reasons = _run(2, auto_two_hosts_body)
    for reason in reasons:
        assert reason.startswith("nccl: ") and "2 hosts" in reason, reason


def auto_two_hosts_one_gpu_body(rank: int, world: int, group: Any) -> str:
    """Two ranks on one GPU that claim different hosts: auto picks NCCL for the
    right reason, and NCCL's refusal of two ranks on one GPU is reported with it."""
    os.environ.pop("IPC_DPSAMPLE_BACKEND", None)
    os.environ["IPC_DPSAMPLE_HOST_ID"] = f"simulated-host-{rank}"
    try:
        comm = _comm(
            world, rank, group, device=0, dtype="float16", vocab=16 * world, backend="auto"
        )
    except BackendUnavailableError as exc:
        return str(exc)
    comm.close()
    raise AssertionError("two ranks on one GPU built a NCCL communicator")


@pytest.mark.multirank
def test_auto_picks_nccl_for_a_simulated_two_host_group_on_one_gpu() -> None:
    """The one-GPU form of the test above (NCCL itself needs one GPU per rank)."""
    _require_gpus(1)
    _require_torch_cuda()
    msgs = run_ranks(
        2,
        auto_two_hosts_one_gpu_body,
        timeout_s=300.0,
        env={"IPC_DPSAMPLE_TEST_PG_BACKEND": "gloo"},
    )
    for msg in msgs:
        assert "backend='auto' chose nccl" in msg, msg
        assert "2 hosts" in msg, msg
        assert "own GPU" in msg, msg

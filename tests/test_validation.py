"""Every validation error path of the public API: ValueError naming the expected value,
TypeError for wrong dtypes, devices and array types; a valid call right after a
rejected one works. Lifecycle: close() idempotent, closed communicators refuse ops,
``__del__`` only warns."""

from __future__ import annotations

import gc
import re
import warnings
from typing import Any

import _bodies
import numpy as np
import pytest
import torch

from ipc_dpsample import DpSampleError, DpSamplingComm
from ipc_dpsample.comm import DtypeMismatchError
from ipc_dpsample.testing import run_ranks

# make_comm's defaults: tp=1, max_pad_bs=6, N=2, V=5, float32
N, V, MAX = 2, 5, 6


def _logits(pad_bs: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return _bodies.random_logits((pad_bs, 1), (pad_bs * N, V), "float32").to(dtype)


def _i32(*shape: int) -> torch.Tensor:
    return _bodies.random_int32((sum(shape), 2), shape)


def _lp(r: int) -> torch.Tensor:
    return _bodies.random_logprobs((r, 3), (r, N))


def _valid_calls_work(comm: Any, pad_bs: int = 4) -> None:
    """Every op, valid, right after a rejection: tp=1 outputs equal the inputs."""
    bits = _bodies.bits
    x = _logits(pad_bs, _bodies.TORCH_DTYPES[comm.logits_dtype])
    assert np.array_equal(bits(comm.swap_batch_vocab(x, pad_bs=pad_bs)), bits(x))
    p, a, ln = _i32(pad_bs, N), _i32(pad_bs, N), _i32(pad_bs)
    outs = comm.gather_verify_outputs(p, a, ln, pad_bs=pad_bs)
    for got, want in zip(outs, (p, a, ln), strict=True):
        assert np.array_equal(bits(got), bits(want))
    lp = _lp(pad_bs)
    assert np.array_equal(bits(comm.gather_verify_logprobs(lp, pad_bs=pad_bs)), bits(lp))


# -- constructor -----------------------------------------------------------------------
VALID: dict[str, Any] = {
    "tp_size": 1,
    "rank": 0,
    "max_pad_bs": MAX,
    "num_tokens_per_req": N,
    "vocab_size": V,
    "logits_dtype": "float32",
    "device": "cpu",
    "group": None,
    "backend": "auto",
    "timeout_s": 30.0,
}


@pytest.mark.parametrize(
    ("kw", "exc", "pattern"),
    [
        ({"num_tokens_per_req": 0}, ValueError, r"num_tokens_per_req=0 must be >= 1"),
        # the group's size is checked before the values that depend on tp_size
        ({"tp_size": 2, "vocab_size": 5}, ValueError, r"tp_size=2 != the group's size 1"),
        ({"tp_size": 2, "max_pad_bs": 5}, ValueError, r"tp_size=2 != the group's size 1"),
        ({"vocab_size": 0}, ValueError, r"vocab_size=0 must be a positive multiple of tp_size=1"),
        ({"rank": 1}, ValueError, r"rank=1 out of range: expected 0 <= rank < 1"),
        ({"rank": -1}, ValueError, r"rank=-1 out of range"),
        ({"tp_size": 2, "vocab_size": 6}, ValueError, r"tp_size=2 != the group's size 1"),
        ({"logits_dtype": "float64"}, TypeError, r"unsupported dtype 'float64'"),
        ({"logits_dtype": torch.int64}, TypeError, r"unsupported dtype torch\.int64"),
        ({"logits_dtype": "int32"}, ValueError, r"logits_dtype='int32'; expected one of"),
        ({"backend": "gloo"}, ValueError, r"backend='gloo'; expected one of"),
        ({"device": "meta"}, ValueError, r"device='meta'; expected"),
        ({"device": -1}, ValueError, r"device=-1 must be >= 0"),
        ({"device": True}, TypeError, r"device=True"),
        ({"group": "world"}, TypeError, r"unsupported group 'world'"),
        ({"group": (0, 0)}, ValueError, r"must be distinct"),
        ({"group": (3,)}, ValueError, r"not in group \(3,\)"),
        ({"timeout_s": 0}, ValueError, r"timeout_s=0.0 must be > 0"),
    ],
)
def test_constructor_rejects(world1: None, kw: dict, exc: type, pattern: str) -> None:
    args = {**VALID, **kw}
    with pytest.raises(exc, match=pattern):
        DpSamplingComm(**args)
    args = {**args, **VALID}
    with DpSamplingComm(**args) as comm:  # a valid construction right after works
        _valid_calls_work(comm)


def test_cuda_device_without_cuda_raises_a_clear_error(world1: None) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here; this checks the CPU-only error path")
    with pytest.raises((ValueError, DpSampleError), match=r"(?i)cuda"):
        DpSamplingComm(
            tp_size=1, rank=0, max_pad_bs=MAX, num_tokens_per_req=N, vocab_size=V,
            logits_dtype="float32", device="cuda:0",
        )  # fmt: skip


# -- pad_bs ----------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["swap", "outputs", "logprobs"])
@pytest.mark.parametrize("pad_bs", [0, -1, MAX + 1, 100])
def test_pad_bs_out_of_range(make_comm: Any, op: str, pad_bs: int) -> None:
    comm = make_comm()
    ok = 4  # arrays sized for a valid pad_bs
    call = {
        "swap": lambda: comm.swap_batch_vocab(_logits(ok), pad_bs=pad_bs),
        "outputs": lambda: comm.gather_verify_outputs(
            _i32(ok, N), _i32(ok, N), _i32(ok), pad_bs=pad_bs
        ),
        "logprobs": lambda: comm.gather_verify_logprobs(_lp(ok), pad_bs=pad_bs),
    }[op]
    with pytest.raises(ValueError, match=rf"pad_bs={pad_bs} out of range.*max_pad_bs={MAX}"):
        call()
    _valid_calls_work(comm)


@pytest.mark.parametrize("pad_bs", [4.0, "4", None, True, np.float32(4)])
def test_pad_bs_must_be_int(make_comm: Any, pad_bs: Any) -> None:
    comm = make_comm()
    with pytest.raises(TypeError, match=r"pad_bs must be an int"):
        comm.swap_batch_vocab(_logits(4), pad_bs=pad_bs)
    _valid_calls_work(comm)


@pytest.mark.parametrize("pad_bs", [np.int32(4), np.int64(4), torch.tensor(4).numpy()[()]])
def test_pad_bs_accepts_any_integral(make_comm: Any, pad_bs: Any) -> None:
    comm = make_comm()
    x = _logits(4)
    assert np.array_equal(_bodies.bits(comm.swap_batch_vocab(x, pad_bs=pad_bs)), _bodies.bits(x))
    lp = _lp(4)
    out = comm.gather_verify_logprobs(lp, pad_bs=pad_bs)
    assert np.array_equal(_bodies.bits(out), _bodies.bits(lp))


# -- shapes ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        ((8, 4), "(8, 5)"),
        ((7, 5), "(8, 5)"),
        ((40,), "(8, 5)"),
        ((8, 5, 1), "(8, 5)"),
        ((), "(8, 5)"),
    ],
)
def test_swap_wrong_shape(make_comm: Any, shape: tuple, expected: str) -> None:
    comm = make_comm()
    with pytest.raises(ValueError) as info:
        comm.swap_batch_vocab(torch.ones(shape), pad_bs=4)
    msg = str(info.value)
    assert f"local_logits shape {tuple(shape)} != expected {expected}" in msg
    assert "N=2" in msg and "V/tp=5" in msg
    _valid_calls_work(comm)


@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("delta", [(1, 0), (-1, 0), (0, 1), "flat"])
def test_gather_outputs_wrong_shape(make_comm: Any, which: int, delta: Any) -> None:
    comm = make_comm()
    args = [_i32(4, N), _i32(4, N), _i32(4)]
    names = ("predict_local", "accept_index_local", "accept_length_local")
    want = [(4, N), (4, N), (4,)][which]
    if delta == "flat":
        bad = args[which].reshape(-1, 1)
    elif which == 2:
        bad = _i32(4 + delta[0] + delta[1])
    else:
        bad = _i32(4 + delta[0], N + delta[1])
    args[which] = bad
    with pytest.raises(
        ValueError, match=re.escape(f"{names[which]} shape {tuple(bad.shape)} != expected {want}")
    ):
        comm.gather_verify_outputs(*args, pad_bs=4)
    _valid_calls_work(comm)


@pytest.mark.parametrize("shape", [(4, 3), (3, 2), (8,), (2, 4)])
def test_logprobs_wrong_shape(make_comm: Any, shape: tuple) -> None:
    comm = make_comm()
    with pytest.raises(
        ValueError, match=re.escape(f"logprobs_local shape {shape} != expected (4, 2)")
    ):
        comm.gather_verify_logprobs(torch.ones(shape), pad_bs=4)
    _valid_calls_work(comm)


# -- dtypes ----------------------------------------------------------------------------
@pytest.mark.parametrize("comm_dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int32, torch.int16]
)
def test_swap_wrong_dtype(make_comm: Any, comm_dtype: str, dtype: torch.dtype) -> None:
    comm = make_comm(logits_dtype=comm_dtype)
    x = torch.ones(8, V, dtype=dtype)
    if _bodies.TORCH_DTYPES[comm_dtype] == dtype:
        assert comm.swap_batch_vocab(x, pad_bs=4).dtype == dtype
        return
    if dtype in (torch.bfloat16, torch.float16, torch.float32):
        # another logits dtype: a RuntimeError (TokenSpeed) that is also a TypeError,
        # naming both dtypes
        with pytest.raises(DtypeMismatchError, match=rf"dtype \w+ != .*logits dtype {comm_dtype}"):
            comm.swap_batch_vocab(x, pad_bs=4)
    else:
        with pytest.raises(TypeError, match=rf"local_logits dtype \w+ != expected {comm_dtype}"):
            comm.swap_batch_vocab(x, pad_bs=4)
    assert issubclass(DtypeMismatchError, RuntimeError) and issubclass(
        DtypeMismatchError, TypeError
    )
    _valid_calls_work(comm)


@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize(
    "dtype", [torch.int64, torch.int16, torch.uint8, torch.float32, torch.uint32]
)
def test_gather_outputs_wrong_dtype(make_comm: Any, which: int, dtype: torch.dtype) -> None:
    comm = make_comm()
    args = [_i32(4, N), _i32(4, N), _i32(4)]
    args[which] = args[which].to(dtype)
    names = ("predict_local", "accept_index_local", "accept_length_local")
    with pytest.raises(TypeError, match=rf"{names[which]} dtype \w+ != expected int32"):
        comm.gather_verify_outputs(*args, pad_bs=4)
    _valid_calls_work(comm)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.int32])
def test_logprobs_wrong_dtype(make_comm: Any, dtype: torch.dtype) -> None:
    comm = make_comm()
    with pytest.raises(TypeError, match=r"logprobs_local dtype \w+ != expected float32"):
        comm.gather_verify_logprobs(torch.ones(4, N, dtype=dtype), pad_bs=4)
    _valid_calls_work(comm)


def test_numpy_big_endian_is_a_dtype_error(make_comm: Any) -> None:
    comm = make_comm()
    with pytest.raises(TypeError, match=r"local_logits"):
        comm.swap_batch_vocab(np.ones((8, V), dtype=">f4"), pad_bs=4)
    with pytest.raises(TypeError, match=r"predict_local"):
        big = np.ones((4, N), dtype=">i4")
        comm.gather_verify_outputs(big, big, np.ones(4, dtype=">i4"), pad_bs=4)
    _valid_calls_work(comm)


# -- devices and array types -------------------------------------------------------------
class _FakeDeviceArray:
    """Looks like a CUDA array (``__cuda_array_interface__``) of the right shape."""

    def __init__(self, shape: tuple, typestr: str = "<f4"):
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (0x10000, False),
            "version": 3,
            "strides": None,
        }


def test_cuda_array_on_cpu_communicator(make_comm: Any) -> None:
    comm = make_comm()
    with pytest.raises(TypeError, match=r"local_logits is on cuda:0; expected cpu"):
        comm.swap_batch_vocab(_FakeDeviceArray((8, V)), pad_bs=4)
    fake = _FakeDeviceArray((4, N), "<i4")
    with pytest.raises(TypeError, match=r"predict_local is on cuda:0; expected cpu"):
        comm.gather_verify_outputs(fake, fake, _FakeDeviceArray((4,), "<i4"), pad_bs=4)
    with pytest.raises(TypeError, match=r"logprobs_local is on cuda:0; expected cpu"):
        comm.gather_verify_logprobs(_FakeDeviceArray((4, N)), pad_bs=4)
    _valid_calls_work(comm)


def test_meta_tensor_is_a_device_error(make_comm: Any) -> None:
    comm = make_comm()
    with pytest.raises(TypeError, match=r"local_logits\b.*\bmeta\b"):
        comm.swap_batch_vocab(torch.ones(8, V, device="meta"), pad_bs=4)
    meta = torch.ones(4, N, dtype=torch.int32, device="meta")
    with pytest.raises(TypeError, match=r"predict_local\b.*\bmeta\b"):
        comm.gather_verify_outputs(meta, meta, meta[:, 0], pad_bs=4)
    with pytest.raises(TypeError, match=r"logprobs_local\b.*\bmeta\b"):
        comm.gather_verify_logprobs(torch.ones(4, N, device="meta"), pad_bs=4)
    _valid_calls_work(comm)


@pytest.mark.parametrize(
    "make",
    [
        lambda: [[1.0] * V] * 8,
        lambda: None,
        lambda: 3.0,
        lambda: "logits",
        lambda: memoryview(bytes(160)),
    ],
    ids=["list", "None", "float", "str", "memoryview"],
)
def test_non_array_is_a_type_error_naming_the_argument(make_comm: Any, make: Any) -> None:
    comm = make_comm()
    with pytest.raises(TypeError, match=r"local_logits.*unsupported array type"):
        comm.swap_batch_vocab(make(), pad_bs=4)
    with pytest.raises(TypeError, match=r"accept_index_local.*unsupported array type"):
        comm.gather_verify_outputs(_i32(4, N), make(), _i32(4), pad_bs=4)
    with pytest.raises(TypeError, match=r"logprobs_local.*unsupported array type"):
        comm.gather_verify_logprobs(make(), pad_bs=4)
    _valid_calls_work(comm)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.ones(8, V).to_sparse(),
        lambda: torch.ones(8, V).to_sparse_csr(),
        lambda: torch.nested.nested_tensor([torch.ones(4, V), torch.ones(4, V)]),
    ],
    ids=["sparse_coo", "sparse_csr", "nested"],
)
def test_non_strided_tensor_is_a_type_error(make_comm: Any, make: Any) -> None:
    comm = make_comm()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that sparse/nested are prototypes
        x = make()
    with pytest.raises(TypeError, match=r"local_logits"):
        comm.swap_batch_vocab(x, pad_bs=4)
    _valid_calls_work(comm)


def test_malformed_cuda_array_interface_is_a_type_error(make_comm: Any) -> None:
    comm = make_comm()
    bad = _FakeDeviceArray((8, V))
    del bad.__cuda_array_interface__["typestr"]
    with pytest.raises(TypeError, match=r"local_logits"):
        comm.swap_batch_vocab(bad, pad_bs=4)
    _valid_calls_work(comm)


def test_mixed_array_types_in_gather(make_comm: Any) -> None:
    comm = make_comm()
    with pytest.raises(TypeError, match=r"accept_index_local is a torch array; expected numpy"):
        comm.gather_verify_outputs(_i32(4, N).numpy(), _i32(4, N), _i32(4).numpy(), pad_bs=4)
    with pytest.raises(TypeError, match=r"accept_length_local is a numpy array; expected torch"):
        comm.gather_verify_outputs(_i32(4, N), _i32(4, N), _i32(4).numpy(), pad_bs=4)
    _valid_calls_work(comm)


# -- contiguity and valid oddities ---------------------------------------------------------
@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.ones(V, 8).t(),
        lambda: torch.ones(16, V)[::2],
        lambda: torch.ones(8, 2 * V)[:, ::2],
        lambda: torch.ones(V).expand(8, V),
        lambda: np.ones((16, V), np.float32)[::2],
        lambda: np.ones((8, V), np.float32)[::-1],
        lambda: np.asfortranarray(np.ones((8, V), np.float32)),
    ],
)
def test_non_contiguous_is_a_value_error(make_comm: Any, make: Any) -> None:
    comm = make_comm()
    x = make()
    assert tuple(x.shape) == (8, V)
    with pytest.raises(ValueError, match=r"local_logits must be C-contiguous"):
        comm.swap_batch_vocab(x, pad_bs=4)
    _valid_calls_work(comm)


@pytest.mark.parametrize(
    "make",
    [
        lambda x: x.clone().requires_grad_(True),
        lambda x: torch.nn.Parameter(x.clone()),
        lambda x: torch.cat([torch.ones(3, V), x])[3:],  # storage offset
        lambda x: x.numpy().copy(),
        lambda x: np.concatenate([np.ones((3, V), np.float32), x.numpy()])[3:],
    ],
    ids=["requires_grad", "parameter", "offset_tensor", "numpy", "offset_numpy"],
)
def test_unusual_but_valid_inputs_work(make_comm: Any, make: Any) -> None:
    comm = make_comm()
    base = _logits(4)
    out = comm.swap_batch_vocab(make(base), pad_bs=4)
    assert np.array_equal(_bodies.bits(out), _bodies.bits(base))


# -- prepare_verify_outputs ------------------------------------------------------------------
def test_prepare_verify_outputs(make_comm: Any) -> None:
    """TokenSpeed semantics: with logits_dtype=None the first dtype wins, whoever
    fixes it (prepare or the first swap); later prepares are no-ops."""
    comm = make_comm(logits_dtype=None)
    for bad, exc in (("int32", TypeError), (torch.float64, TypeError), (None, TypeError)):
        with pytest.raises(exc, match="dtype"):
            comm.prepare_verify_outputs(bad)
    assert comm.logits_dtype is None
    comm.prepare_verify_outputs(torch.bfloat16)
    for dtype in ("fp16", np.float32, "float16", torch.float32):
        comm.prepare_verify_outputs(dtype)  # no-op: bfloat16 was first
        assert comm.logits_dtype == "bfloat16"
        _valid_calls_work(comm)
    with pytest.raises(DtypeMismatchError, match=r"float32 != .*bfloat16"):
        comm.swap_batch_vocab(torch.ones(8, V), pad_bs=4)

    fixed = make_comm(logits_dtype="float16")
    fixed.prepare_verify_outputs("float32")  # no-op: the constructor fixed float16
    assert fixed.logits_dtype == "float16"
    _valid_calls_work(fixed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_first_swap_fixes_a_lazy_dtype(make_comm: Any, dtype: torch.dtype) -> None:
    comm = make_comm(logits_dtype=None)
    x = torch.randn(8, V).to(dtype)
    assert np.array_equal(_bodies.bits(comm.swap_batch_vocab(x, pad_bs=4)), _bodies.bits(x))
    assert comm.logits_dtype == str(dtype).removeprefix("torch.")
    comm.prepare_verify_outputs("float32" if dtype != torch.float32 else "float16")  # no-op
    assert comm.logits_dtype == str(dtype).removeprefix("torch.")
    other = torch.float32 if dtype != torch.float32 else torch.bfloat16
    with pytest.raises(DtypeMismatchError) as info:
        comm.swap_batch_vocab(x.to(other), pad_bs=4)
    assert str(other).removeprefix("torch.") in str(info.value)
    assert str(dtype).removeprefix("torch.") in str(info.value)
    _valid_calls_work(comm)


def test_non_contiguous_logprobs_are_accepted(make_comm: Any) -> None:
    comm = make_comm()
    lp = torch.randn(N, 4).t()  # [4, N], not contiguous
    assert not lp.is_contiguous()
    assert np.array_equal(_bodies.bits(comm.gather_verify_logprobs(lp, pad_bs=4)), _bodies.bits(lp))
    with pytest.raises(ValueError, match="C-contiguous"):  # the other ops keep the check
        comm.gather_verify_outputs(_i32(4, N).t().contiguous().t(), _i32(4, N), _i32(4), pad_bs=4)


# -- lifecycle ---------------------------------------------------------------------------
def test_close_is_idempotent_and_closed_comm_refuses_ops(make_comm: Any) -> None:
    comm = make_comm()
    assert comm.is_open
    assert not comm.is_initialized  # TokenSpeed's meaning: no one-sided state on the CPU
    assert "open" in repr(comm)
    comm.close()
    comm.close()
    assert not comm.is_open
    assert "closed" in repr(comm)
    i32 = _i32(4, N)
    for call in (
        lambda: comm.swap_batch_vocab(_logits(4), pad_bs=4),
        lambda: comm.gather_verify_outputs(i32, i32, _i32(4), pad_bs=4),
        lambda: comm.gather_verify_logprobs(_lp(4), pad_bs=4),
        lambda: comm.prepare_verify_outputs("float32"),
        comm.check,
    ):
        with pytest.raises(DpSampleError, match="closed"):
            call()


def test_context_manager_closes(make_comm: Any) -> None:
    with make_comm() as comm:
        _valid_calls_work(comm)
    assert not comm.is_open
    with pytest.raises(DpSampleError, match="closed"):
        comm.gather_verify_logprobs(_lp(4), pad_bs=4)


def test_del_of_open_comm_only_warns(world1: None) -> None:
    comm = DpSamplingComm(
        tp_size=1, rank=0, max_pad_bs=MAX, num_tokens_per_req=N, vocab_size=V, device="cpu"
    )
    with pytest.warns(ResourceWarning, match="not closed"):
        del comm
        gc.collect()


def test_del_of_closed_comm_is_silent(world1: None) -> None:
    comm = DpSamplingComm(
        tp_size=1, rank=0, max_pad_bs=MAX, num_tokens_per_req=N, vocab_size=V, device="cpu"
    )
    comm.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del comm
        gc.collect()


def test_check_on_open_comm_passes(make_comm: Any) -> None:
    comm = make_comm()
    comm.check()
    assert comm.explain().startswith("torch: ")
    assert comm.backend == "torch" and not comm.fast_path_enabled
    assert comm.device == "cpu" and comm.max_pad_bs == MAX


# -- at tp > 1 ---------------------------------------------------------------------------
def test_validation_at_tp2_pad_bs_multiple_and_shapes() -> None:
    """pad_bs % tp, shapes and dtypes at tp=2 (spawned ranks); both ranks draw the same
    bad cases, and a valid collective call follows each one."""
    results = run_ranks(2, _bodies.validation_tp, 7, 150)
    assert results, "no rank ran"
    for done in results:
        assert done >= 150


@pytest.mark.filterwarnings("ignore:.*nested tensors.*:UserWarning")
def test_torch_fast_info_agrees_with_describe() -> None:
    """The hot-path check accepts exactly the valid tensors it recognises, with the
    same ArrayInfo that describe() gives, and declines (None) everything else."""
    import torch

    from ipc_dpsample.arrays import describe, torch_fast_info

    base = torch.arange(24, dtype=torch.int32).reshape(6, 4)
    describe(base)  # the type is known from here on (the fast path needs that)
    ok = torch_fast_info(base, (6, 4), "int32", -1)
    assert ok is not None and ok == describe(base)
    assert isinstance(ok.shape, tuple) and ok.ptr == base.data_ptr()
    declined = {
        "shape": torch_fast_info(base, (4, 6), "int32", -1),
        "dtype": torch_fast_info(base, (6, 4), "float32", -1),
        "device": torch_fast_info(base, (6, 4), "int32", 0),
        "strided": torch_fast_info(base.t(), (4, 6), "int32", -1),
        "sliced": torch_fast_info(base[:, :2], (6, 2), "int32", -1),
        "sparse": torch_fast_info(base.to_sparse(), (6, 4), "int32", -1),
        "nested": torch_fast_info(
            torch.nested.nested_tensor([base[0], base[1, :2]]), (6, 4), "int32", -1
        ),
        "numpy": torch_fast_info(base.numpy(), (6, 4), "int32", -1),
        "unknown dtype name": torch_fast_info(base, (6, 4), "no_such_dtype", -1),
    }
    assert all(v is None for v in declined.values()), declined


# -- stream (issue 23, point 6) ------------------------------------------------------------
class _LocalCollectives:
    """A tp=1 ``fallback_comm_backend``: every collective is a local copy."""

    def all_gather_into_tensor(self, output: Any, input: Any, group: Any) -> None:
        output.copy_(input)

    def all_to_all_single(self, output: Any, input: Any, group: Any) -> None:
        output.copy_(input)


def _op_call(comm: Any, op: str, stream: Any) -> Any:
    pad_bs = 4
    if op == "swap":
        return comm.swap_batch_vocab(_logits(pad_bs), pad_bs=pad_bs, stream=stream)
    if op == "argmax":
        return comm.argmax_batch_vocab(_logits(pad_bs), pad_bs=pad_bs, stream=stream)
    if op == "gather_outputs":
        p, a, ln = _i32(pad_bs, N), _i32(pad_bs, N), _i32(pad_bs)
        return comm.gather_verify_outputs(p, a, ln, pad_bs=pad_bs, stream=stream)
    return comm.gather_verify_logprobs(_lp(pad_bs), pad_bs=pad_bs, stream=stream)


class _FakeCudaStream:
    cuda_stream = 0x1234


OPS = ["swap", "argmax", "gather_outputs", "gather_logprobs"]
CPU_BAD_STREAMS = ["x", b"x", 0, 7, True, 1.5, object(), _FakeCudaStream()]


@pytest.mark.parametrize("fallback", [False, True], ids=["torch", "fallback_comm_backend"])
@pytest.mark.parametrize("op", OPS)
def test_stream_on_cpu_must_be_none(make_comm: Any, op: str, fallback: bool) -> None:
    """On CPU data only ``stream=None`` is accepted: anything else (a str, an int, a
    CUDA stream object...) raises TypeError naming the value, its type and what is
    expected, before anything moves; the next valid call works."""
    kw = {"fallback_comm_backend": _LocalCollectives()} if fallback else {}
    comm = make_comm(**kw)
    for bad in CPU_BAD_STREAMS:
        with pytest.raises(TypeError) as info:
            _op_call(comm, op, bad)
        msg = str(info.value)
        assert msg.startswith(f"stream={bad!r} ("), msg
        assert type(bad).__qualname__ in msg and "expected None" in msg, msg
    _op_call(comm, op, None)
    _valid_calls_work(comm)


BAD_STREAMS = ["x", b"", "0x1234", True, False, 1.5, -1, object(), [0]]


@pytest.mark.parametrize("stream", BAD_STREAMS, ids=repr)
def test_resolve_stream_rejects_what_is_no_stream(stream: Any) -> None:
    """The GPU backends resolve ``stream`` first in every op (onesided, nccl, torch on
    CUDA): a str, bool, float, negative int or attribute-less object is a TypeError
    naming the value and its type, and no CUDA call happens (this runs without a GPU);
    ``check_stream_type`` (the fallback path on CUDA) agrees."""
    from ipc_dpsample.arrays import ArrayKind, check_stream_type, resolve_stream

    for kind in ArrayKind:
        with pytest.raises(TypeError) as info:
            resolve_stream(kind, stream, 0)
        msg = str(info.value)
        assert msg.startswith(f"stream={stream!r} (") and type(stream).__qualname__ in msg, msg
        assert "expected None, a torch or CuPy stream" in msg, msg
    with pytest.raises(TypeError, match=re.escape(f"stream={stream!r} (")):
        check_stream_type(stream)


def test_resolve_stream_accepts_every_documented_form() -> None:
    from ipc_dpsample.arrays import ArrayKind, StreamHandle, check_stream_type, resolve_stream

    class CupyLike:
        ptr = 0x55

    class NumbaLike:
        handle = 0x66

    forms = [(0, 0), (0x77, 0x77), (_FakeCudaStream(), 0x1234), (CupyLike(), 0x55)]
    forms += [(StreamHandle(0x99), 0x99), (NumbaLike(), 0x66)]
    for stream, handle in forms:
        assert resolve_stream(ArrayKind.TORCH, stream, 0) == handle
        check_stream_type(stream)
    assert resolve_stream(ArrayKind.NUMBA, None, 0) == 0
    check_stream_type(None)

"""Bad-input fuzzing of every public method with hypothesis (tp=1 communicators over a
world of one, torch backend on the CPU).

Each example carries at most one fault (an array of the wrong kind, dtype, device,
layout, shape or strides, a bad ``pad_bs``, a bad constructor argument) so the exact
outcome is known: a valid call must return the right data; a faulty one must raise
ValueError or TypeError whose message names the argument (and the expected value
where there is one). After every example a valid call must still work. The examples
executed are counted: together they must be at least 1000.
"""

from __future__ import annotations

import collections
import math
import os
import warnings
from typing import Any

import _bodies
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipc_dpsample import BackendUnavailableError, DpSamplingComm

MAX, N, V = 6, 2, 5  # max_pad_bs, num_tokens_per_req, vocab_size of the fuzzed comms
BUDGET = {"swap": 350, "outputs": 300, "logprobs": 200, "prepare": 100, "ctor": 150}
EXECUTED: collections.Counter[str] = collections.Counter()


def _fuzz(name: str) -> settings:
    return settings(
        max_examples=BUDGET[name],
        deadline=None,
        database=None,  # nothing written into the work tree
        derandomize=bool(os.environ.get("CI")),  # CI runs the same cases every time
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


TORCH_DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]
NUMPY_DTYPES = ["<f2", "<f4", "<f8", "<i4", "<i8", "<u4", "|b1", ">f4", ">i4", ">f2"]


def _values(draw: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    """A contiguous array of ``shape``: random, never-zero data of ``dtype``."""
    seed = draw(st.integers(0, 2**31 - 1))
    x = _bodies.random_logits((seed,), shape, "float32")
    if isinstance(dtype, torch.dtype):
        if dtype == torch.bool:
            return x > 0
        if not dtype.is_floating_point and not dtype.is_complex:
            return _bodies.random_int32((seed,), shape).to(dtype)
        return x.to(dtype)
    np_dtype = np.dtype(dtype)
    if np_dtype.kind in "iu":
        return _bodies.random_int32((seed,), shape).numpy().astype(np_dtype)
    return x.numpy().astype(np_dtype)


class _FakeDeviceArray:
    def __init__(self, shape: tuple[int, ...], typestr: str, drop: str | None = None):
        cai = {
            "shape": shape,
            "typestr": typestr,
            "data": (0x10000, False),
            "version": 3,
            "strides": None,
        }
        if drop:
            del cai[drop]
        self.__cuda_array_interface__ = cai


_TYPESTR = {"float32": "<f4", "int32": "<i4", "float16": "<f2", "bfloat16": "<u2"}
_TORCH_OF = {"float32": torch.float32, "int32": torch.int32, "bfloat16": torch.bfloat16}


@st.composite
def _array(
    draw: Any, shape: tuple[int, ...], dtype: str, fault: str | None, kind: str
) -> tuple[Any, str]:
    """An array of ``kind`` ("torch"/"numpy") for one argument: valid when ``fault`` is
    None, else broken in that one respect. Returns the array and its kind ("-": none)."""
    if dtype == "bfloat16":
        kind = "torch"  # NumPy has no bfloat16
    good_dtype: Any = _TORCH_OF[dtype] if kind == "torch" else np.dtype(_TYPESTR[dtype])
    if fault is None:
        x = _values(draw, shape, good_dtype)
        how = draw(st.sampled_from(["plain", "offset", "requires_grad"]))
        if how == "offset":
            big = _values(draw, (3 + (shape[0] if shape else 1), *shape[1:]), good_dtype)
            big[3:] = x
            x = big[3:]
        elif how == "requires_grad" and kind == "torch" and x.dtype.is_floating_point:
            x = x.clone().requires_grad_(True)
        return x, kind
    if fault == "kind":
        shape_list = np.zeros(shape).tolist()
        return draw(
            st.sampled_from(
                [None, 3, 2.5, "array", b"\0" * 8, shape_list, tuple(shape_list), {"a": 1}]
            )
        ), "-"
    if fault == "dtype":
        if kind == "torch":
            bad = draw(st.sampled_from([d for d in TORCH_DTYPES if d != good_dtype]))
        else:
            bad = np.dtype(draw(st.sampled_from([d for d in NUMPY_DTYPES if d != good_dtype])))
        return _values(draw, shape, bad), kind
    if fault == "device":
        if draw(st.booleans()):
            return torch.ones(shape, dtype=_TORCH_OF[dtype], device="meta"), "torch"
        return _FakeDeviceArray(shape, _TYPESTR[dtype]), "-"
    if fault == "layout":
        which = draw(st.sampled_from(["sparse", "sparse_csr", "nested", "cai_no_typestr"]))
        if which == "cai_no_typestr":
            return _FakeDeviceArray(shape, _TYPESTR[dtype], drop="typestr"), "-"
        dense = torch.ones(shape if len(shape) == 2 else (*shape, 1), dtype=torch.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if which == "sparse":
                return dense.to_sparse(), "torch"
            if which == "sparse_csr":
                return dense.to_sparse_csr(), "torch"
            return torch.nested.nested_tensor([dense, dense]), "torch"
    if fault == "shape":
        ndim = draw(st.integers(0, 3))
        bad = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
        if bad == shape:
            bad = (*shape, 1)
        return _values(draw, bad, good_dtype), kind
    assert fault == "strides"
    how = draw(st.sampled_from(["transpose", "step", "expand", "reverse", "fortran"]))
    if len(shape) == 1 or how == "step":
        big = _values(draw, (shape[0] * 2, *shape[1:]), good_dtype)
        return big[::2], kind
    if how == "transpose" or (kind == "numpy" and how == "expand"):
        t = _values(draw, (shape[1], shape[0]), good_dtype)
        return t.T if kind == "numpy" else t.t(), kind
    if how == "expand":
        return _values(draw, (1, shape[1]), good_dtype).expand(*shape), kind
    if how == "reverse" and kind == "numpy":
        return _values(draw, shape, good_dtype)[::-1], kind
    if kind == "numpy":
        return np.asfortranarray(_values(draw, shape, good_dtype)), kind
    return _values(draw, (shape[1], shape[0]), good_dtype).t(), kind


ARRAY_FAULTS = ["kind", "dtype", "device", "layout", "shape", "strides"]
PAD_FAULTS = ["pad_bs_range", "pad_bs_type"]


@st.composite
def _case(draw: Any, shapes: Any, dtypes: tuple[str, ...]) -> dict[str, Any]:
    """One call: ``shapes(pad_bs)`` gives the expected shape of each argument."""
    fault = draw(st.sampled_from([None, None, *ARRAY_FAULTS, *PAD_FAULTS, "mixed"]))
    if fault == "mixed" and len(dtypes) < 2:
        fault = None
    lo = 2 if fault == "strides" else 1  # a length-1 axis is contiguous whatever its stride
    pad_bs = draw(st.integers(lo, MAX))
    expected = shapes(pad_bs)
    target = draw(st.integers(0, len(expected) - 1))
    kind = draw(st.sampled_from(["torch", "numpy"]))  # one array type for all arguments
    arrays = []
    for i, (shape, dtype) in enumerate(zip(expected, dtypes, strict=True)):
        f = fault if (i == target and fault in ARRAY_FAULTS) else None
        arrays.append(draw(_array(shape, dtype, f, kind))[0])
    if fault == "mixed":
        # one argument of another array type than the first
        target = draw(st.integers(1, len(expected) - 1))
        t = arrays[target]
        arrays[target] = t.detach().numpy() if isinstance(t, torch.Tensor) else torch.from_numpy(t)
    call_pad_bs: Any = pad_bs
    if fault == "pad_bs_range":
        call_pad_bs = draw(st.one_of(st.integers(-10, 0), st.integers(MAX + 1, 10**9)))
    elif fault == "pad_bs_type":
        call_pad_bs = draw(
            st.sampled_from(
                [float(pad_bs), str(pad_bs), None, True, np.float64(pad_bs), [pad_bs], 1j]
            )
        )
    return {
        "fault": fault,
        "target": target,
        "arrays": arrays,
        "pad_bs": call_pad_bs,
        "expected_shapes": expected,
    }


def _expect(case: dict[str, Any], names: tuple[str, ...], dtypes: tuple[str, ...], call: Any):
    """Run ``call`` and check the outcome the single fault dictates; returns the result."""
    fault = case["fault"]
    if fault is None:
        return call()
    if fault in PAD_FAULTS:
        exc_type, needles = (
            (ValueError, ["pad_bs", f"max_pad_bs={MAX}"])
            if fault == "pad_bs_range"
            else (TypeError, ["pad_bs"])
        )
    else:
        name = names[case["target"]]
        exc_type = {
            "kind": TypeError,
            "dtype": TypeError,
            "device": TypeError,
            "layout": TypeError,
            "mixed": TypeError,
            "shape": ValueError,
            "strides": ValueError,
        }[fault]
        needles = [name]
        if fault == "dtype":
            needles.append(dtypes[case["target"]])
        elif fault == "shape":
            needles.append(str(case["expected_shapes"][case["target"]]))
        elif fault == "strides":
            needles.append("contiguous")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with pytest.raises(exc_type) as info:
            call()
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"{fault}: {needle!r} not in message {msg!r}"
    return None


# -- fixtures: comms reused by every example ----------------------------------------------
def _new(**kw: Any) -> DpSamplingComm:
    args = {
        "tp_size": 1,
        "rank": 0,
        "max_pad_bs": MAX,
        "num_tokens_per_req": N,
        "vocab_size": V,
        "device": "cpu",
        **kw,
    }
    return DpSamplingComm(**args)


@pytest.fixture(scope="module")
def comms(world1: None) -> Any:
    made = {
        "float32": _new(logits_dtype="float32"),
        "bfloat16": _new(logits_dtype="bfloat16"),
        "prepare": _new(logits_dtype=None),
        "fixed16": _new(logits_dtype="float16"),
    }
    yield made
    for c in made.values():
        c.close()


def _valid_round_trip(comm: DpSamplingComm, seed: int) -> None:
    """A valid call of every op; tp=1 outputs equal the inputs bit for bit."""
    pad_bs = 1 + seed % MAX
    dtype = comm.logits_dtype or "float32"
    x = _bodies.random_logits((seed,), (pad_bs * N, V), dtype)
    assert np.array_equal(_bodies.bits(comm.swap_batch_vocab(x, pad_bs=pad_bs)), _bodies.bits(x))
    p = _bodies.random_int32((seed, 1), (pad_bs, N))
    a = _bodies.random_int32((seed, 2), (pad_bs, N))
    ln = _bodies.random_int32((seed, 3), (pad_bs,))
    outs = comm.gather_verify_outputs(p, a, ln, pad_bs=pad_bs)
    for got, want in zip(outs, (p, a, ln), strict=True):
        assert np.array_equal(_bodies.bits(got), _bodies.bits(want))
    lp = _bodies.random_logprobs((seed,), (pad_bs, N))
    assert np.array_equal(
        _bodies.bits(comm.gather_verify_logprobs(lp, pad_bs=pad_bs)), _bodies.bits(lp)
    )


def _same_bits(got: Any, want: Any, fault_free: bool) -> None:
    if not fault_free:
        return
    expected_type = torch.Tensor if isinstance(want, torch.Tensor) else np.ndarray
    assert isinstance(got, expected_type), f"got {type(got)} for a {expected_type} input"
    assert np.array_equal(_bodies.bits(got), _bodies.bits(want))


# -- the fuzzed methods ---------------------------------------------------------------------
def test_fuzz_swap_batch_vocab(comms: Any) -> None:
    @_fuzz("swap")
    @given(data=st.data(), dtype=st.sampled_from(["float32", "bfloat16"]))
    def run(data: Any, dtype: str) -> None:
        comm = comms[dtype]
        case = data.draw(_case(lambda p: [(p * N, V)], (dtype,)))
        (x,) = case["arrays"]
        out = _expect(
            case,
            ("local_logits",),
            (dtype,),
            lambda: comm.swap_batch_vocab(x, pad_bs=case["pad_bs"]),
        )
        _same_bits(out, x, case["fault"] is None)
        _valid_round_trip(comm, data.draw(st.integers(0, 10**6)))
        EXECUTED["swap"] += 1

    run()
    assert EXECUTED["swap"] >= BUDGET["swap"]


def test_fuzz_gather_verify_outputs(comms: Any) -> None:
    names = ("predict_local", "accept_index_local", "accept_length_local")

    @_fuzz("outputs")
    @given(data=st.data())
    def run(data: Any) -> None:
        comm = comms["float32"]
        case = data.draw(_case(lambda p: [(p, N), (p, N), (p,)], ("int32",) * 3))
        p, a, ln = case["arrays"]
        outs = _expect(
            case,
            names,
            ("int32",) * 3,
            lambda: comm.gather_verify_outputs(p, a, ln, pad_bs=case["pad_bs"]),
        )
        if case["fault"] is None:
            for got, want in zip(outs, (p, a, ln), strict=True):
                _same_bits(got, want, True)
        _valid_round_trip(comm, data.draw(st.integers(0, 10**6)))
        EXECUTED["outputs"] += 1

    run()
    assert EXECUTED["outputs"] >= BUDGET["outputs"]


def test_fuzz_gather_verify_logprobs(comms: Any) -> None:
    @_fuzz("logprobs")
    @given(data=st.data())
    def run(data: Any) -> None:
        comm = comms["bfloat16"]
        case = data.draw(_case(lambda p: [(p, N)], ("float32",)))
        (lp,) = case["arrays"]
        # a strided float32 array is made contiguous for the caller (as TokenSpeed does)
        accepted = case["fault"] in (None, "strides")
        out = _expect(
            {**case, "fault": None} if accepted else case,
            ("logprobs_local",),
            ("float32",),
            lambda: comm.gather_verify_logprobs(lp, pad_bs=case["pad_bs"]),
        )
        _same_bits(out, lp, accepted)
        _valid_round_trip(comm, data.draw(st.integers(0, 10**6)))
        EXECUTED["logprobs"] += 1

    run()
    assert EXECUTED["logprobs"] >= BUDGET["logprobs"]


VALID_DTYPES = [
    ("bfloat16", "bfloat16"),
    ("bf16", "bfloat16"),
    (torch.bfloat16, "bfloat16"),
    ("float16", "float16"),
    ("fp16", "float16"),
    ("half", "float16"),
    (torch.float16, "float16"),
    (np.float16, "float16"),
    (np.dtype("float16"), "float16"),
    ("float32", "float32"),
    ("fp32", "float32"),
    (torch.float32, "float32"),
    (np.float32, "float32"),
    (np.dtype("float32"), "float32"),
]
INVALID_DTYPES = [
    "int32",
    "float64",
    "",
    "bfloat",
    torch.int32,
    torch.float64,
    torch.complex64,
    np.float64,
    np.int32,
    None,
    3,
    object(),
    [torch.float16],
]


def test_fuzz_prepare_verify_outputs(comms: Any) -> None:
    @_fuzz("prepare")
    @given(
        valid=st.booleans(),
        good=st.sampled_from(VALID_DTYPES),
        bad=st.sampled_from(INVALID_DTYPES),
        fixed=st.booleans(),
        seed=st.integers(0, 10**6),
    )
    def run(valid: bool, good: tuple, bad: Any, fixed: bool, seed: int) -> None:
        comm = comms["fixed16" if fixed else "prepare"]
        before = comm.logits_dtype
        if valid:
            given_dtype, _ = good
            comm.prepare_verify_outputs(given_dtype)  # the first dtype wins: a no-op here
            assert comm.logits_dtype == before
        else:
            with pytest.raises((TypeError, ValueError), match="dtype"):
                comm.prepare_verify_outputs(bad)
            assert comm.logits_dtype == before
        _valid_round_trip(comm, seed)
        EXECUTED["prepare"] += 1

    comms["prepare"].prepare_verify_outputs("float32")
    run()
    assert EXECUTED["prepare"] >= BUDGET["prepare"]


# constructor faults: (argument, bad value, accepted exception types)
_VE, _TE = (ValueError,), (TypeError,)
_EITHER = (ValueError, TypeError)
_NO_CUDA = (ValueError, TypeError, BackendUnavailableError)
CTOR_FAULTS: list[tuple[str, Any, tuple]] = [
    ("tp_size", 0, _VE),
    ("tp_size", -1, _VE),
    ("tp_size", 2, _VE),  # != group size 1 (sizes below are made multiples of 2)
    ("tp_size", 1.0, _TE),
    ("tp_size", "1", _TE),
    ("tp_size", True, _TE),
    ("tp_size", None, _TE),
    ("rank", -1, _VE),
    ("rank", 1, _VE),
    ("rank", 0.0, _TE),
    ("max_pad_bs", 0, _VE),
    ("max_pad_bs", -4, _VE),
    ("max_pad_bs", 2**31, _VE),
    ("max_pad_bs", 4.0, _TE),
    ("num_tokens_per_req", 0, _VE),
    ("num_tokens_per_req", -2, _VE),
    ("num_tokens_per_req", "2", _TE),
    ("vocab_size", 0, _VE),
    ("vocab_size", -6, _VE),
    ("vocab_size", 6.0, _TE),
    ("vocab_size", None, _TE),
    ("logits_dtype", "float64", _EITHER),
    ("logits_dtype", "int32", _EITHER),
    ("logits_dtype", torch.int64, _EITHER),
    ("logits_dtype", np.float64, _EITHER),
    ("logits_dtype", 3, _EITHER),
    ("logits_dtype", object(), _EITHER),
    ("backend", "xla", _EITHER),
    ("backend", "", _EITHER),
    ("backend", None, _EITHER),
    ("backend", 3, _EITHER),
    ("device", "meta", _EITHER),
    ("device", "cpu:0", _EITHER),
    ("device", "gpu", _EITHER),
    ("device", -1, _EITHER),
    ("device", True, _EITHER),
    ("device", 1.5, _EITHER),
    ("device", object(), _EITHER),
    ("device", "cuda:0", _NO_CUDA),
    ("device", 0, _NO_CUDA),
    ("timeout_s", 0, _EITHER),
    ("timeout_s", -1.0, _EITHER),
    ("timeout_s", math.nan, _EITHER),
    ("timeout_s", "soon", _EITHER),
    ("timeout_s", None, _EITHER),
    ("group", "world", _EITHER),
    ("group", 3, _EITHER),
    ("group", (), _EITHER),
    ("group", (0, 0), _EITHER),
    ("group", (5,), _EITHER),
    ("group", ("a",), _EITHER),
    ("group", 1.5, _EITHER),
]


def test_fuzz_constructor(world1: None) -> None:
    @_fuzz("ctor")
    @given(
        fault=st.one_of(st.none(), st.sampled_from(CTOR_FAULTS)),
        max_reqs=st.integers(1, 16),
        n=st.integers(1, 6),
        shard=st.integers(1, 300),
        dtype=st.sampled_from(["bfloat16", "float16", "float32", None]),
        backend=st.sampled_from(["auto", "torch"]),
        device=st.sampled_from(["cpu", None, torch.device("cpu")]),
        seed=st.integers(0, 10**6),
    )
    def run(
        fault: Any,
        max_reqs: int,
        n: int,
        shard: int,
        dtype: str | None,
        backend: str,
        device: Any,
        seed: int,
    ) -> None:
        kw: dict[str, Any] = {
            "tp_size": 1,
            "rank": 0,
            "max_pad_bs": 2 * max_reqs,
            "num_tokens_per_req": n,
            "vocab_size": 2 * shard,
            "logits_dtype": dtype,
            "backend": backend,
            "device": device,
        }
        if fault is not None:
            arg, value, accepted = fault
            kw[arg] = value
            if torch.cuda.is_available() and accepted is _NO_CUDA:
                return
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ResourceWarning)
                with pytest.raises(accepted) as info:
                    DpSamplingComm(**kw)
            msg = str(info.value)
            needle = "dtype" if arg == "logits_dtype" else arg
            if accepted is _NO_CUDA:
                needle, msg = "cuda", msg.lower()
            assert needle in msg, f"{arg}={value!r}: {needle!r} not in message {msg!r}"
        else:
            with DpSamplingComm(**kw) as comm:
                assert comm.backend == "torch"
                pad_bs = 2 * (1 + seed % max_reqs)
                if dtype is None:
                    comm.prepare_verify_outputs(("bfloat16", "float16", "float32")[seed % 3])
                x = _bodies.random_logits((seed,), (pad_bs * n, 2 * shard), comm.logits_dtype)
                out = comm.swap_batch_vocab(x, pad_bs=pad_bs)
                assert np.array_equal(_bodies.bits(out), _bodies.bits(x))
            assert not comm.is_initialized
        EXECUTED["ctor"] += 1

    run()
    assert EXECUTED["ctor"] >= BUDGET["ctor"]
    with _new(logits_dtype="float32") as comm:  # a valid construction still works
        _valid_round_trip(comm, 1)


@pytest.mark.parametrize(
    ("arg", "value", "accepted"),
    CTOR_FAULTS,
    ids=[f"{a}={v!r}" if " at 0x" not in repr(v) else f"{a}=object" for a, v, _ in CTOR_FAULTS],
)
def test_every_constructor_fault_once(world1: None, arg: str, value: Any, accepted: tuple) -> None:
    """Each listed constructor fault at least once, whatever hypothesis draws."""
    if torch.cuda.is_available() and accepted is _NO_CUDA:
        pytest.skip("CUDA is available here; this checks the CPU-only error path")
    kw: dict[str, Any] = {
        "tp_size": 1,
        "rank": 0,
        "max_pad_bs": 4,
        "num_tokens_per_req": 2,
        "vocab_size": 6,
        "logits_dtype": "float32",
        "device": "cpu",
        arg: value,
    }
    with pytest.raises(accepted) as info:
        DpSamplingComm(**kw)
    needle = "cuda" if accepted is _NO_CUDA else ("dtype" if arg == "logits_dtype" else arg)
    msg = str(info.value)
    assert needle in (msg.lower() if needle == "cuda" else msg), f"{needle!r} not in {msg!r}"
    with _new(logits_dtype="float32") as comm:  # a valid construction right after works
        _valid_round_trip(comm, len(repr(value)))


def test_fuzz_budget_is_at_least_1000_cases() -> None:
    assert sum(BUDGET.values()) >= 1000

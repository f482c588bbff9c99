"""``verify_batch_vocab``'s argument checks (a tp = 1 communicator in this process):
every bad shape, dtype, device, type or value raises ValueError / TypeError naming the
argument and the expected value, before anything is exchanged, and a valid call right
after works; the op code and the divergence message; the one-sided backend's route
for batches its kernels cannot decide; the nccl backend (through the CPU fakes) runs the
op on its kernels (tests/test_nccl_verify.py has the matrix)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from ipc_dpsample.arrays import describe
from ipc_dpsample.backends.base import RealRows
from ipc_dpsample.layout import TOP_K_DISABLED, reference_verify_batch_vocab, verify_params
from ipc_dpsample.protocol import Call, Dtype, Op, divergence_message

N, V, PAD_BS, MAX = 2, 300, 4, 6


def _good(pad_bs: int = PAD_BS) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    rng = np.random.default_rng(pad_bs)
    x = torch.from_numpy(rng.normal(0, 2, (pad_bs * N, V)).astype(np.float32))
    cand = torch.from_numpy(rng.integers(0, V, (pad_bs, N)).astype(np.int32))
    kw: dict[str, Any] = dict(
        pad_bs=pad_bs,
        temperature=np.full(pad_bs, 0.8, np.float32),
        top_k=np.full(pad_bs, 20, np.int32),
        top_p=np.full(pad_bs, 0.9, np.float32),
        min_p=np.full(pad_bs, 0.05, np.float32),
        seed=rng.integers(0, 2**40, pad_bs),
        offset=rng.integers(0, 2**40, pad_bs),
    )
    return x, cand, kw


@pytest.fixture
def comm(make_comm: Any) -> Any:
    return make_comm(max_pad_bs=MAX, num_tokens_per_req=N, vocab_size=V)


def _works(comm: Any) -> None:
    x, cand, kw = _good()
    outs = comm.verify_batch_vocab(x, cand, return_logprobs=True, **kw)
    want = reference_verify_batch_vocab(
        [x.numpy()], cand.numpy(), tp=1, dtype="float32", return_logprobs=True, **kw
    )
    for got, w in zip(outs[:3], want[:3], strict=True):
        np.testing.assert_array_equal(got.numpy(), w)


def _f32(*v: float) -> np.ndarray:
    return np.array(v + (0.5,) * (PAD_BS - len(v)), np.float32)


# (what changes, the error type, words the message must hold)
BAD: list[tuple[str, dict[str, Any], type, tuple[str, ...]]] = [
    ("logits rows", {"x": torch.ones(PAD_BS * N + 1, V)}, ValueError, ("local_logits", "(8, 300)")),
    ("logits dtype", {"x": torch.ones(PAD_BS * N, V, dtype=torch.float16)}, TypeError,
     ("local_logits", "float32")),
    ("candidates dtype", {"candidates": torch.ones(PAD_BS, N, dtype=torch.int64)}, TypeError,
     ("candidates", "int32")),
    ("candidates shape", {"candidates": torch.ones(PAD_BS, N + 1, dtype=torch.int32)},
     ValueError, ("candidates", "(4, 2)", "pad_bs=4")),
    ("candidates strided", {"candidates": torch.ones(N, PAD_BS, dtype=torch.int32).t()},
     ValueError, ("candidates", "contiguous")),
    ("candidates list", {"candidates": [[1, 2]] * PAD_BS}, TypeError, ("candidates",)),
    ("temperature dtype", {"temperature": np.ones(PAD_BS, np.float64)}, TypeError,
     ("temperature", "float32")),
    ("temperature shape", {"temperature": np.ones(PAD_BS + 1, np.float32)}, ValueError,
     ("temperature", "(4,)")),
    ("temperature 2-D", {"temperature": np.ones((PAD_BS, 1), np.float32)}, ValueError,
     ("temperature", "(4,)")),
    ("temperature strided", {"temperature": np.ones(2 * PAD_BS, np.float32)[::2]},
     ValueError, ("temperature", "contiguous")),
    ("temperature list", {"temperature": [0.5] * PAD_BS}, TypeError, ("temperature", "float32")),
    ("temperature None", {"temperature": None}, TypeError, ("temperature", "required")),
    ("temperature < 0", {"temperature": _f32(0.5, -0.1)}, ValueError,
     ("temperature[1]", ">= 0")),
    ("temperature NaN", {"temperature": _f32(np.nan)}, ValueError, ("temperature[0]", "finite")),
    ("temperature inf", {"temperature": _f32(0.5, 0.5, np.inf)}, ValueError,
     ("temperature[2]", "finite")),
    ("top_k 129", {"top_k": np.array([5, 129, 5, 5], np.int32)}, ValueError,
     ("top_k[1]=129", "1..128", "vocab_limit=300")),
    ("top_k 299", {"top_k": np.array([5, 5, 299, 5], np.int32)}, ValueError, ("top_k[2]=299",)),
    ("top_k < 0", {"top_k": np.array([-1, 5, 5, 5], np.int32)}, ValueError, ("top_k[0]=-1",)),
    ("top_k 129 under vocab_limit 200", {"top_k": np.full(PAD_BS, 150, np.int32),
     "vocab_limit": 200}, ValueError, ("top_k[0]=150", "vocab_limit=200")),
    ("top_k int64", {"top_k": np.full(PAD_BS, 5, np.int64)}, TypeError, ("top_k", "int32")),
    ("top_p 0", {"top_p": _f32(0.0)}, ValueError, ("top_p[0]", "0 < top_p <= 1")),
    ("top_p > 1", {"top_p": _f32(0.5, 1.5)}, ValueError, ("top_p[1]", "0 < top_p <= 1")),
    ("top_p NaN", {"top_p": _f32(np.nan)}, ValueError, ("top_p[0]",)),
    ("min_p 1", {"min_p": _f32(0.1, 0.1, 0.1, 1.0)}, ValueError, ("min_p[3]", "0 <= min_p < 1")),
    ("min_p < 0", {"min_p": _f32(-0.1)}, ValueError, ("min_p[0]",)),
    ("seed int32", {"seed": np.ones(PAD_BS, np.int32)}, TypeError, ("seed", "int64")),
    ("offset shape", {"offset": np.ones(PAD_BS - 1, np.int64)}, ValueError, ("offset", "(4,)")),
    ("offset None", {"offset": None}, TypeError, ("offset", "required")),
    ("vocab_limit 0", {"vocab_limit": 0}, ValueError, ("vocab_limit=0", "V=300")),
    ("vocab_limit > V", {"vocab_limit": V + 1}, ValueError, ("vocab_limit=301", "V=300")),
    ("vocab_limit float", {"vocab_limit": 3.0}, TypeError, ("vocab_limit", "int")),
    ("vocab_limit bool", {"vocab_limit": True}, TypeError, ("vocab_limit",)),
    ("bs < 0", {"bs": -1}, ValueError, ("bs=-1", "pad_bs=4")),
    ("bs > pad_bs", {"bs": PAD_BS + 1}, ValueError, ("bs=5", "pad_bs=4")),
    ("bs bool", {"bs": True}, TypeError, ("bs",)),
    ("bs tensor int64", {"bs": torch.tensor(2)}, TypeError, ("bs", "int32")),
    ("return_logprobs str", {"return_logprobs": "yes"}, TypeError, ("return_logprobs", "bool")),
    ("stream on CPU", {"stream": 0}, TypeError, ("stream",)),
    ("pad_bs > max", {"pad_bs": MAX + 1}, ValueError, ("pad_bs", "max_pad_bs=6")),
]  # fmt: skip


@pytest.mark.parametrize(("what", "change", "exc", "words"), BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_raise_naming_them(
    comm: Any, what: str, change: dict[str, Any], exc: type, words: tuple[str, ...]
) -> None:
    x, cand, kw = _good()
    change = dict(change)
    x = change.pop("x", x)
    cand = change.pop("candidates", cand)
    kw.update(change)
    with pytest.raises(exc) as info:
        comm.verify_batch_vocab(x, cand, **kw)
    for word in words:
        assert word in str(info.value), (what, str(info.value))
    _works(comm)  # nothing was exchanged: the next call is in step


def test_accepted_forms_of_the_parameters(comm: Any) -> None:
    """CPU torch tensors, NumPy arrays, None; top-k off as 0, 1 << 30 or >= vocab_limit;
    a tensor bs; phantom requests' values are not checked."""
    x, cand, kw = _good()
    ref_kw = dict(kw)
    kw["temperature"] = torch.from_numpy(kw["temperature"])
    kw["seed"] = torch.from_numpy(kw["seed"])
    for off in (0, TOP_K_DISABLED, V, 200):
        top_k = np.array([off, 5, off, 1], np.int32)
        lim = 200 if off == 200 else None
        got = comm.verify_batch_vocab(x, cand, **{**kw, "top_k": top_k}, vocab_limit=lim)
        want = reference_verify_batch_vocab(
            [x.numpy()], cand.numpy(), tp=1, dtype="float32", vocab_limit=lim,
            **{**ref_kw, "top_k": top_k},
        )  # fmt: skip
        np.testing.assert_array_equal(got[0].numpy(), want[0])
    bad = dict(kw, top_k=None, top_p=None, min_p=None)
    bad["temperature"] = torch.tensor([0.5, 0.5, -3.0, np.nan], dtype=torch.float32)
    for bs in (2, torch.tensor(2, dtype=torch.int32), torch.tensor([2], dtype=torch.int32)):
        got = comm.verify_batch_vocab(x, cand, bs=bs, **bad)
        assert got[2].shape == (PAD_BS,)


def test_op_code_and_divergence_message() -> None:
    assert Op.VERIFY.api_name == "verify_batch_vocab" and Op.describe_code(5) == Op.VERIFY.api_name
    call = Call(Op.VERIFY, Dtype.BFLOAT16, 8, 4, 6, 3)
    assert Call.from_header(call.header(), 4) == call
    assert call.describe() == "verify_batch_vocab(pad_bs=8, bs=6, N=4, bfloat16) #3"
    msg = divergence_message(0, 1, call, call, "torch", ("temperature", "seed"))
    assert msg.startswith("rank 1 called verify_batch_vocab(pad_bs=8, bs=6, N=4, bfloat16) #3 ")
    assert "with different temperature, seed than rank 0" in msg, msg
    assert "call sequences diverged" in msg and "every later call raises" in msg, msg


# -- the GPU backends ---------------------------------------------------------------------
def _backend_args(cfg_n: int = N) -> tuple[Any, ...]:
    x = np.ones((PAD_BS * cfg_n, V), np.float32)
    cand = np.zeros((PAD_BS, cfg_n), np.int32)
    params = verify_params(
        pad_bs=PAD_BS, num_tokens_per_req=cfg_n, vocab_size=V,
        temperature=np.ones(PAD_BS, np.float32), seed=np.ones(PAD_BS, np.int64),
        offset=np.ones(PAD_BS, np.int64),
    )  # fmt: skip
    return x, describe(x), cand, describe(cand), params


@pytest.mark.parametrize("threads", [False, True])
def test_onesided_backend_moves_the_logits_for_top_p_without_top_k(
    monkeypatch: pytest.MonkeyPatch, threads: bool
) -> None:
    """Built without CUDA (``__new__``): a batch whose request has top-p but no top-k
    goes to verify_by_swap before any kernel state is touched, saying why."""
    from types import SimpleNamespace

    from ipc_dpsample.backends.onesided import backend as onesided

    backend = onesided.OnesidedBackend.__new__(onesided.OnesidedBackend)
    backend.cfg = SimpleNamespace(tp_size=2, rank=1, timeout_s=7.0)  # type: ignore[assignment]
    backend.device = 0
    barriers: list[tuple[float, str]] = []
    backend.group = SimpleNamespace(  # type: ignore[assignment]
        barrier=lambda *, timeout_s, what: barriers.append((timeout_s, what))
    )
    backend._threads = threads
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(onesided, "verify_by_swap", lambda *a, **k: calls.append(k) or ("ok",))
    x, xi, cand, ci, _ = _backend_args()
    params = verify_params(
        pad_bs=PAD_BS, num_tokens_per_req=N, vocab_size=V,
        temperature=np.ones(PAD_BS, np.float32), seed=np.ones(PAD_BS, np.int64),
        offset=np.ones(PAD_BS, np.int64), top_p=np.full(PAD_BS, 0.9, np.float32),
    )  # fmt: skip
    out = backend.verify_batch_vocab(
        x, xi, cand, ci, pad_bs=PAD_BS, params=params, return_logprobs=True,
        bs=RealRows.every(PAD_BS), stream=None,
    )  # fmt: skip
    assert out == ("ok",) and calls[0]["rank"] == 1 and calls[0]["tp"] == 2
    assert backend.last_verify_path.startswith("swap: request 0 has top_p=0.9 / min_p=0")
    # rank threads meet between the sampler and the gathers; processes need not
    hook = calls[0]["before_gather"]
    if not threads:
        assert hook is None
        return
    assert not barriers
    hook()
    assert barriers == [(7.0, "verify_batch_vocab (swap route): every rank's sampler issued")]


def test_nccl_backend_runs_verify_on_its_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the CPU fakes of tests/test_nccl_host.py (thread ranks, emulated kernels):
    the op runs on the verify kernels and equals the reference."""
    from fakes.emulator import emulator
    from fakes.host import host_backends

    make, _ = host_backends(monkeypatch, emulator())

    def body(rank: int, backend: Any, log: list) -> tuple[Any, ...]:
        x, xi, cand, ci, params = _backend_args(backend.cfg.num_tokens_per_req)
        backend.prepare("float32")  # the communicator does it from the logits' dtype
        outs = backend.verify_batch_vocab(
            x, xi, cand, ci, pad_bs=PAD_BS, params=params, return_logprobs=True,
            bs=RealRows.every(PAD_BS), stream=None,
        )  # fmt: skip
        assert backend.last_verify_path == "kernels"
        assert [e[0] for e in log] == ["allGather", "allGather"]  # tp = 1: only the gathers
        return tuple(np.array(o) for o in outs)

    (got,) = make(1, body, max_pad_bs=MAX, num_tokens_per_req=N, vocab_size=V)
    x, _, cand, _, _ = _backend_args()
    want = reference_verify_batch_vocab(
        [x], cand, tp=1, pad_bs=PAD_BS, dtype="float32", return_logprobs=True,
        temperature=np.ones(PAD_BS, np.float32), seed=np.ones(PAD_BS, np.int64),
        offset=np.ones(PAD_BS, np.int64),
    )  # fmt: skip
    for g, w in zip(got[:3], want[:3], strict=True):
        np.testing.assert_array_equal(g, w)
    lp = got[3].view(np.float32)  # the fakes' host views show float32 as its bits
    ulps = np.abs(lp.view(np.int32).astype(np.int64) - want[3].view(np.int32))
    assert ulps.max() <= 1, ulps


# -- device parameters (what the one-sided backend takes), on the CPU -----------------------
class _Dev:
    """Stands for an array on cuda:0: ``describe`` (patched below) reports it so."""

    def __init__(self, dtype: str, shape: tuple[int, ...], ptr: int, contiguous: bool = True):
        self.dtype, self.shape, self.ptr, self.contiguous = dtype, shape, ptr, contiguous


def _device_checker(monkeypatch: pytest.MonkeyPatch) -> Any:
    from ipc_dpsample import validate
    from ipc_dpsample.arrays import ArrayInfo, ArrayKind
    from ipc_dpsample.config import CommConfig

    real = validate.describe

    def fake(x: Any, name: str = "array") -> Any:
        if isinstance(x, _Dev):
            return ArrayInfo(ArrayKind.CUPY, x.ptr, x.shape, x.dtype, 0, x.contiguous)
        return real(x, name)

    def no_host_read(x: Any, info: Any) -> Any:
        raise AssertionError(f"a device array was read on the host: {info}")

    monkeypatch.setattr(validate, "describe", fake)
    monkeypatch.setattr(validate, "_to_host", no_host_read)
    cfg = CommConfig(tp_size=2, rank=0, max_pad_bs=MAX, num_tokens_per_req=N, vocab_size=V)
    return validate.ArgChecker(cfg, 0)


def _device_arrays(pad_bs: int = PAD_BS) -> dict[str, Any]:
    return {
        "temperature": _Dev("float32", (pad_bs,), 0x1000),
        "top_k": _Dev("int32", (pad_bs,), 0x2000),
        "top_p": None,
        "min_p": _Dev("float32", (pad_bs,), 0x3000),
        "seed": _Dev("int64", (pad_bs,), 0x4000),
        "offset": _Dev("int64", (pad_bs,), 0x5000),
    }


def test_device_parameters_stay_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from ipc_dpsample.backends.base import DeviceVerifyParams

    check = _device_checker(monkeypatch)
    cand = _Dev("int32", (PAD_BS, N), 0x6000)
    bs = _Dev("int32", (1,), 0x7000)
    kw = dict(pad_bs=PAD_BS, vocab_limit=V - 3, return_logprobs=False, device_params=True)
    _, params, rows = check.verify(cand, bs=bs, **kw, **_device_arrays())
    assert params == DeviceVerifyParams(PAD_BS, N, V - 3, 0x1000, 0x2000, 0, 0x3000, 0x4000, 0x5000)
    assert params.pointers == (0x1000, 0x2000, 0, 0x3000, 0x4000, 0x5000)
    assert rows.ptr == 0x7000 and rows.bs == PAD_BS  # the device bs is read by the kernels
    # the structure is still checked, naming the argument and the expected value
    bad = _device_arrays()
    bad["seed"] = _Dev("int32", (PAD_BS,), 0x4000)
    with pytest.raises(TypeError, match="seed dtype int32 != expected int64"):
        check.verify(cand, bs=None, **kw, **bad)
    bad = _device_arrays()
    bad["top_k"] = _Dev("int32", (PAD_BS + 1,), 0x2000)
    with pytest.raises(ValueError, match=r"top_k shape \(5,\) != expected \(4,\)"):
        check.verify(cand, bs=None, **kw, **bad)
    bad = _device_arrays()
    bad["min_p"] = _Dev("float32", (PAD_BS,), 0x3000, contiguous=False)
    with pytest.raises(ValueError, match="min_p must be C-contiguous"):
        check.verify(cand, bs=None, **kw, **bad)
    bad = _device_arrays()
    bad["temperature"] = None
    with pytest.raises(TypeError, match="temperature is required"):
        check.verify(cand, bs=None, **kw, **bad)
    with pytest.raises(ValueError, match="expected 1 <= vocab_limit <= V=300"):
        check.verify(cand, bs=None, **{**kw, "vocab_limit": V + 1}, **_device_arrays())


def test_a_host_parameter_makes_every_parameter_read_on_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    check = _device_checker(monkeypatch)
    cand = _Dev("int32", (PAD_BS, N), 0x6000)
    arrays = _device_arrays()
    arrays["seed"] = np.ones(PAD_BS, np.int64)  # one host array: the host path
    kw = dict(pad_bs=PAD_BS, vocab_limit=None, return_logprobs=False, device_params=True)
    with pytest.raises(AssertionError, match="read on the host"):
        check.verify(cand, bs=None, **kw, **arrays)
    # and without device_params (the torch and nccl backends) device arrays are read too
    with pytest.raises(AssertionError, match="read on the host"):
        check.verify(cand, bs=None, **{**kw, "device_params": False}, **_device_arrays())


@pytest.mark.parametrize(("tp", "n", "match"), [(16, 2, "tp=16"), (2, 65, "N <= 64")])
def test_onesided_device_parameters_beyond_the_kernels_limits_raise(
    tp: int, n: int, match: str
) -> None:
    """Built without CUDA: the limits are checked before anything is launched."""
    from types import SimpleNamespace

    from ipc_dpsample import DpSampleError
    from ipc_dpsample.backends.base import DeviceVerifyParams
    from ipc_dpsample.backends.onesided import backend as onesided

    backend = onesided.OnesidedBackend.__new__(onesided.OnesidedBackend)
    backend.cfg = SimpleNamespace(tp_size=tp, rank=0, num_tokens_per_req=n)  # type: ignore[assignment]
    params = DeviceVerifyParams(2 * tp, n, V, 0x100, 0x200, 0, 0, 0x300, 0x400)
    x, xi, cand, ci, _ = _backend_args()
    with pytest.raises(DpSampleError, match=match):
        backend.verify_batch_vocab(
            x, xi, cand, ci, pad_bs=2 * tp, params=params, return_logprobs=False,
            bs=RealRows.every(2 * tp), stream=None,
        )  # fmt: skip


@pytest.mark.parametrize("after_verify", [False, True])
def test_onesided_timeout_after_a_verify_names_the_argument_check(after_verify: bool) -> None:
    """A peer that found different arguments skips the verify's gathers; the ranks that
    wait for it time out, and their error says where to look (built without CUDA)."""
    import ctypes
    from types import SimpleNamespace

    from ipc_dpsample.backends.onesided import backend as onesided
    from ipc_dpsample.backends.onesided.contract import ERR_TIMEOUT, DpErrorBlock, pack_signature
    from ipc_dpsample.errors import PeerTimeoutError
    from ipc_dpsample.protocol import Dtype, Op

    backend = onesided.OnesidedBackend.__new__(onesided.OnesidedBackend)
    backend.cfg = SimpleNamespace(num_tokens_per_req=2, timeout_s=5.0)  # type: ignore[assignment]
    block = DpErrorBlock()
    backend._err, backend._err_code = block, ctypes.c_uint32.from_buffer(block)
    backend._error, backend._threads, backend._verify_last = None, False, after_verify
    block.rank, block.peer, block.expected = 1, 0, 2
    block.mine = pack_signature(Op.GATHER_OUTPUTS, Dtype.INT32, 4) | 4
    block.code = ERR_TIMEOUT
    with pytest.raises(PeerTimeoutError, match="rank 1: peer rank 0 did not take part") as info:
        backend.check()
    hint = "The last op issued here was verify_batch_vocab"
    assert (hint in str(info.value)) == after_verify
    if after_verify:
        assert str(info.value).endswith("see rank 0's error")

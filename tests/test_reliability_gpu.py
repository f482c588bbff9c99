"""Reliability on one GPU: dead and stalled peers, injected IPC failures, long
create/close runs, concurrent communicators, and fuzzed bad inputs on CUDA.

* A peer killed by SIGKILL in the middle of a swap or a gather (three processes
  sharing the GPU through CUDA IPC, the victim being rank 2): every survivor raises
  :class:`PeerTimeoutError` naming the dead rank within ``timeout_s + 2 s``, closes
  the broken communicator without hanging, and builds a new one with the other
  survivor that moves data bit-exactly. ``IPC_DPSAMPLE_KILL_TRIALS`` (default 20)
  trials per op, ``IPC_DPSAMPLE_KILL_PAIRS`` (default 2; one H200 run with 4 pairs
  and 20 trials per op saw victims fail at start-up, exit 4, cause not found) run at
  once; the summary
  line is printed and appended to ``$IPC_DPSAMPLE_RELIABILITY_OUT`` when set.
* A peer stalled for half the timeout: the op completes, bit-exactly.
* ``IPC_DPSAMPLE_TEST_FAIL_IPC=open:1`` / ``verify:1`` with 2 and 3 processes: auto
  falls back on every rank alike, with one warning naming the cause; an explicit
  ``backend='onesided'`` raises BackendUnavailableError naming the cause and the fix.
* 200 create/use/close cycles across processes: IPC mappings, arenas, host error
  blocks and the device's free memory return to baseline.
* Two communicators on one group, on one stream or on two streams in flight at once.
* Hypothesis: bad inputs to every public method of tp=1 CUDA communicators raise
  only ValueError/TypeError, and a valid call right after is exact.

Every result is checked bit-exactly on fresh random data; every subprocess has a
hard deadline.
"""

from __future__ import annotations

import os

# before CUDA initialises: every in-process rank's stream gets its own hardware queue
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import collections
import json
import signal
from pathlib import Path
from typing import Any

import _reliability_bodies as rb
import numpy as np
import pytest
from _gpu_common import gpu_skip_reason

from ipc_dpsample import BackendUnavailableError, DpSamplingComm, ThreadGroup
from ipc_dpsample.testing import run_ranks, run_threads

_REASON = gpu_skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

_GLOO = {"IPC_DPSAMPLE_TEST_PG_BACKEND": "gloo"}


def _report(line: str) -> None:
    """Print a summary line (shown with -s or -rA) and append it to
    $IPC_DPSAMPLE_RELIABILITY_OUT when set."""
    print(line, flush=True)
    path = os.environ.get("IPC_DPSAMPLE_RELIABILITY_OUT")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


# -- a stall shorter than the timeout ---------------------------------------------------
@pytest.mark.timeout(120)
def test_stall_shorter_than_the_timeout_completes_exactly() -> None:
    timeout_s = 2.0
    waited = run_threads(3, rb.stall_body, timeout_s, timeout_s=110)
    for i, (op, staller) in enumerate(rb.STALL_PLAN):
        for rank in range(3):
            if rank != staller:
                # this rank's op was in flight for the whole stall, and still completed
                assert waited[rank][i] >= 0.45 * timeout_s, (op, staller, rank, waited[rank][i])


# -- two communicators on one group -----------------------------------------------------
@pytest.mark.timeout(120)
def test_two_communicators_on_one_group_and_one_stream_interleave_exactly() -> None:
    rounds = 30
    out = run_threads(2, rb.two_comms_one_stream_body, rounds, timeout_s=110)
    assert out == [2 * rounds] * 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp", [2, 4])
def test_two_communicators_on_two_streams_in_flight_at_once(tp: int) -> None:
    rounds = 30
    out = run_threads(tp, rb.two_comms_two_streams_body, rounds, timeout_s=110)
    assert out == [2 * rounds] * tp


# -- bad inputs on CUDA -----------------------------------------------------------------
@pytest.mark.timeout(120)
def test_pad_bs_not_a_multiple_of_tp_is_refused_on_every_rank() -> None:
    out = run_threads(2, rb.pad_multiple_body, timeout_s=110)
    for rank, messages in enumerate(out):
        assert len(messages) == 3
        for msg in messages:
            assert "not a multiple of tp_size=2" in msg, (rank, msg)


FUZZ_MAX, FUZZ_N, FUZZ_V = 6, 2, 40  # max_pad_bs, N, V of the fuzzed tp=1 communicators
FUZZ_BUDGET = {"swap": 120, "outputs": 100, "logprobs": 60, "prepare": 40}
NCCL_SHARE = 0.35  # the NCCL pass runs this share of the budget
_TORCH_DTYPES = (
    "bfloat16",
    "float16",
    "float32",
    "float64",
    "int32",
    "int64",
    "int16",
    "uint8",
    "bool",
)
_CUPY_DTYPES = ("float16", "float32", "float64", "int32", "int64", "int16", "uint8", "bool")
ARRAY_FAULTS = ("dtype", "shape", "strides", "cpu", "meta", "kind")
EXPECTED_ERROR = {
    "dtype": TypeError,
    "cpu": TypeError,
    "meta": TypeError,
    "kind": TypeError,
    "mixed": TypeError,
    "pad_type": TypeError,
    "shape": ValueError,
    "strides": ValueError,
    "pad_range": ValueError,
}


def _values(shape: tuple[int, ...], dtype: str, seed: int) -> np.ndarray:
    """Random, never-zero NumPy data for ``dtype`` (bfloat16: float32 values)."""
    rng = np.random.default_rng(seed)
    if dtype in ("int32", "int64"):
        v = rng.integers(1, 2**31 - 1, size=shape, dtype=np.int64)
        return np.asarray(v * (rng.integers(0, 2, size=shape) * 2 - 1)).astype(dtype)
    if dtype in ("int16", "uint8"):
        return np.asarray(rng.integers(1, 100, size=shape)).astype(dtype)
    f = np.asarray(rng.standard_normal(shape) * 8.0)
    f[np.abs(f) < 1e-2] = 1.5
    if dtype == "bool":
        return np.asarray(f > 0)
    return np.asarray(f.astype("float32" if dtype == "bfloat16" else dtype))


def _array(framework: str, shape: tuple[int, ...], dtype: str, seed: int) -> Any:
    """A C-contiguous array: ``torch`` (CUDA), ``torch-cpu``, ``cupy`` or ``numpy``."""
    vals = _values(shape, dtype, seed)
    if framework.startswith("torch"):
        import torch

        device = "cpu" if framework == "torch-cpu" else "cuda"
        return torch.from_numpy(vals).to(device=device, dtype=getattr(torch, dtype))
    if framework == "numpy":
        return vals
    import cupy

    return cupy.asarray(vals)


def _other_framework(x: Any) -> Any:
    import cupy
    import torch

    if isinstance(x, torch.Tensor):
        return cupy.asarray(x)
    return torch.as_tensor(x, device="cuda")


def _host_bytes(x: Any) -> np.ndarray:
    import torch

    if isinstance(x, torch.Tensor):
        return x.detach().cpu().contiguous().view(torch.uint8).numpy()
    import cupy

    return np.ascontiguousarray(cupy.asnumpy(x)).view(np.uint8)


def _framework_of(x: Any) -> str:
    return type(x).__module__.split(".")[0]


def _assert_same(got: Any, want: Any) -> None:
    """``got`` is the tp=1 output for input ``want``: same framework, shape, dtype
    and bits."""
    assert _framework_of(got) == _framework_of(want), (type(got), type(want))
    assert tuple(got.shape) == tuple(want.shape), (got.shape, want.shape)
    assert str(got.dtype) == str(want.dtype), (got.dtype, want.dtype)
    np.testing.assert_array_equal(_host_bytes(got), _host_bytes(want))


def _sync(comm: Any) -> None:
    import cupy

    cupy.cuda.runtime.deviceSynchronize()
    comm.check()


def _round_trip(comm: Any, framework: str, seed: int) -> None:
    """A valid call of every op (outputs poisoned first on the one-sided backend);
    tp=1 outputs equal the inputs bit for bit."""
    if comm.backend == "onesided":
        comm._backend.poison_for_testing()
    pad_bs = 1 + seed % FUZZ_MAX
    dtype = comm.logits_dtype
    fw = "torch" if dtype == "bfloat16" else framework
    x = _array(fw, (pad_bs * FUZZ_N, FUZZ_V), dtype, seed)
    y = comm.swap_batch_vocab(x, pad_bs=pad_bs)
    _sync(comm)
    _assert_same(y, x)
    args = [_array(framework, (pad_bs, FUZZ_N), "int32", seed + k) for k in (1, 2)]
    args.append(_array(framework, (pad_bs,), "int32", seed + 3))
    outs = comm.gather_verify_outputs(*args, pad_bs=pad_bs)
    _sync(comm)
    for got, want in zip(outs, args, strict=True):
        _assert_same(got, want)
    lp = _array(framework, (pad_bs, FUZZ_N), "float32", seed + 4)
    out = comm.gather_verify_logprobs(lp, pad_bs=pad_bs)
    _sync(comm)
    _assert_same(out, lp)


def _bad_array(
    draw: Any, st: Any, framework: str, shape: tuple[int, ...], dtype: str, fault: str, seed: int
) -> Any:
    """An argument broken in exactly one respect."""
    if fault == "dtype":
        pool = _TORCH_DTYPES if framework == "torch" else _CUPY_DTYPES
        return _array(
            framework, shape, draw(st.sampled_from([d for d in pool if d != dtype])), seed
        )
    if fault == "shape":
        ndim = draw(st.integers(0, 3))
        bad = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
        if bad == tuple(shape):
            bad = (*shape, 1)
        return _array(framework, bad, dtype, seed)
    if fault == "strides":  # every axis has length >= 2 here, so these are not contiguous
        how = draw(st.sampled_from(["step", "transpose", "expand"]))
        if len(shape) == 1 or how == "step":
            return _array(framework, (2 * shape[0], *shape[1:]), dtype, seed)[::2]
        if how == "transpose" or framework == "cupy":
            return _array(framework, (shape[1], shape[0]), dtype, seed).T
        return _array(framework, (1, shape[1]), dtype, seed).expand(*shape)
    if fault == "cpu":  # right shape and dtype, host memory
        return _array("torch-cpu" if framework == "torch" else "numpy", shape, dtype, seed)
    if fault == "meta":
        import torch

        return torch.empty(shape, dtype=getattr(torch, dtype), device="meta")
    assert fault == "kind"
    return draw(st.sampled_from([None, 3, 2.5, "array", b"\0" * 8, [[1.0, 2.0]], {"a": 1}]))


def _case_strategy(st: Any, shapes: Any, dtypes: tuple[str, ...]) -> Any:
    """One call: ``shapes(pad_bs)`` gives each argument's expected shape. At most one
    fault per call, so the exact outcome is known."""
    faults = [None, None, *ARRAY_FAULTS, "pad_range", "pad_type"]
    if len(dtypes) > 1:
        faults.append("mixed")

    @st.composite
    def case(draw: Any) -> dict[str, Any]:
        fault = draw(st.sampled_from(faults))
        pad_bs = draw(st.integers(2 if fault == "strides" else 1, FUZZ_MAX))
        framework = "torch" if "bfloat16" in dtypes else draw(st.sampled_from(["torch", "cupy"]))
        expected = shapes(pad_bs)
        target = draw(st.integers(0, len(expected) - 1))
        seed = draw(st.integers(0, 2**31 - 1000))
        arrays = []
        for i, (shape, dtype) in enumerate(zip(expected, dtypes, strict=True)):
            if i == target and fault in ARRAY_FAULTS:
                arrays.append(_bad_array(draw, st, framework, shape, dtype, fault, seed + i))
                continue
            x = _array(framework, shape, dtype, seed + i)
            if draw(st.booleans()):  # a view at a storage offset: still valid
                big = _array(framework, (shape[0] + 3, *shape[1:]), dtype, seed + 100 + i)
                big[3:] = x
                x = big[3:]
            arrays.append(x)
        if fault == "mixed":  # one argument of another array type than the first
            target = draw(st.integers(1, len(expected) - 1))
            arrays[target] = _other_framework(arrays[target])
        call_pad_bs: Any = pad_bs
        if fault == "pad_range":
            call_pad_bs = draw(st.sampled_from([0, -1, -FUZZ_MAX, FUZZ_MAX + 1, 10**9]))
        elif fault == "pad_type":
            call_pad_bs = draw(
                st.sampled_from(
                    [float(pad_bs), str(pad_bs), None, True, np.int64(pad_bs), [pad_bs], 1j]
                )
            )
        return {
            "fault": fault,
            "target": target,
            "arrays": arrays,
            "pad_bs": call_pad_bs,
            "framework": framework,
            "expected": expected,
        }

    return case()


def _expect(case: dict[str, Any], names: tuple[str, ...], dtypes: tuple[str, ...], call: Any):
    """Run ``call``; a faulty case must raise the fault's exception type, whose message
    names the argument. Returns the result of a fault-free call."""
    fault = case["fault"]
    if fault is None:
        return call()
    if fault in ("pad_range", "pad_type"):
        needles = ["pad_bs"]
    else:
        t = case["target"]
        needles = [names[t]]
        if fault == "dtype":
            needles.append(dtypes[t])
        elif fault == "shape":
            needles.append(str(case["expected"][t]))
        elif fault == "strides":
            needles.append("contiguous")
    with pytest.raises(EXPECTED_ERROR[fault]) as info:
        call()
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"{fault}: {needle!r} not in {msg!r}"
    return None


def _fuzz_comms(backend: str) -> dict[str, DpSamplingComm]:
    made: dict[str, DpSamplingComm] = {}
    try:
        for key, dtype in (
            ("bfloat16", "bfloat16"),
            ("float32", "float32"),
            ("none", None),
            ("fixed16", "float16"),
        ):
            made[key] = DpSamplingComm(
                tp_size=1,
                rank=0,
                group=ThreadGroup.create(1)[0],
                max_pad_bs=FUZZ_MAX,
                num_tokens_per_req=FUZZ_N,
                vocab_size=FUZZ_V,
                logits_dtype=dtype,
                backend=backend,
                device=0,
                timeout_s=20.0,
            )
            assert made[key].backend == backend, made[key].explain()
    except BackendUnavailableError as exc:
        for c in made.values():
            c.close()
        if backend == "nccl":
            pytest.skip(f"the NCCL backend cannot run a tp=1 communicator here: {exc}")
        raise
    return made


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["onesided", "nccl"])
def test_fuzz_bad_inputs_on_cuda_raise_only_value_or_type_error(backend: str) -> None:
    pytest.importorskip("hypothesis", reason="needs hypothesis for the GPU fuzzing")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    share = 1.0 if backend == "onesided" else NCCL_SHARE
    budget = {k: max(10, int(v * share)) for k, v in FUZZ_BUDGET.items()}
    suppress = [
        getattr(HealthCheck, n)
        for n in ("too_slow", "data_too_large", "filter_too_much", "large_base_example")
        if hasattr(HealthCheck, n)
    ]

    def fuzz(name: str) -> Any:
        return settings(
            max_examples=budget[name],
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=suppress,
        )

    executed: collections.Counter[str] = collections.Counter()
    comms = _fuzz_comms(backend)
    try:

        @fuzz("swap")
        @given(data=st.data(), which=st.sampled_from(["bfloat16", "float32"]))
        def swap(data: Any, which: str) -> None:
            comm = comms[which]
            case = data.draw(_case_strategy(st, lambda p: [(p * FUZZ_N, FUZZ_V)], (which,)))
            (x,) = case["arrays"]
            if case["fault"] is None and comm.backend == "onesided":
                comm._backend.poison_for_testing()
            out = _expect(
                case,
                ("local_logits",),
                (which,),
                lambda: comm.swap_batch_vocab(x, pad_bs=case["pad_bs"]),
            )
            if case["fault"] is None:
                _sync(comm)
                _assert_same(out, x)
            _round_trip(comm, case["framework"], data.draw(st.integers(0, 10**6)))
            executed["swap"] += 1

        names = ("predict_local", "accept_index_local", "accept_length_local")

        @fuzz("outputs")
        @given(data=st.data())
        def outputs(data: Any) -> None:
            comm = comms["float32"]
            case = data.draw(
                _case_strategy(
                    st, lambda p: [(p, FUZZ_N), (p, FUZZ_N), (p,)], ("int32", "int32", "int32")
                )
            )
            p, a, ln = case["arrays"]
            if case["fault"] is None and comm.backend == "onesided":
                comm._backend.poison_for_testing()
            outs = _expect(
                case,
                names,
                ("int32",) * 3,
                lambda: comm.gather_verify_outputs(p, a, ln, pad_bs=case["pad_bs"]),
            )
            if case["fault"] is None:
                _sync(comm)
                for got, want in zip(outs, (p, a, ln), strict=True):
                    _assert_same(got, want)
            _round_trip(comm, case["framework"], data.draw(st.integers(0, 10**6)))
            executed["outputs"] += 1

        @fuzz("logprobs")
        @given(data=st.data())
        def logprobs(data: Any) -> None:
            comm = comms["bfloat16"]
            case = data.draw(_case_strategy(st, lambda p: [(p, FUZZ_N)], ("float32",)))
            (lp,) = case["arrays"]
            # a strided float32 torch/CuPy array is made contiguous for the caller (as
            # TokenSpeed does); the other faults still raise
            accepted = case["fault"] is None or (
                case["fault"] == "strides" and case["framework"] in ("torch", "cupy")
            )
            out = _expect(
                {**case, "fault": None} if accepted else case,
                ("logprobs_local",),
                ("float32",),
                lambda: comm.gather_verify_logprobs(lp, pad_bs=case["pad_bs"]),
            )
            if accepted:
                _sync(comm)
                _assert_same(out, lp)
            _round_trip(comm, "torch", data.draw(st.integers(0, 10**6)))
            executed["logprobs"] += 1

        import torch

        valid = [
            ("bfloat16", "bfloat16"),
            ("bf16", "bfloat16"),
            (torch.bfloat16, "bfloat16"),
            ("float16", "float16"),
            ("half", "float16"),
            (torch.float16, "float16"),
            (np.float16, "float16"),
            ("float32", "float32"),
            ("fp32", "float32"),
            (torch.float32, "float32"),
            (np.dtype("float32"), "float32"),
        ]
        invalid = ["int32", "float64", "", torch.int64, np.float64, None, 3, [torch.float16]]

        @fuzz("prepare")
        @given(
            ok=st.booleans(),
            good=st.sampled_from(valid),
            bad=st.sampled_from(invalid),
            which=st.sampled_from(["none", "fixed16"]),
            framework=st.sampled_from(["torch", "cupy"]),
            seed=st.integers(0, 10**6),
        )
        def prepare(ok: bool, good: tuple, bad: Any, which: str, framework: str, seed: int) -> None:
            comm = comms[which]
            before = comm.logits_dtype
            if ok:
                given_dtype, _ = good
                comm.prepare_verify_outputs(given_dtype)  # the first dtype wins: a no-op
                assert comm.logits_dtype == before
            else:
                with pytest.raises((TypeError, ValueError), match="dtype"):
                    comm.prepare_verify_outputs(bad)
                assert comm.logits_dtype == before
            _round_trip(comm, framework, seed)
            executed["prepare"] += 1

        comms["none"].prepare_verify_outputs("float32")
        swap()
        outputs()
        logprobs()
        prepare()
    finally:
        for c in comms.values():
            c.close()
    for name, n in budget.items():
        assert executed[name] >= n, (name, executed[name], n)
    assert sum(executed.values()) >= (200 if backend == "onesided" else 60)


# -- create/use/close cycles across processes -------------------------------------------
@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_create_use_close_cycles_across_processes_return_to_baseline() -> None:
    cycles = int(os.environ.get("IPC_DPSAMPLE_LIFECYCLE_CYCLES", "200"))
    out = run_ranks(2, rb.lifecycle_body, cycles, timeout_s=280, env=_GLOO)
    for rank, res in enumerate(out):
        assert res["first_leak"] is None, f"rank {rank}: open after close(): {res['first_leak']}"
        c = collections.Counter(res["counts"])
        # every cycle opened exactly one peer arena (the other process's) through IPC:
        # this also proves the counter saw the calls
        assert c["ipcOpenMemHandle"] == cycles + 1 == c["ipcCloseMemHandle"], (rank, c)
        assert c["malloc"] >= cycles + 1 and c["malloc"] == c["free"], (rank, c)
        assert c["hostAlloc"] >= cycles + 1 and c["hostAlloc"] == c["freeHost"], (rank, c)
        first, last = res["free"]
        assert abs(first - last) < (8 << 20), (
            f"rank {rank}: free device memory went {first} -> {last} over {cycles} cycles"
        )


# -- injected IPC failures across processes ---------------------------------------------
@pytest.fixture(scope="module", params=[2, 3], ids=["tp2", "tp3"])
def injection(request: Any) -> tuple[int, list[dict[str, dict[str, Any]]]]:
    """Every case of rb.INJECTION_CASES on ``tp`` processes sharing the GPU (one run)."""
    tp = request.param
    return tp, run_ranks(tp, rb.ipc_injection_body, timeout_s=300, env=_GLOO)


def _case_records(injection: Any, key: str) -> tuple[int, list[dict[str, Any]]]:
    tp, out = injection
    return tp, [ranks[key] for ranks in out]


@pytest.mark.multirank
@pytest.mark.timeout(400)
def test_without_injection_auto_picks_onesided(injection: Any) -> None:
    _, recs = _case_records(injection, "none/auto")
    for rank, rec in enumerate(recs):
        assert rec.get("backend") == "onesided", (rank, rec)
        assert rec["warnings"] == [], (rank, rec["warnings"])
        assert rec.get("ops_exact") is True, (rank, rec)


@pytest.mark.multirank
@pytest.mark.timeout(400)
@pytest.mark.parametrize("stage", ["open", "verify"])
def test_injected_ipc_failure_auto_falls_back_alike_on_every_rank(
    injection: Any, stage: str
) -> None:
    """auto on a host where the fallback can run (NCCL hidden: it refuses several
    ranks on one GPU, see the test below): every rank on torch, explain() and exactly
    one warning naming the injected cause, every op exact."""
    tp, recs = _case_records(injection, f"{stage}/auto-no-nccl")
    cause = rb.CAUSES[stage]
    for rank, rec in enumerate(recs):
        assert "error" not in rec, f"rank {rank}: {rec.get('error')}"
        assert rec["outcomes"] == ["torch"] * tp, rec["outcomes"]
        assert cause in rec["explain"], (rank, rec["explain"])
        assert len(rec["warnings"]) == 1, (rank, rec["warnings"])
        assert cause in rec["warnings"][0] and "falling back" in rec["warnings"][0]
        assert rec.get("ops_exact") is True, (rank, rec)


@pytest.mark.multirank
@pytest.mark.timeout(400)
@pytest.mark.parametrize("stage", ["open", "verify"])
def test_injected_ipc_failure_explicit_onesided_raises_on_every_rank(
    injection: Any, stage: str
) -> None:
    tp, recs = _case_records(injection, f"{stage}/onesided")
    cause = rb.CAUSES[stage]
    for rank, rec in enumerate(recs):
        assert rec.get("error_type") == "BackendUnavailableError", (rank, rec)
        msg = rec["error"]
        assert cause in msg, (rank, msg)
        assert "backend='auto'" in msg, (rank, msg)  # the fix
        assert rec["outcomes"] == ["error"] * tp
        assert rec["warnings"] == [], (rank, rec["warnings"])


@pytest.mark.multirank
@pytest.mark.timeout(400)
@pytest.mark.parametrize("stage", ["open", "verify"])
def test_injected_ipc_failure_auto_with_nccl_present_agrees_on_every_rank(
    injection: Any, stage: str
) -> None:
    """auto as installed (NCCL visible). Every rank must reach the same outcome and
    name the injected cause: a working fallback with exact ops, or (several ranks on
    one GPU, which NCCL refuses) BackendUnavailableError on every rank."""
    _, recs = _case_records(injection, f"{stage}/auto")
    cause = rb.CAUSES[stage]
    outcomes = recs[0]["outcomes"]
    assert len(set(outcomes)) == 1, f"ranks disagree: {outcomes}"
    for rank, rec in enumerate(recs):
        assert rec["outcomes"] == outcomes
        assert len(rec["warnings"]) == 1 and cause in rec["warnings"][0], (rank, rec["warnings"])
        if outcomes[0] == "error":
            assert rec["error_type"] == "BackendUnavailableError", (rank, rec)
            assert cause in rec["error"], (rank, rec["error"])
            if "chose nccl" in rec["error"]:
                assert "own GPU" in rec["error"], (rank, rec["error"])
        else:
            assert rec["backend"] != "onesided", rec
            assert cause in rec["explain"], (rank, rec["explain"])
            assert rec.get("ops_exact") is True, (rank, rec)


# -- a peer killed in the middle of an op -----------------------------------------------
KILL_TIMEOUT_S = 1.0
RAISE_SLACK_S = 2.0


def _judge_kill_trials(report: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Failures (one line each, with the log tail) and the summary lines."""
    wd = Path(report["workdir"])
    pairs = report["pairs"]
    failures: list[str] = []
    stats: dict[str, collections.Counter] = {op: collections.Counter() for op in rb.OP_NAMES}
    worst: dict[str, dict[str, float]] = {op: {"raise": 0.0, "close": 0.0} for op in rb.OP_NAMES}
    example: dict[str, str] = {}
    for t, (op, mode) in enumerate(report["jobs"]):
        st = stats[op]
        st["trials"] += 1
        st[mode] += 1
        where = f"trial {t} (mid-{op}, victim {mode})"
        if t in report["hung"]:
            st["hangs"] += 1
            failures.append(f"{where}: HUNG; logs: {wd}/pair{t % pairs}-*.log")
            continue
        rc = report["victim_rc"].get(t)
        if rc != -signal.SIGKILL:
            failures.append(
                f"{where}: victim exit status {rc}, expected {-signal.SIGKILL} (SIGKILL): "
                f"{report['victim_error'].get(t, '')[-1500:]}\n{rb.tail(wd / f'victim{t}.log')}"
            )
        recs = report["records"].get(t, {})
        for r in (0, 1):
            rec = recs.get(r)
            if rec is None:
                failures.append(
                    f"{where}: rank {r} reported nothing\n"
                    f"{rb.tail(wd / f'pair{t % pairs}-rank{r}.log')}"
                )
                continue
            if "error" in rec:
                failures.append(f"{where}: rank {r} failed:\n{rec['error'][-3000:]}")
                continue
            st["survivors"] += 1
            st["op_k_completed"] += bool(rec["op_k_completed"])
            problems = []
            if not rec["raised"]:
                problems.append("no PeerTimeoutError")
            else:
                elapsed = rec["elapsed_s"]
                worst[op]["raise"] = max(worst[op]["raise"], elapsed)
                allowed = [rb.VICTIM] if rec["raised_at"] == "k" else rec["acceptable_peers"]
                if elapsed > KILL_TIMEOUT_S + RAISE_SLACK_S:
                    problems.append(f"raised after {elapsed:.2f} s")
                if rec["peer"] not in allowed or f"peer rank {rec['peer']}" not in rec["message"]:
                    problems.append(f"named peer {rec['peer']} (allowed {allowed})")
                if rec["err_op"] != rb.OP_NAMES[op] or rec["err_rank"] != r:
                    problems.append(f"error names op {rec['err_op']!r}, rank {rec['err_rank']}")
                if mode == "skip" and rec["raised_at"] != "k":
                    problems.append("the op the victim skipped completed")
                if not rec["sticky"]:
                    problems.append("check() after the error did not raise again")
                if not problems:
                    st["raised_in_time"] += 1
                    st["named_victim"] += rec["peer"] == rb.VICTIM
                    example.setdefault(op, rec["message"])
            worst[op]["close"] = max(worst[op]["close"], rec["close_s"])
            if rec["close_s"] > 2 * KILL_TIMEOUT_S + 3.0:
                problems.append(f"close() of the broken communicator took {rec['close_s']:.2f} s")
            if rec.get("recovered"):
                st["recovered"] += 1
            else:
                problems.append("no recovery")
            if problems:
                failures.append(f"{where}: rank {r}: {'; '.join(problems)}: {rec.get('message')}")
    summary = []
    for op, st in stats.items():
        summary.append(
            f"reliability: dead peer mid-{rb.OP_NAMES[op]}: {st['trials']} trials (tp=3, rank 2 "
            f"SIGKILLed; {st['skip']} before issuing, {st['issue']} right after issuing), "
            f"{st['raised_in_time']}/{2 * st['trials']} survivors raised PeerTimeoutError in "
            f"time ({st['named_victim']} naming the dead rank 2, any others the survivor whose "
            f"communicator had broken first), max {worst[op]['raise']:.2f} s to raise (timeout_s="
            f"{KILL_TIMEOUT_S:g}, bound {KILL_TIMEOUT_S + RAISE_SLACK_S:g} s), "
            f"{st['recovered']}/{2 * st['trials']} rebuilt a tp=2 communicator and moved data "
            f"bit-exactly, hangs={st['hangs']}, max close of the broken communicator "
            f"{worst[op]['close']:.2f} s ({st['op_k_completed']} ops the victim issued before "
            "dying completed exactly)"
        )
    for op, msg in example.items():
        summary.append(f"reliability: example ({op}): {msg}")
    summary.append(
        f"reliability: kill trials ran in {report['wall_s']:.1f} s with {pairs} survivor pairs"
    )
    return failures, summary


@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_dead_peer_mid_op_raises_in_time_and_survivors_recover(tmp_path: Path) -> None:
    trials = int(os.environ.get("IPC_DPSAMPLE_KILL_TRIALS", "20"))
    if trials <= 0:
        pytest.skip("IPC_DPSAMPLE_KILL_TRIALS=0")
    pairs = int(os.environ.get("IPC_DPSAMPLE_KILL_PAIRS", "2"))
    # per op: even trials the victim dies instead of issuing, odd ones right after issuing
    jobs = [
        (op, "skip" if i % 2 == 0 else "issue") for i in range(trials) for op in ("swap", "gather")
    ]
    per_pair = -(-len(jobs) // max(1, pairs))
    report = rb.run_kill_trials(
        jobs,
        pairs=pairs,
        timeout_s=KILL_TIMEOUT_S,
        workdir=tmp_path / "kill",
        trial_deadline_s=60.0,
        total_deadline_s=90.0 + 20.0 * per_pair,
    )
    failures, summary = _judge_kill_trials(report)
    for line in summary:
        _report(line)
    out = os.environ.get("IPC_DPSAMPLE_RELIABILITY_OUT")
    if out:  # every survivor's per-trial record (time to raise, message, close time...)
        records = {str(t): recs for t, recs in sorted(report["records"].items())}
        Path(out + ".kill-trials.json").write_text(json.dumps(records, indent=1, default=str))
    assert not failures, (
        f"{len(failures)} problem(s) in {len(jobs)} kill trials:\n"
        + "\n".join(failures[:8])
        + ("\n..." if len(failures) > 8 else "")
    )

"""``verify_batch_vocab`` on the one-sided backend, on a real GPU: ranks as threads of
this process (one stream each) and as processes sharing the GPU through CUDA IPC.

Every call is checked against :func:`ipc_dpsample.layout.reference_verify_batch_vocab`
on fresh random logits (never zeros; the special rows of ``tests/_verify_bodies.py``:
NaN, ``±inf``, overflow, ties): ``predict``, ``accept_index``, ``accept_length`` bit for
bit, logprobs within 1 float32 ulp. Outputs are poisoned (0xFF bytes) before each call
and the rows of phantom requests must still hold the poison. Batches with top-p or
min-p but no top-k take the swap path (``last_verify_path`` says which path ran).
"""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import threading
from typing import Any

import numpy as np
import pytest
from _gpu_common import gpu_skip_reason, onesided_comm
from _verify_bodies import (
    Case,
    accepting_candidates,
    assert_logprobs,
    encode,
    logits,
    params,
    storage,
)

from ipc_dpsample import DpSampleError
from ipc_dpsample.backends.verify_plan import BROADCAST_MAX_ROWS
from ipc_dpsample.layout import reference_verify_batch_vocab
from ipc_dpsample.testing import run_ranks, run_threads

_REASON = gpu_skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]
POISON32 = -1
_CAPTURE_LOCK = threading.Lock()


def _settle(comm: Any, what: str) -> None:
    import torch

    torch.cuda.current_stream().synchronize()
    comm._group.barrier(timeout_s=60, what=what)


_REFS: dict[Any, Any] = {}
_REFS_LOCK = threading.Lock()


def _reference(key: tuple[int, ...], case: Case, tp: int, n: int, v: int, dtype: str) -> Any:
    """The case's shards, parameters, bs, candidates and expected outputs, computed once
    for all rank threads (the NumPy reference of a 152064-column batch takes seconds)."""
    with _REFS_LOCK:
        k = (key, case, tp, n, v, dtype)
        if k not in _REFS:
            vs, pad_bs = v // tp, case.pad_bs
            raw = logits(key, pad_bs * n, v, scale=case.scale, specials=case.specials)
            full = encode(raw, dtype)
            shards = [full[:, s * vs : (s + 1) * vs].contiguous() for s in range(tp)]
            prm = params((*key, 1), pad_bs, case.mode)
            bs_value = case.bs
            if isinstance(case.bs, str):
                bs_value = int(case.bs.split(":")[1])
            kw = dict(tp=tp, pad_bs=pad_bs, dtype=dtype, vocab_limit=case.vocab_limit, bs=bs_value)
            inputs = [storage(s) for s in shards]
            zero = np.zeros((pad_bs, n), np.int32)
            first = reference_verify_batch_vocab(inputs, zero, **kw, **prm)
            cand = accepting_candidates((*key, 2), first[0], v)
            want = reference_verify_batch_vocab(
                inputs, cand, **kw, **prm, return_logprobs=case.return_logprobs
            )
            if len(_REFS) > 64:
                _REFS.clear()
            _REFS[k] = (shards, prm, bs_value, cand, want)
        return _REFS[k]


def gpu_case(comm: Any, rank: int, tp: int, key: tuple[int, ...], case: Case) -> str:
    """One call against the reference; returns the path the backend took."""
    import torch

    cfg = comm.config
    n, v, dtype = cfg.num_tokens_per_req, cfg.vocab_size, comm.logits_dtype
    pad_bs = case.pad_bs
    shards, prm, bs_value, cand, want = _reference(key, case, tp, n, v, dtype)
    x, c = shards[rank].cuda(), torch.from_numpy(cand).cuda()
    on_stream: Any = contextlib.nullcontext()
    if case.kind == "cupy":
        import cupy

        x, c = cupy.from_dlpack(x), cupy.from_dlpack(c)
        # CuPy arrays run on CuPy's current stream: the rank thread's own one
        on_stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)

    def arg(a: Any) -> Any:
        if a is None or case.params_kind == "numpy":
            return a
        return torch.from_numpy(a).cuda()

    bs_arg: Any = case.bs
    if isinstance(case.bs, str):
        bs_arg = torch.tensor(bs_value, dtype=torch.int32, device="cuda")
    _settle(comm, "inputs")
    comm._backend.poison_for_testing()
    comm._group.barrier(timeout_s=60, what="poisoned")
    with on_stream:
        outs = comm.verify_batch_vocab(
            x,
            c,
            pad_bs=pad_bs,
            vocab_limit=case.vocab_limit,
            bs=bs_arg,
            return_logprobs=case.return_logprobs,
            **{k: arg(a) for k, a in prm.items()},
        )
    _settle(comm, "verified")
    comm.check()
    what = f"{case} {dtype} tp={tp} N={n} V={v} rank={rank}"
    real = pad_bs if bs_value is None else bs_value
    names = ("predict", "accept_index", "accept_length", "logprobs")
    assert len(outs) == len(want), what
    for name, got, w in zip(names[: len(outs)], outs, want, strict=True):
        g = got.get() if case.kind == "cupy" else got.cpu().numpy()
        assert g.shape == w.shape and g.dtype == w.dtype, (what, name, g.shape, g.dtype)
        if name == "logprobs":
            assert_logprobs(f"{what}: {name}", g[:real], w[:real])
            assert (g[real:].view(np.int32) == POISON32).all(), f"{what}: phantom {name}"
        else:
            bad = np.argwhere(g[:real] != w[:real])
            assert not len(bad), f"{what}: {name} differs at {bad[:4].tolist()}"
            assert (g[real:] == POISON32).all(), f"{what}: a phantom {name} row was written"
    path = comm._backend.last_verify_path
    kernel_modes = ("greedy", "temperature", "top_k", "top_k_top_p")
    if case.mode in kernel_modes:
        assert path == "kernels", (what, path)
    elif case.mode in ("top_p", "min_p"):
        assert path.startswith("swap: "), (what, path)
    return path


def _cases(tp: int, dtype: str) -> list[Case]:
    p2, p4, vs = 2 * tp, 4 * tp, 250
    return [
        Case("greedy", p2, specials=True),
        Case("temperature", p4, params_kind="torch"),
        Case("top_k", p2, bs=p2 - 1, vocab_limit=vs * tp - 7, kind="cupy"),
        Case("top_k_top_p", p4, params_kind="torch", return_logprobs=False),
        Case("top_k_top_p", p2, bs=f"tensor:{max(1, p2 - 3)}", scale=0.1),
        Case("mixed", p4, specials=True, vocab_limit=min(vs + 5, vs * tp - 1)),
        Case("min_p", p2, specials=True, bs=max(1, p2 - 3)),
        Case("top_p", p2, scale=0.1),
        Case("mixed", p2, bs=0),
    ]


def warm_sampler(dtype: str, n: int, v: int) -> None:
    """Run the swap path's torch sampler once on local rows of every mode: its kernels
    load lazily, and a rank thread loading one while a peer's kernel spins on the shared
    GPU can stall that peer until the timeout (README, rank threads)."""
    import torch

    from ipc_dpsample.sampling import verify_rows

    for mode in ("top_p", "min_p", "mixed"):
        prm = params((5,), 2, mode)
        rows = encode(logits((6,), 2 * n, v, scale=1.0, specials=False), dtype).cuda()
        cand = torch.zeros((2, n), dtype=torch.int32, device="cuda")
        kw = {k: None if a is None else torch.from_numpy(a).cuda() for k, a in prm.items()}
        verify_rows(rows, cand, **kw, return_logprobs=True)
    torch.cuda.synchronize()


def _matrix_body(rank: int, tp: int, group: Any, max_pad_bs: int) -> dict[str, int]:
    import torch

    torch.cuda.set_device(0)
    paths: dict[str, int] = {}
    with torch.cuda.stream(torch.cuda.Stream()):
        for d, dtype in enumerate(("float32", "bfloat16", "float16")):
            n = (3, 1, 4)[d]
            warm_sampler(dtype, n, 250 * tp)
            group.barrier(timeout_s=120, what="warm")
            with onesided_comm(
                group, rank, tp, max_pad_bs=max_pad_bs, num_tokens_per_req=n,
                vocab_size=250 * tp, logits_dtype=dtype,
            ) as comm:  # fmt: skip
                for i, case in enumerate(_cases(tp, dtype)):
                    path = gpu_case(comm, rank, tp, (31, d, i), case).split(":")[0]
                    paths[path] = paths.get(path, 0) + 1
                    if path == "kernels" and comm._backend.last_verify_broadcast:
                        paths["broadcast"] = paths.get("broadcast", 0) + 1
                    if path == "kernels" and case.pad_bs * n <= BROADCAST_MAX_ROWS:
                        paths["small"] = paths.get("small", 0) + 1
    return paths


# IPC_DPSAMPLE_VERIFY_BROADCAST: auto broadcasts the records of the batches up to 64 rows
# (at tp <= 4 every case here; at tp = 8 the smaller ones, the larger ones go to their
# owners); on, with an arena sized for tp times the largest case, broadcasts every
# kernel call; off never does
@pytest.mark.parametrize(
    ("tp", "broadcast"),
    [(1, "auto"), (2, "auto"), (3, "auto"), (4, "auto"), (8, "auto"),
     (2, "on"), (3, "on"), (8, "on"), (2, "off"), (8, "off")],
)  # fmt: skip
def test_verify_matches_the_reference_on_rank_threads(
    tp: int, broadcast: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IPC_DPSAMPLE_VERIFY_BROADCAST", broadcast)
    max_pad_bs = 4 * tp * (tp if broadcast == "on" else 1)
    out = run_threads(tp, _matrix_body, max_pad_bs, timeout_s=900)
    paths = out[0]
    assert paths["kernels"] >= 15 and paths["swap"] >= 6, paths
    assert all(o == paths for o in out), out
    if broadcast == "on":
        assert paths.get("broadcast") == paths["kernels"], paths
    elif broadcast == "off" or tp == 1:
        assert "broadcast" not in paths, paths
    else:  # auto: every batch up to 64 rows, and only those
        assert paths.get("broadcast") == paths.get("small"), paths
        assert tp < 8 or paths["small"] < paths["kernels"], paths


def _large_body(rank: int, tp: int, group: Any) -> int:
    """The issue's shape: V = 152064, N = 4, every kernel mode, fp32 and bf16."""
    import torch

    torch.cuda.set_device(0)
    done = 0
    with torch.cuda.stream(torch.cuda.Stream()):
        for dtype in ("float32", "bfloat16"):
            with onesided_comm(
                group, rank, tp, max_pad_bs=32, num_tokens_per_req=4, vocab_size=152064,
                logits_dtype=dtype,
            ) as comm:  # fmt: skip
                for i, mode in enumerate(("temperature", "top_k_top_p", "mixed")):
                    case = Case(mode, 32, vocab_limit=151936 if i == 2 else None, specials=i == 2)
                    gpu_case(comm, rank, tp, (41, i), case)
                    done += 1
    return done


def test_verify_at_the_real_vocabulary_tp8() -> None:
    assert run_threads(8, _large_body, timeout_s=900) == [6] * 8


def _processes_body(rank: int, tp: int, group: Any) -> int:
    import torch

    torch.cuda.set_device(0)
    with onesided_comm(
        group, rank, tp, max_pad_bs=2 * tp, num_tokens_per_req=3, vocab_size=250 * tp,
        logits_dtype="bfloat16", backend="auto",
    ) as comm:  # fmt: skip
        assert comm.backend == "onesided", comm.explain()
        for i, case in enumerate(
            (Case("mixed", 2 * tp, specials=True), Case("top_k_top_p", 2 * tp, bs=tp + 1))
        ):
            gpu_case(comm, rank, tp, (51, i), case)
    return 2


@pytest.mark.parametrize("tp", [2, 4])
def test_verify_across_processes_sharing_one_gpu(tp: int) -> None:
    out = run_ranks(
        tp, _processes_body, timeout_s=600, env={"IPC_DPSAMPLE_TEST_PG_BACKEND": "gloo"}
    )
    assert out == [2] * tp


def _error_of(comm: Any, call: Any) -> str:
    """The text of the DpSampleError that ``call`` leads to, or "no error". A kernel's
    report reaches the host at its next issue (the call's own gathers, when the report
    is already visible) or at check() after the stream drains."""
    import torch

    try:
        call()
        torch.cuda.current_stream().synchronize()
        comm.check()
    except DpSampleError as exc:
        return str(exc)
    return "no error"


def _mismatch_body(rank: int, tp: int, group: Any, what: str) -> str:
    import torch

    torch.cuda.set_device(0)
    pad_bs, n, v = 2 * tp, 2, 100 * tp
    with torch.cuda.stream(torch.cuda.Stream()):
        with onesided_comm(
            group, rank, tp, max_pad_bs=pad_bs, num_tokens_per_req=n, vocab_size=v,
            logits_dtype="float32", timeout_s=5.0,
        ) as comm:  # fmt: skip
            g = np.random.default_rng(3)
            x = torch.from_numpy(g.normal(0, 2, (pad_bs * n, v // tp)).astype(np.float32)).cuda()
            cand = np.zeros((pad_bs, n), np.int32)
            temp = np.full(pad_bs, 0.7, np.float32)
            if what == "temperature" and rank == tp - 1:
                temp[1] = 0.8
            if what == "candidates" and rank == tp - 1:
                cand[0, 1] = 5
            kw = dict(seed=np.arange(pad_bs), offset=np.zeros(pad_bs, np.int64))
            c = torch.from_numpy(cand).cuda()
            _settle(comm, "inputs")
            return _error_of(
                comm, lambda: comm.verify_batch_vocab(x, c, pad_bs=pad_bs, temperature=temp, **kw)
            )


@pytest.mark.parametrize("broadcast", ["on", "off"])
@pytest.mark.parametrize("what", ["temperature", "candidates"])
def test_ranks_passing_different_arguments_raise(
    what: str, broadcast: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IPC_DPSAMPLE_VERIFY_BROADCAST", broadcast)
    out = run_threads(2, _mismatch_body, what, timeout_s=120)
    found = "called verify_batch_vocab with different arguments"
    if broadcast == "on":  # every rank combines every request, so every rank sees it
        assert all(found in t for t in out), out
        return
    # a rank that owns a differing row says so; the others wait for its gathers and
    # time out, pointed at the verify's argument check
    for text in out:
        assert found in text or (
            "did not take part" in text and "was verify_batch_vocab" in text
        ), out
    assert any(found in t for t in out), out


def _graph_body(rank: int, tp: int, group: Any, replays: int) -> list[Any]:
    """verify_batch_vocab captured once with device parameters, candidates and a device
    ``bs``; every replay writes new logits, candidates, parameters of a new mix and a new
    ``bs`` into the captured tensors and checks the whole batch against the reference."""
    import random

    import torch

    torch.cuda.set_device(0)
    n, vs, pad_bs, dtype = 3, 200, 2 * tp, "bfloat16"
    v = vs * tp
    limit = v - 9
    rng = random.Random(7)
    modes = ("greedy", "temperature", "top_k", "top_k_top_p", "mixed_top_k")
    failures: list[Any] = []
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        comm = onesided_comm(
            group, rank, tp, max_pad_bs=pad_bs, num_tokens_per_req=n, vocab_size=v,
            logits_dtype=dtype,
        )  # fmt: skip

        def inputs(i: int) -> tuple[Any, ...]:
            mode = modes[i % len(modes)]
            prm = params((61, i), pad_bs, "mixed" if mode == "mixed_top_k" else mode)
            if mode == "mixed_top_k":  # top-p / min-p only where top-k is on
                on = (prm["top_k"] >= 2) & (prm["top_k"] <= 128)
                prm["top_p"] = np.where(on, prm["top_p"], 1).astype(np.float32)
                prm["min_p"] = np.where(on, prm["min_p"], 0).astype(np.float32)
            full = encode(logits((62, i), pad_bs * n, v, scale=2.0, specials=i % 3 == 0), dtype)
            shards = [full[:, s * vs : (s + 1) * vs].contiguous() for s in range(tp)]
            bs = pad_bs if i == 0 else rng.randint(0, pad_bs)
            kw = dict(tp=tp, pad_bs=pad_bs, dtype=dtype, vocab_limit=limit, bs=bs)
            inp = [storage(sh) for sh in shards]
            first = reference_verify_batch_vocab(inp, np.zeros((pad_bs, n), np.int32), **kw, **prm)
            cand = accepting_candidates((63, i), first[0], v)
            want = reference_verify_batch_vocab(inp, cand, **kw, **prm, return_logprobs=True)
            full_prm = {  # every array present, so the captured pointers always exist
                "temperature": prm["temperature"],
                "top_k": np.zeros(pad_bs, np.int32) if prm["top_k"] is None else prm["top_k"],
                "top_p": np.ones(pad_bs, np.float32) if prm["top_p"] is None else prm["top_p"],
                "min_p": np.zeros(pad_bs, np.float32) if prm["min_p"] is None else prm["min_p"],
                "seed": prm["seed"],
                "offset": prm["offset"],
            }
            return shards[rank], cand, full_prm, bs, want

        static_x = torch.empty((pad_bs * n, vs), dtype=torch.bfloat16, device="cuda")
        static_c = torch.empty((pad_bs, n), dtype=torch.int32, device="cuda")
        x0, c0, p0, _, _ = inputs(0)
        static_p = {k: torch.from_numpy(a).cuda() for k, a in p0.items()}
        bs_dev = torch.full((1,), pad_bs, dtype=torch.int32, device="cuda")
        static_x.copy_(x0)
        static_c.copy_(torch.from_numpy(c0))

        def call() -> tuple[Any, ...]:
            return comm.verify_batch_vocab(
                static_x, static_c, pad_bs=pad_bs, vocab_limit=limit, bs=bs_dev,
                return_logprobs=True, **static_p,
            )  # fmt: skip

        _settle(comm, "warm-up inputs")
        call()  # eager warm-up: loads the kernels
        _settle(comm, "warm-up done")
        comm.check()
        graph = torch.cuda.CUDAGraph()
        with (
            _CAPTURE_LOCK,
            torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"),
        ):
            outs = call()
        _settle(comm, "captured")
        for i in range(1, replays + 1):
            x, c, p, bs, want = inputs(i)
            static_x.copy_(x)
            static_c.copy_(torch.from_numpy(c))
            for k, a in p.items():
                static_p[k].copy_(torch.from_numpy(a))
            bs_dev.fill_(bs)
            _settle(comm, f"inputs of replay {i}")
            graph.replay()
            comm._group.barrier(timeout_s=60, what=f"replay {i} issued")
            _settle(comm, f"replay {i} done")
            comm.check()
            for name, got, w in zip(
                ("predict", "accept_index", "accept_length"), outs[:3], want[:3], strict=True
            ):
                if not np.array_equal(got.cpu().numpy()[:bs], w[:bs]):
                    failures.append((i, bs, name))
            assert_logprobs(f"replay {i}", outs[3].cpu().numpy()[:bs], want[3][:bs])
        comm._group.barrier(timeout_s=60, what="before close")
        comm.close()
    return failures


@pytest.mark.parametrize(("tp", "broadcast"), [(2, "auto"), (4, "auto"), (4, "off")])
def test_graph_replayed_50_times_with_new_device_parameters(
    tp: int, broadcast: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # auto broadcasts these batches (2 * tp * 3 rows); off sends them to the owners
    monkeypatch.setenv("IPC_DPSAMPLE_VERIFY_BROADCAST", broadcast)
    out = run_threads(tp, _graph_body, 50, timeout_s=600)
    assert out == [[]] * tp, out


def _value_body(rank: int, tp: int, group: Any, field: str) -> str:
    """A refused value in a device parameter array raises at the call's gathers or the
    next check()."""
    import torch

    torch.cuda.set_device(0)
    pad_bs, n, v = 2 * tp, 2, 200 * tp
    with torch.cuda.stream(torch.cuda.Stream()):
        with onesided_comm(
            group, rank, tp, max_pad_bs=pad_bs, num_tokens_per_req=n, vocab_size=v,
            logits_dtype="float32",
        ) as comm:  # fmt: skip
            g = np.random.default_rng(4)
            x = torch.from_numpy(g.normal(0, 2, (pad_bs * n, v // tp)).astype(np.float32)).cuda()
            kw = {
                "temperature": torch.full((pad_bs,), 0.8, device="cuda"),
                "top_k": torch.full((pad_bs,), 40, dtype=torch.int32, device="cuda"),
                "top_p": torch.full((pad_bs,), 0.9, device="cuda"),
                "seed": torch.arange(pad_bs, device="cuda"),
                "offset": torch.zeros(pad_bs, dtype=torch.int64, device="cuda"),
            }
            if field == "top_k":
                kw["top_k"][1] = 200  # 129 .. vocab_limit - 1 (400 and above mean off)
            else:
                kw["top_k"][1] = 0  # top-p without top-k
            cand = torch.zeros((pad_bs, n), dtype=torch.int32, device="cuda")
            _settle(comm, "inputs")
            return _error_of(comm, lambda: comm.verify_batch_vocab(x, cand, pad_bs=pad_bs, **kw))


@pytest.mark.parametrize("field", ["top_k", "needs_top_k"])
def test_refused_device_values_raise_on_every_rank(field: str) -> None:
    out = run_threads(2, _value_body, field, timeout_s=120)
    for text in out:
        assert "top_k[1]=200" in text if field == "top_k" else "top_p / min_p[1]=0.9" in text

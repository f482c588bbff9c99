"""Rank bodies for the multi-rank tests.

They live at module level in a module of their own so that ``spawn`` children can
import them by name (``conftest.py`` puts ``tests/`` on ``sys.path``, and spawned
children inherit the parent's ``sys.path``). Each body has the signature
``body(rank, world_size, group, *args)`` of :func:`ipc_dpsample.testing.run_ranks`
and returns plain data the parent asserts on; every body also asserts itself, so a
wrong result fails the rank that saw it, with its traceback.

Every rank derives every rank's inputs from one shared seed, so each rank computes
the NumPy reference of what it must receive without any extra communication, and
checks its own result bit-exactly. Inputs are random and never zero; outputs of
earlier ops are poisoned before the next op, so a skipped or partial copy shows.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from typing import Any

import numpy as np
import torch

import ipc_dpsample.rendezvous as comm_module  # where records are built and packed
from ipc_dpsample import ConfigMismatchError, DpSampleError, DpSamplingComm
from ipc_dpsample.config import AGREED_FIELDS
from ipc_dpsample.layout import (
    reference_gather_verify_logprobs,
    reference_gather_verify_outputs,
    reference_swap_batch_vocab,
)

LOGITS_DTYPES = ("bfloat16", "float16", "float32")
TORCH_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "int32": torch.int32,
}
#: Same-width integer type used to compare values bit for bit.
_BITS_TORCH = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
    torch.int32: torch.int32,
}
_BITS_NUMPY = {
    np.dtype(np.float16): np.int16,
    np.dtype(np.float32): np.int32,
    np.dtype(np.int32): np.int32,
}

#: A config mismatch must be reported within this many seconds.
MISMATCH_DEADLINE_S = 15.0


# -- data ----------------------------------------------------------------------------
def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([abs(int(k)) for k in key])


def random_logits(key: tuple[int, ...], shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    """Random, finite, never-zero logits of ``dtype`` (same on every rank for one key)."""
    x = np.array(_rng(*key).standard_normal(shape) * 8.0, dtype=np.float32)
    x[np.abs(x) < 1e-2] = 1.5
    return torch.from_numpy(x).to(TORCH_DTYPES[dtype])


def random_int32(key: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """Random int32 over the whole range, never zero."""
    x = _rng(*key).integers(1, 2**31 - 1, size=shape, dtype=np.int64)
    sign = _rng(*key, 7).integers(0, 2, size=shape) * 2 - 1
    return torch.from_numpy(np.array(x * sign, dtype=np.int32))


def random_logprobs(key: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """Random negative float32 log-probabilities, never zero."""
    x = -(_rng(*key).random(shape, dtype=np.float32) * 20.0 + 1e-3)
    return torch.from_numpy(np.array(x, dtype=np.float32))


def bits(x: Any) -> np.ndarray:
    """The bit pattern of a torch tensor or NumPy array as a NumPy integer array."""
    if isinstance(x, torch.Tensor):
        return x.detach().contiguous().view(_BITS_TORCH[x.dtype]).numpy().copy()
    return np.ascontiguousarray(x).view(_BITS_NUMPY[x.dtype]).copy()


def poison(x: Any) -> None:
    """Overwrite an output view in place with a pattern no test input contains."""
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point:
            x.fill_(float("nan"))
        else:
            x.fill_(0)
    else:
        x.fill(np.nan if x.dtype.kind == "f" else 0)


def as_kind(t: torch.Tensor, kind: str) -> Any:
    """``t`` as a torch tensor or a NumPy array."""
    return t if kind == "torch" else t.numpy()


def assert_bits(name: str, got: Any, want: np.ndarray, kind: str) -> None:
    expected_type = torch.Tensor if kind == "torch" else np.ndarray
    assert isinstance(got, expected_type), f"{name}: got {type(got)}, expected {expected_type}"
    g = bits(got)
    assert g.shape == want.shape, f"{name}: shape {g.shape} != expected {want.shape}"
    if not np.array_equal(g, want):
        bad = np.argwhere(g != want)
        raise AssertionError(
            f"{name}: {len(bad)} of {want.size} elements differ from the reference; "
            f"first at {tuple(bad[0])}: got {g[tuple(bad[0])]:#x}, want {want[tuple(bad[0])]:#x}"
        )


class Checker:
    """Runs ops on one communicator and checks each result against the reference.

    Every rank builds every rank's inputs from ``(seed, op index, source rank)``.
    Before each op the outputs of all earlier ops of this communicator are poisoned.
    """

    def __init__(self, comm: DpSamplingComm, rank: int, tp: int, seed: int):
        self.comm = comm
        self.rank = rank
        self.tp = tp
        self.seed = seed
        self.step = 0
        self.views: list[Any] = []
        self.checked = 0

    def _prepare(self) -> int:
        for v in self.views:
            poison(v)
        self.step += 1
        return self.step

    def _keep(self, *outs: Any) -> None:
        for o in outs:
            if not any(o is v for v in self.views):
                self.views.append(o)

    def swap(self, pad_bs: int, kind: str = "torch") -> Any:
        c = self.comm.config
        n, shard, dtype = c.num_tokens_per_req, c.vocab_size // self.tp, self.comm.logits_dtype
        assert dtype is not None
        step = self._prepare()
        xs = [
            random_logits((self.seed, step, s, 1), (pad_bs * n, shard), dtype)
            for s in range(self.tp)
        ]
        want = reference_swap_batch_vocab(
            [bits(x) for x in xs], tp=self.tp, num_tokens_per_req=n, pad_bs=pad_bs
        )[self.rank]
        mine = as_kind(xs[self.rank], kind)
        before = bits(mine)
        out = self.comm.swap_batch_vocab(mine, pad_bs=pad_bs)
        assert_bits(f"swap_batch_vocab(pad_bs={pad_bs}, {dtype}, N={n})", out, want, kind)
        assert np.array_equal(bits(mine), before), "swap_batch_vocab modified its input"
        if kind == "torch":
            assert out.dtype == TORCH_DTYPES[dtype]
        self._keep(out)
        self.checked += 1
        return out

    def gather_outputs(self, pad_bs: int, kind: str = "torch") -> tuple[Any, Any, Any]:
        n, r = self.comm.config.num_tokens_per_req, pad_bs // self.tp
        step = self._prepare()
        pred = [random_int32((self.seed, step, s, 2), (r, n)) for s in range(self.tp)]
        acc = [random_int32((self.seed, step, s, 3), (r, n)) for s in range(self.tp)]
        length = [random_int32((self.seed, step, s, 4), (r,)) for s in range(self.tp)]
        want = reference_gather_verify_outputs(
            [bits(x) for x in pred], [bits(x) for x in acc], [bits(x) for x in length]
        )
        args = [as_kind(x[self.rank], kind) for x in (pred, acc, length)]
        outs = self.comm.gather_verify_outputs(*args, pad_bs=pad_bs)
        assert len(outs) == 3
        for name, got, w in zip(
            ("predict", "accept_index", "accept_length"), outs, want, strict=True
        ):
            assert_bits(f"gather_verify_outputs[{name}](pad_bs={pad_bs}, N={n})", got, w, kind)
        self._keep(*outs)
        self.checked += 1
        return outs

    def gather_logprobs(self, pad_bs: int, kind: str = "torch") -> Any:
        n, r = self.comm.config.num_tokens_per_req, pad_bs // self.tp
        step = self._prepare()
        lps = [random_logprobs((self.seed, step, s, 5), (r, n)) for s in range(self.tp)]
        want = reference_gather_verify_logprobs([bits(x) for x in lps])
        out = self.comm.gather_verify_logprobs(as_kind(lps[self.rank], kind), pad_bs=pad_bs)
        assert_bits(f"gather_verify_logprobs(pad_bs={pad_bs}, N={n})", out, want, kind)
        self._keep(out)
        self.checked += 1
        return out


def _comm(rank: int, tp: int, group: Any, **kw: Any) -> DpSamplingComm:
    return DpSamplingComm(tp_size=tp, rank=rank, group=group, device="cpu", **kw)


# -- the torch backend on random data ----------------------------------------------------
def torch_matrix(rank: int, tp: int, group: Any, seed: int) -> dict[str, int]:
    """dtype x N x pad_bs on fresh communicators, then 50 back-to-back alternating ops,
    then two communicators on one group, then close semantics. Returns counts."""
    counts = {"matrix": 0, "alternating": 0, "two_comms": 0}
    # every pad_bs up to max_pad_bs = 3 * tp; vocab shard 5 (odd, not a power of two)
    for dtype in LOGITS_DTYPES:
        for n in (1, 3):
            with _comm(
                rank, tp, group, max_pad_bs=3 * tp, num_tokens_per_req=n,
                vocab_size=5 * tp, logits_dtype=dtype,
            ) as comm:  # fmt: skip
                assert comm.backend == "torch", comm.explain()
                chk = Checker(comm, rank, tp, seed)
                for pad_bs in (tp, 3 * tp, 2 * tp):
                    kind = "numpy" if dtype != "bfloat16" and pad_bs == 2 * tp else "torch"
                    chk.swap(pad_bs, kind)
                    chk.gather_outputs(pad_bs, kind)
                    chk.gather_logprobs(pad_bs, kind)
                counts["matrix"] += chk.checked

    # 50 back-to-back ops, alternating, random pad_bs (same on every rank), the array
    # type chosen per rank (ranks need not agree on it)
    order = random.Random(seed)
    kinds = random.Random(seed * 31 + rank)
    with _comm(
        rank, tp, group, max_pad_bs=4 * tp, num_tokens_per_req=2,
        vocab_size=3 * tp, logits_dtype="float16",
    ) as comm:  # fmt: skip
        chk = Checker(comm, rank, tp, seed + 1)
        ops = (chk.swap, chk.gather_outputs, chk.gather_logprobs)
        for i in range(50):
            pad_bs = tp * order.randint(1, 4)
            ops[i % 3](pad_bs, kinds.choice(("torch", "numpy")))
        counts["alternating"] = chk.checked

    counts["two_comms"] = _two_comms(rank, tp, group, seed + 2)
    _close_semantics(rank, tp, group)
    return counts


def _two_comms(rank: int, tp: int, group: Any, seed: int) -> int:
    """Two communicators on one group, ops interleaved; an output stays intact until
    the next op on its own communicator."""
    a = _comm(
        rank, tp, group, max_pad_bs=2 * tp, num_tokens_per_req=2, vocab_size=3 * tp,
        logits_dtype="bfloat16",
    )  # fmt: skip
    b = _comm(
        rank, tp, group, max_pad_bs=4 * tp, num_tokens_per_req=1, vocab_size=7 * tp,
        logits_dtype="float32",
    )  # fmt: skip
    try:
        ca, cb = Checker(a, rank, tp, seed), Checker(b, rank, tp, seed + 100)
        for i in range(6):
            out_a = ca.swap(tp * (1 + i % 2))
            keep = bits(out_a)
            cb.swap(tp * (1 + i % 4))
            cb.gather_outputs(tp * (4 - i % 4))
            cb.gather_logprobs(tp)
            assert np.array_equal(bits(out_a), keep), "an op on comm b changed comm a's output"
            ca.gather_logprobs(tp * (2 - i % 2))
            ca.gather_outputs(2 * tp)
        return ca.checked + cb.checked
    finally:
        a.close()
        b.close()


def _close_semantics(rank: int, tp: int, group: Any) -> None:
    comm = _comm(
        rank, tp, group, max_pad_bs=tp, num_tokens_per_req=1, vocab_size=tp,
        logits_dtype="float32",
    )  # fmt: skip
    assert comm.is_open
    comm.close()
    comm.close()  # idempotent
    assert not comm.is_open
    x = torch.ones(tp, 1)
    i32 = torch.ones(1, 1, dtype=torch.int32)
    for call in (
        lambda: comm.swap_batch_vocab(x, pad_bs=tp),
        lambda: comm.gather_verify_outputs(i32, i32, i32[:, 0], pad_bs=tp),
        lambda: comm.gather_verify_logprobs(torch.ones(1, 1), pad_bs=tp),
        lambda: comm.prepare_verify_outputs("float32"),
        comm.check,
    ):
        try:
            call()
        except DpSampleError as exc:
            assert "closed" in str(exc), exc
        else:
            raise AssertionError("a closed communicator accepted an op")


# -- runtime mismatch ------------------------------------------------------------------
def _expect_divergence(rank: int, what: str, call: Any) -> str:
    t0 = time.monotonic()
    try:
        call()
    except DpSampleError as exc:
        elapsed = time.monotonic() - t0
        assert elapsed < MISMATCH_DEADLINE_S, f"{what}: took {elapsed:.1f} s to report"
        return str(exc)
    raise AssertionError(f"rank {rank}: {what}: no DpSampleError (data may be wrong)")


def runtime_mismatch_pad_bs(rank: int, tp: int, group: Any) -> list[str]:
    """The last rank passes another (valid) pad_bs to each op in turn: every rank
    raises DpSampleError, none returns data. A fresh communicator works afterwards."""
    messages = []
    last = rank == tp - 1
    ops = ("swap", "gather_outputs", "gather_logprobs")
    for op in ops:
        with _comm(
            rank, tp, group, max_pad_bs=2 * tp, num_tokens_per_req=2, vocab_size=2 * tp,
            logits_dtype="float32",
        ) as comm:  # fmt: skip
            chk = Checker(comm, rank, tp, 5)
            pad_bs = 2 * tp if last else tp
            msg = _expect_divergence(rank, op, lambda: getattr(chk, op)(pad_bs))  # noqa: B023
            assert "pad_bs" in msg, msg
            messages.append(msg)
    _fresh_comm_works(rank, tp, group)
    return messages


def runtime_mismatch_op(rank: int, tp: int, group: Any) -> list[str]:
    """The last rank calls another op than the others (every pair of ops): every rank
    raises DpSampleError, no process dies, and a fresh communicator works afterwards."""
    messages = []
    names = ("swap", "gather_outputs", "gather_logprobs")
    for mine_idx, theirs_idx in ((0, 1), (0, 2), (1, 2), (1, 0), (2, 0), (2, 1)):
        op = names[theirs_idx] if rank == tp - 1 else names[mine_idx]
        with _comm(
            rank, tp, group, max_pad_bs=2 * tp, num_tokens_per_req=2, vocab_size=2 * tp,
            logits_dtype="float32",
        ) as comm:  # fmt: skip
            chk = Checker(comm, rank, tp, 6)
            what = f"{names[mine_idx]} vs {names[theirs_idx]}"
            msg = _expect_divergence(rank, what, lambda: getattr(chk, op)(tp))  # noqa: B023
            messages.append(msg)
    _fresh_comm_works(rank, tp, group)
    return messages


def _fresh_comm_works(rank: int, tp: int, group: Any) -> None:
    with _comm(
        rank, tp, group, max_pad_bs=tp, num_tokens_per_req=1, vocab_size=tp,
        logits_dtype="float32",
    ) as comm:  # fmt: skip
        chk = Checker(comm, rank, tp, 99)
        chk.swap(tp)
        chk.gather_outputs(tp)
        chk.gather_logprobs(tp)


# -- config mismatch -------------------------------------------------------------------
def _base_kwargs(tp: int) -> dict[str, Any]:
    return {
        "max_pad_bs": 4 * tp,
        "num_tokens_per_req": 2,
        "vocab_size": 8 * tp,
        "logits_dtype": "float32",
        "backend": "auto",
        "device": "cpu",
    }


#: For each agreed field, the odd rank's change of the base configuration.
_FIELD_CHANGES: dict[str, dict[str, Any]] = {
    "max_pad_bs": {"max_pad_bs_factor": 2},
    "num_tokens_per_req": {"num_tokens_per_req": 3},
    "vocab_size": {"vocab_size_factor": 2},
    "logits_dtype": {"logits_dtype": "bfloat16"},
    "backend": {"backend": "torch"},
    "device_kind": {},  # simulated: the odd rank's record says "cuda" (no GPU here)
    "version": {},  # simulated by patching ipc_dpsample.rendezvous.__version__
    "graph_swap": {},  # the odd rank sets IPC_DPSAMPLE_GRAPH_SWAP=copy
}


def _construct(rank: int, tp: int, group: Any, field: str | None, odd: bool) -> DpSamplingComm:
    kw = _base_kwargs(tp)
    change = dict(_FIELD_CHANGES.get(field or "", {})) if odd else {}
    if "max_pad_bs_factor" in change:
        kw["max_pad_bs"] *= change.pop("max_pad_bs_factor")
    if "vocab_size_factor" in change:
        kw["vocab_size"] *= change.pop("vocab_size_factor")
    kw.update(change)
    return DpSamplingComm(tp_size=tp, rank=rank, group=group, **kw)


def config_mismatch_fields(rank: int, tp: int, group: Any, odd_rank: int) -> dict[str, str]:
    """For every agreed field except tp_size, rank ``odd_rank`` constructs with another
    value: every rank raises ConfigMismatchError naming the field, within seconds.
    Then malformed records, then a valid construction that works."""
    missing = set(AGREED_FIELDS) - set(_FIELD_CHANGES) - {"tp_size"}
    assert not missing, f"no mismatch case for agreed fields {sorted(missing)}"
    odd = rank == odd_rank
    messages = {}
    real_pack = comm_module.pack_record
    for field in _FIELD_CHANGES:
        saved = comm_module.__version__
        if field == "version" and odd:
            comm_module.__version__ = "99.0.0+mismatch"
        if field == "device_kind" and odd:
            comm_module.pack_record = lambda rec: real_pack(
                dataclasses.replace(rec, device_kind="cuda")
            )
        if field == "graph_swap" and odd:
            os.environ["IPC_DPSAMPLE_GRAPH_SWAP"] = "copy"
        t0 = time.monotonic()
        try:
            comm = _construct(rank, tp, group, field, odd)
        except ConfigMismatchError as exc:
            elapsed = time.monotonic() - t0
            assert elapsed < MISMATCH_DEADLINE_S, f"{field}: reported after {elapsed:.1f} s"
            assert field in exc.fields, f"{field}: fields {sorted(exc.fields)} ({exc})"
            assert set(exc.fields[field]) == set(range(tp)), exc.fields
            assert len(set(map(repr, exc.fields[field].values()))) == 2, exc.fields
            assert field in str(exc), str(exc)
            messages[field] = str(exc)
        else:
            comm.close()
            raise AssertionError(f"rank {rank}: {field} differs but construction succeeded")
        finally:
            comm_module.__version__ = saved
            comm_module.pack_record = real_pack
            os.environ.pop("IPC_DPSAMPLE_GRAPH_SWAP", None)

    messages.update(_malformed_records(rank, tp, group, odd))
    _fresh_comm_works(rank, tp, group)
    return messages


def _malformed_records(rank: int, tp: int, group: Any, odd: bool) -> dict[str, str]:
    """The odd rank sends a corrupt config record: every rank raises DpSampleError."""
    messages = {}
    real_pack = comm_module.pack_record
    corruptions = {
        "magic": lambda raw: b"NOTMAGIC" + raw[8:],
        "truncated": lambda raw: raw[:-7],
        "record_version": lambda raw: raw[:8] + b"\xff\xff" + raw[10:],
    }
    for name, corrupt in corruptions.items():
        if odd:
            comm_module.pack_record = lambda rec, c=corrupt: c(real_pack(rec))
        t0 = time.monotonic()
        try:
            comm = _construct(rank, tp, group, None, odd)
        except DpSampleError as exc:
            elapsed = time.monotonic() - t0
            assert elapsed < MISMATCH_DEADLINE_S, f"{name}: reported after {elapsed:.1f} s"
            assert "record" in str(exc), str(exc)
            messages[f"record:{name}"] = str(exc)
        else:
            comm.close()
            raise AssertionError(f"rank {rank}: a corrupt record ({name}) was accepted")
        finally:
            comm_module.pack_record = real_pack
    return messages


def config_mismatch_tp(rank: int, tp: int, group: Any) -> str:
    """The last rank passes tp_size=2*tp (a valid config by itself, but not this
    group's size). It may raise ValueError itself; every other rank must raise
    ConfigMismatchError within seconds rather than wait for it."""
    kw = _base_kwargs(2 * tp)  # multiples of 2*tp are multiples of tp too
    odd = rank == tp - 1
    t0 = time.monotonic()
    try:
        comm = DpSamplingComm(tp_size=2 * tp if odd else tp, rank=rank, group=group, **kw)
    except (ConfigMismatchError, ValueError) as exc:
        elapsed = time.monotonic() - t0
        if not odd:
            assert isinstance(exc, ConfigMismatchError), repr(exc)
            assert "tp_size" in exc.fields, exc.fields
        assert elapsed < MISMATCH_DEADLINE_S, f"tp_size mismatch reported after {elapsed:.1f} s"
        assert "tp_size" in str(exc), str(exc)
        message = str(exc)
    else:
        comm.close()
        raise AssertionError(f"rank {rank}: tp_size differs but construction succeeded")
    _fresh_comm_works(rank, tp, group)
    return message


# -- validation at tp > 1 ----------------------------------------------------------------
def validation_tp(rank: int, tp: int, group: Any, seed: int, cases: int) -> int:
    """Invalid calls at tp > 1 are rejected locally (ValueError/TypeError naming the
    expected value) and a valid call right after each one works. All ranks draw the same
    cases from ``seed``, so the valid calls stay collective. Returns the cases run."""
    max_pad_bs, n, vocab = 4 * tp, 2, 6 * tp
    rng = random.Random(seed)
    done = 0
    with _comm(
        rank, tp, group, max_pad_bs=max_pad_bs, num_tokens_per_req=n, vocab_size=vocab,
        logits_dtype="bfloat16",
    ) as comm:  # fmt: skip
        chk = Checker(comm, rank, tp, seed)
        # the named error paths first
        for pad_bs in range(-1, max_pad_bs + 2 * tp):
            if pad_bs > 0 and pad_bs <= max_pad_bs and pad_bs % tp == 0:
                continue
            for op in ("swap_batch_vocab", "gather_verify_outputs", "gather_verify_logprobs"):
                exc = _reject(comm, op, pad_bs, {}, ValueError)
                assert "pad_bs" in exc, exc
                if pad_bs > max_pad_bs:
                    assert f"max_pad_bs={max_pad_bs}" in exc, exc
                elif pad_bs > 0:
                    assert f"tp_size={tp}" in exc, exc
                done += 1
        chk.swap(tp)
        for _ in range(cases):
            op = rng.choice(("swap_batch_vocab", "gather_verify_outputs", "gather_verify_logprobs"))
            pad_bs = tp * rng.randint(1, max_pad_bs // tp)
            fault = rng.choice(("rows", "cols", "ndim", "dtype", "noncontig", "pad_bs_mod"))
            msg = _reject(comm, op, pad_bs, {"fault": fault, "rng": rng}, None)
            assert msg, f"{op} {fault}: empty message"
            done += 1
            valid = rng.choice((chk.swap, chk.gather_outputs, chk.gather_logprobs))
            valid(tp * rng.randint(1, max_pad_bs // tp))
    return done


def _good_args(comm: DpSamplingComm, op: str, pad_bs: int) -> list[torch.Tensor]:
    c = comm.config
    r, n, shard = pad_bs // c.tp_size, c.num_tokens_per_req, c.vocab_size // c.tp_size
    if op == "swap_batch_vocab":
        return [torch.ones(pad_bs * n, shard, dtype=TORCH_DTYPES[comm.logits_dtype or "float32"])]
    if op == "gather_verify_outputs":
        return [
            torch.ones(r, n, dtype=torch.int32),
            torch.ones(r, n, dtype=torch.int32),
            torch.ones(r, dtype=torch.int32),
        ]
    return [torch.ones(r, n, dtype=torch.float32)]


def _reject(
    comm: DpSamplingComm, op: str, pad_bs: int, mutate: dict[str, Any], exc_type: Any
) -> str:
    """Call ``op`` with a broken argument; assert a ValueError/TypeError; return its text."""
    call_pad_bs = pad_bs
    if mutate:
        args = _good_args(comm, op, pad_bs)
        rng: random.Random = mutate["rng"]
        i = rng.randrange(len(args))
        a = args[i]
        fault = mutate["fault"]
        if fault == "rows":
            args[i] = torch.ones((a.shape[0] + rng.choice((-1, 1, 3)), *a.shape[1:]), dtype=a.dtype)
        elif fault == "cols" and a.dim() == 2:
            args[i] = torch.ones(a.shape[0], a.shape[1] + rng.choice((-1, 1, 2)), dtype=a.dtype)
        elif fault == "ndim":
            args[i] = a.reshape(-1) if a.dim() == 2 else a.reshape(-1, 1)
        elif fault == "dtype":
            choices = [torch.float64, torch.int64, torch.int16, torch.uint8, torch.float16]
            args[i] = a.to(rng.choice([d for d in choices if d != a.dtype]))
        elif (
            fault == "noncontig"
            and op != "gather_verify_logprobs"  # made contiguous for the caller (TokenSpeed)
            and a.dim() == 2
            and a.shape[0] > 1
            and a.shape[1] > 1
        ):
            args[i] = torch.ones(a.shape[1], a.shape[0], dtype=a.dtype).t()
        else:
            call_pad_bs = pad_bs + 1  # not a multiple of tp (tp > 1), args sized for pad_bs
    else:
        # sized as pad_bs would imply where that is a size at all
        args = _good_args(comm, op, pad_bs if pad_bs > 0 else comm.config.tp_size)
    try:
        getattr(comm, op)(*args, pad_bs=call_pad_bs)
    except (ValueError, TypeError) as exc:
        if exc_type is not None:
            assert isinstance(exc, exc_type), repr(exc)
        return str(exc)
    raise AssertionError(f"{op}(pad_bs={call_pad_bs}) accepted a broken argument ({mutate})")


# -- harness self-tests ----------------------------------------------------------------
def harness_ok(rank: int, world: int, group: Any, token: str) -> tuple[int, int, str]:
    import torch.distributed as dist

    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    assert int(t) == world * (world + 1) // 2
    return rank, world, token


def harness_fail(rank: int, world: int, group: Any) -> int:
    if rank == world - 1:
        raise ZeroDivisionError(f"deliberate failure on rank {rank}")
    return rank


def harness_exit(rank: int, world: int, group: Any, victim: int, code: int) -> dict[str, int]:
    """Rank ``victim`` ends its process with ``os._exit(code)`` (no report, no
    clean-up); the others return ``{"rank": rank, "square": rank * rank}``."""
    if rank == victim:
        os._exit(code)
    return {"rank": rank, "square": rank * rank}


def harness_signal(rank: int, world: int, group: Any, victim: int) -> int:
    """Rank ``victim`` kills itself with SIGKILL; the others return their rank."""
    import signal

    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    return rank


def harness_mixed(rank: int, world: int, group: Any) -> str:
    """Rank 0 returns, rank 1 raises, rank 2 exits with code 5, rank 3 hangs."""
    if rank == 1:
        raise ValueError("deliberate error on rank 1")
    if rank == 2:
        os._exit(5)
    if rank == 3:
        time.sleep(3600)
    return f"ok from {rank}"


# -- overlapping subgroups ---------------------------------------------------------------
SUBGROUPS = ((0, 1), (0, 1, 2), (1, 2, 3), (0, 1), (2, 3))


def overlapping_subgroups(rank: int, world: int, group: Any, seed: int) -> list[tuple[int, ...]]:
    """Communicators on overlapping subgroups given as tuples of global ranks, created by
    their members only (each rank takes part in a different sequence of groups). Every
    op bit-exact. Returns the groups this rank took part in."""
    assert world == 4, world
    joined = []
    for i, members in enumerate(SUBGROUPS):
        if rank not in members:
            continue
        tp, me = len(members), members.index(rank)
        with DpSamplingComm(
            tp_size=tp, rank=me, group=members, max_pad_bs=2 * tp, num_tokens_per_req=2,
            vocab_size=3 * tp, logits_dtype="float16", device="cpu",
        ) as comm:  # fmt: skip
            chk = Checker(comm, me, tp, seed + i)
            chk.swap(2 * tp)
            chk.gather_outputs(tp)
            chk.gather_logprobs(2 * tp)
        joined.append(members)
    return joined


# -- the torch backend called directly: real rows (bs) and argmax ------------------------
def _backend(comm: DpSamplingComm) -> Any:
    """The communicator's backend (the tests call it with ``RealRows`` directly)."""
    backend = comm._backend
    assert backend is not None and comm.backend == "torch", comm.explain()
    return backend


def _bs_cases(tp: int, max_pad_bs: int, rng: random.Random, count: int) -> list[tuple[int, int]]:
    """``(pad_bs, bs)`` pairs: 0, 1, pad_bs, one that leaves the last ranks without
    real requests, one inside a rank's requests, then random ones."""
    cases = [(max_pad_bs, 0), (max_pad_bs, 1), (max_pad_bs, max_pad_bs), (tp, tp)]
    if max_pad_bs // tp >= 2:
        cases.append((max_pad_bs, max_pad_bs // tp + 1))  # rank 1 partial, later ranks none
    while len(cases) < count:
        pad_bs = tp * rng.randint(1, max_pad_bs // tp)
        cases.append((pad_bs, rng.randint(0, pad_bs)))
    return cases


def torch_real_rows(rank: int, tp: int, group: Any, seed: int) -> int:
    """Every op with a host ``bs`` (RealRows) on random data: the real rows equal the
    reference bit-exactly (swap rows ``[0, real_reqs*N)``, gathered rows ``[0, bs)``).
    Returns the checked cases."""
    from ipc_dpsample.arrays import describe
    from ipc_dpsample.backends.base import RealRows
    from ipc_dpsample.layout import real_reqs

    rng = random.Random(seed)
    checked = 0
    n, max_pad_bs = 2, 4 * tp
    for dtype in ("bfloat16", "float32"):
        with _comm(
            rank, tp, group, max_pad_bs=max_pad_bs, num_tokens_per_req=n, vocab_size=5 * tp,
            logits_dtype=dtype,
        ) as comm:  # fmt: skip
            be = _backend(comm)
            for step, (pad_bs, bs) in enumerate(_bs_cases(tp, max_pad_bs, rng, 12)):
                r = pad_bs // tp
                mine = real_reqs(r, bs, rank)
                rows = RealRows(bs, 0, True)
                key = (seed, step, len(dtype))
                xs = [random_logits((*key, s), (pad_bs * n, 5), dtype) for s in range(tp)]
                want = reference_swap_batch_vocab(
                    [bits(x) for x in xs], tp=tp, num_tokens_per_req=n, pad_bs=pad_bs
                )[rank][: mine * n]
                out = be.swap_batch_vocab(
                    xs[rank], describe(xs[rank]), pad_bs=pad_bs, bs=rows, stream=None
                )
                assert out.shape == (r * n, 5 * tp), out.shape
                assert_bits(f"swap(pad_bs={pad_bs}, bs={bs})", out[: mine * n], want, "torch")
                poison(out)

                ints = [
                    [random_int32((*key, s, f), shape) for s in range(tp)]
                    for f, shape in ((2, (r, n)), (3, (r, n)), (4, (r,)))
                ]
                wants = reference_gather_verify_outputs(*[[bits(a) for a in f] for f in ints])
                args = [f[rank] for f in ints]
                outs = be.gather_verify_outputs(
                    *args, describe(args[0]), pad_bs=pad_bs, bs=rows, stream=None
                )
                for name, got, w in zip(("predict", "accept", "length"), outs, wants, strict=True):
                    assert got.shape[0] == pad_bs, got.shape
                    assert_bits(f"{name}(pad_bs={pad_bs}, bs={bs})", got[:bs], w[:bs], "torch")
                    poison(got)

                lps = [random_logprobs((*key, s, 5), (r, n)) for s in range(tp)]
                w = reference_gather_verify_logprobs([bits(a) for a in lps])
                got = be.gather_verify_logprobs(
                    lps[rank], describe(lps[rank]), pad_bs=pad_bs, bs=rows, stream=None
                )
                assert_bits(f"logprobs(pad_bs={pad_bs}, bs={bs})", got[:bs], w[:bs], "torch")
                poison(got)
                checked += 1
    return checked


#: The row kinds of the argmax cases (each case mixes them over its rows).
ARGMAX_ROWS = ("random", "tie_boundary", "nan", "two_nans", "neg_inf", "pos_inf", "huge", "beyond")
_HUGE = {"bfloat16": 3.0e38, "float16": 65504.0, "float32": 3.4e38}


def argmax_rows(
    key: tuple[int, ...], rows: int, v: int, tp: int, limit: int, dtype: str
) -> np.ndarray:
    """``[rows, V]`` float32 logits (exactly representable in ``dtype``) whose rows
    cycle through :data:`ARGMAX_ROWS`, the same on every rank for one key."""
    g = _rng(*key)
    x = np.array(random_logits(key, (rows, v), dtype).float().numpy())
    vs = v // tp
    for i in range(rows):
        kind = ARGMAX_ROWS[i % len(ARGMAX_ROWS)]
        if kind == "tie_boundary" and tp > 1:  # equal maxima on both sides of a boundary
            b = vs * int(g.integers(1, tp))
            if b < limit:
                x[i, b - 1] = x[i, b] = 100.0
        elif kind == "nan":
            x[i, int(g.integers(0, limit))] = np.nan
        elif kind == "two_nans":
            x[i, g.choice(limit, size=min(2, limit), replace=False)] = np.nan
        elif kind == "neg_inf":
            x[i, :] = -np.inf
        elif kind == "pos_inf":
            x[i, int(g.integers(0, limit))] = np.inf
        elif kind == "huge":
            x[i, :] = -_HUGE[dtype]
            x[i, int(g.integers(0, limit))] = _HUGE[dtype]
        elif kind == "beyond" and limit < v:  # the largest value is past vocab_limit
            x[i, limit:] = _HUGE[dtype]
    return x


def torch_argmax(rank: int, tp: int, group: Any, seed: int) -> int:
    """argmax_batch_vocab against the NumPy reference for bf16/fp16/fp32, several
    vocab_limit, pad_bs and bs, on rows with ties across shard boundaries, NaNs,
    -inf/+inf and huge values: ids exact, logprobs within 1e-5 (NaN where the
    reference has NaN). Returns the checked cases."""
    from ipc_dpsample.arrays import describe
    from ipc_dpsample.backends.base import RealRows
    from ipc_dpsample.layout import real_reqs, reference_argmax_batch_vocab

    rng = random.Random(seed)
    n, max_pad_bs, vs = 2, 3 * tp, 6
    v = vs * tp
    checked = 0
    for dtype in LOGITS_DTYPES:
        with _comm(
            rank, tp, group, max_pad_bs=max_pad_bs, num_tokens_per_req=n, vocab_size=v,
            logits_dtype=dtype,
        ) as comm:  # fmt: skip
            be = _backend(comm)
            limits = sorted({v, v - 1, max(1, v - vs - 1), 1, rng.randint(1, v)})
            for step, limit in enumerate(limits * 2):
                pad_bs = tp * rng.randint(1, max_pad_bs // tp)
                given = step >= len(limits)
                bs = rng.randint(0, pad_bs) if given else pad_bs
                full = argmax_rows((seed, step, len(dtype)), pad_bs * n, v, tp, limit, dtype)
                shards = [
                    torch.from_numpy(np.ascontiguousarray(full[:, s * vs : (s + 1) * vs]))
                    .to(TORCH_DTYPES[dtype])
                    for s in range(tp)
                ]  # fmt: skip
                ref_in = [bits(t) if dtype == "bfloat16" else t.numpy() for t in shards]
                want_ids, want_lp = reference_argmax_batch_vocab(
                    ref_in, tp=tp, num_tokens_per_req=n, pad_bs=pad_bs, dtype=dtype,
                    vocab_limit=limit,
                )[rank]  # fmt: skip
                rows = RealRows(bs, 0, True) if given else RealRows.every(pad_bs)
                x = shards[rank]
                ids, lps = be.argmax_batch_vocab(
                    x, describe(x), pad_bs=pad_bs, vocab_limit=limit, bs=rows, stream=None
                )
                real = real_reqs(pad_bs // tp, bs, rank) * n
                what = f"argmax({dtype}, pad_bs={pad_bs}, bs={bs}, vocab_limit={limit})"
                assert ids.dtype == torch.int32 and lps.dtype == torch.float32, what
                assert ids.shape == lps.shape == (pad_bs // tp * n,), (what, ids.shape)
                got_ids, got_lp = ids.numpy()[:real], lps.numpy()[:real]
                bad = np.flatnonzero(got_ids != want_ids[:real])
                assert not len(bad), f"{what}: ids differ at rows {bad}: {got_ids} vs {want_ids}"
                w = want_lp[:real]
                assert np.array_equal(np.isnan(got_lp), np.isnan(w)), f"{what}: {got_lp} vs {w}"
                ok = ~np.isnan(w)
                err = np.abs(got_lp[ok] - w[ok])
                assert not err.size or err.max() <= 1e-5, f"{what}: logprob error {err.max()}"
                poison(ids)
                poison(lps)
                checked += 1
    return checked


def torch_divergence_bs_and_argmax(rank: int, tp: int, group: Any) -> list[str]:
    """The last rank passes another bs (host), then calls argmax while the others
    swap (and the reverse): every rank raises the divergence error; later calls
    re-raise it."""
    from ipc_dpsample.arrays import describe
    from ipc_dpsample.backends.base import RealRows

    last = rank == tp - 1
    messages = []
    x = random_logits((3, rank), (2 * tp, 4), "float32")
    for case in ("bs", "bs_none", "argmax_vs_swap", "swap_vs_argmax"):
        with _comm(
            rank, tp, group, max_pad_bs=2 * tp, num_tokens_per_req=1, vocab_size=4 * tp,
            logits_dtype="float32", timeout_s=10,
        ) as comm:  # fmt: skip
            be = _backend(comm)
            info = describe(x)
            if case == "bs":
                bs = RealRows(tp + 1 if last else tp, 0, True)
            elif case == "bs_none":
                bs = RealRows.every(2 * tp) if last else RealRows(2 * tp - 1, 0, True)
            else:
                bs = RealRows.every(2 * tp)
            # argmax_vs_swap: the last rank calls argmax, the others swap; and the reverse
            argmax = last if case == "argmax_vs_swap" else (case == "swap_vs_argmax" and not last)

            def call(
                argmax: bool = argmax, bs: RealRows = bs, be: Any = be, info: Any = info
            ) -> Any:
                if argmax:
                    return be.argmax_batch_vocab(
                        x, info, pad_bs=2 * tp, vocab_limit=4 * tp, bs=bs, stream=None
                    )
                return be.swap_batch_vocab(x, info, pad_bs=2 * tp, bs=bs, stream=None)

            msg = _expect_divergence(rank, case, call)
            assert "call sequences diverged" in msg and "every later call raises" in msg, msg
            if case.startswith("bs"):
                assert "bs=" in msg, msg
            else:
                assert "argmax_batch_vocab" in msg and "swap_batch_vocab" in msg, msg
            again = _expect_divergence(rank, case + " again", call)
            assert again == msg, (again, msg)
            messages.append(msg)
    return messages


# -- bounded waits: stalled, dead and failing peers ----------------------------------------
FAIL_TIMEOUT_S = 3.0


def _timed_error(call: Any) -> tuple[BaseException, float]:
    t0 = time.monotonic()
    try:
        call()
    except DpSampleError as exc:
        return exc, time.monotonic() - t0
    raise AssertionError("the op returned although a peer did not take part")


def _assert_sticky(comm: DpSamplingComm, first: BaseException, call: Any) -> None:
    """Every later call and check() re-raise ``first``; close() returns at once."""
    assert "every later call raises this error" in str(first), first
    for again in (call, comm.check):
        try:
            again()
        except DpSampleError as exc:
            assert exc is first, (exc, first)
        else:
            raise AssertionError("a poisoned communicator accepted a call")
    t0 = time.monotonic()
    comm.close()
    assert time.monotonic() - t0 < 2.0, "close() of a poisoned communicator waited"


def torch_stalled_peer(rank: int, tp: int, group: Any) -> dict[str, Any]:
    """The last rank sleeps past timeout_s before a swap: the others raise
    PeerTimeoutError naming it within timeout_s + 2 s (asserted < timeout_s + 5);
    the late rank raises DpSampleError at once; a fresh communicator works after."""
    from ipc_dpsample import PeerTimeoutError

    late = rank == tp - 1
    comm = _comm(
        rank, tp, group, max_pad_bs=tp, num_tokens_per_req=1, vocab_size=2 * tp,
        logits_dtype="float32", timeout_s=FAIL_TIMEOUT_S,
    )  # fmt: skip
    chk = Checker(comm, rank, tp, 11)
    chk.swap(tp)  # a healthy op first
    x = torch.ones(tp, 2)
    call = lambda: comm.swap_batch_vocab(x, pad_bs=tp)  # noqa: E731
    if late:
        time.sleep(FAIL_TIMEOUT_S + 3.0)
    exc, elapsed = _timed_error(call)
    if late:
        assert not isinstance(exc, PeerTimeoutError), exc
        assert "late" in str(exc), exc
        assert elapsed < 5.0, f"the late rank took {elapsed:.1f} s to raise"
    else:
        assert isinstance(exc, PeerTimeoutError), repr(exc)
        assert (exc.rank, exc.peer, exc.op) == (rank, tp - 1, "swap_batch_vocab"), exc
        assert f"rank {tp - 1} did not take part" in str(exc), exc
        assert FAIL_TIMEOUT_S * 0.8 < elapsed < FAIL_TIMEOUT_S + 5, f"raised after {elapsed:.1f} s"
    _assert_sticky(comm, exc, call)
    _fresh_comm_works(rank, tp, group)
    return {"type": type(exc).__name__, "elapsed": elapsed, "message": str(exc)}


def torch_dead_peer(rank: int, tp: int, group: Any, report_dir: str, victim: int) -> None:
    """Rank ``victim`` exits (``os._exit(17)``) while the others wait in a swap: they
    raise PeerTimeoutError naming it within timeout_s + 2 s, their communicator is
    poisoned and closes at once. Rank 0 also hosts the c10d store, so its death
    tests the path without a store. Survivors write what they saw to
    ``report_dir`` (the harness reports the dead rank, so results cannot travel
    back)."""
    import json
    import os

    from ipc_dpsample import PeerTimeoutError

    comm = _comm(
        rank, tp, group, max_pad_bs=tp, num_tokens_per_req=1, vocab_size=2 * tp,
        logits_dtype="float32", timeout_s=FAIL_TIMEOUT_S,
    )  # fmt: skip
    Checker(comm, rank, tp, 12).swap(tp)
    if rank == victim:
        time.sleep(0.5)  # the others are waiting in the swap by now
        os._exit(17)
    x = torch.ones(tp, 2)
    call = lambda: comm.swap_batch_vocab(x, pad_bs=tp)  # noqa: E731
    exc, elapsed = _timed_error(call)
    assert isinstance(exc, PeerTimeoutError), repr(exc)
    assert (exc.rank, exc.peer, exc.op) == (rank, victim, "swap_batch_vocab"), exc
    assert elapsed < FAIL_TIMEOUT_S + 5, f"raised after {elapsed:.1f} s"
    _assert_sticky(comm, exc, call)
    with open(os.path.join(report_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"peer": exc.peer, "elapsed": elapsed, "message": str(exc)}, f)


class _FailingGroup:
    """A process group whose collectives raise, as a broken transport would."""

    def alltoall_base(self, *args: Any) -> Any:
        raise RuntimeError("injected c10d failure")

    def abort(self) -> None:
        pass


def torch_wrapped_c10d_failure(rank: int, tp: int, group: Any) -> str:
    """Every rank's collective raises a c10d RuntimeError while every peer takes part
    in the same call: each raises DpSampleError (not PeerTimeoutError) with the
    RuntimeError chained, at once, and the communicator stays poisoned."""
    from ipc_dpsample import PeerTimeoutError

    comm = _comm(
        rank, tp, group, max_pad_bs=tp, num_tokens_per_req=1, vocab_size=tp,
        logits_dtype="float32", timeout_s=FAIL_TIMEOUT_S,
    )  # fmt: skip
    _backend(comm)._pg = _FailingGroup()
    i32 = torch.ones(1, 1, dtype=torch.int32)
    call = lambda: comm.gather_verify_outputs(i32, i32, i32[:, 0], pad_bs=tp)  # noqa: E731
    exc, elapsed = _timed_error(call)
    assert not isinstance(exc, PeerTimeoutError), repr(exc)
    assert isinstance(exc.__cause__, RuntimeError), repr(exc.__cause__)
    assert "injected c10d failure" in str(exc) and "gather_verify_outputs" in str(exc), exc
    assert elapsed < 2.0, f"raised after {elapsed:.1f} s"
    _assert_sticky(comm, exc, call)
    return str(exc)


# -- host groups pair collectives by (sequence, what) ------------------------------------
def group_steps_diverge(rank: int, tp: int, group: Any) -> list[str]:
    """The last rank's second host all-gather is another step than the others': every
    rank raises DpSampleError naming both steps, then matching steps work again.
    ``group``: a HostGroup (ThreadGroup) or None/tuple (a TorchStoreGroup is made)."""
    from ipc_dpsample.group import resolve_group

    host = group if hasattr(group, "all_gather_bytes") else resolve_group(group)
    got = host.all_gather_bytes(bytes([rank]), timeout_s=30, what="config agreement")
    assert got == [bytes([r]) for r in range(tp)], got
    what = "IPC handle exchange" if rank == tp - 1 else "nccl probe"
    try:
        host.all_gather_bytes(b"x", timeout_s=30, what=what)
    except DpSampleError as exc:
        message = str(exc)
        assert "'IPC handle exchange'" in message and "'nccl probe'" in message, message
        assert "set-up sequences diverged" in message, message
    else:
        raise AssertionError(f"rank {rank}: '{what}' paired with another step")
    host.barrier(timeout_s=30, what="after the divergence")
    return [message]


# -- issue 23 point 5: the CPU swap does not depend on torch's thread count --------------
def _os_threads() -> int | None:
    """Threads of this process (Linux), or None where /proc cannot tell."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def torch_swap_threads_bit_exact(rank: int, tp: int, group: Any, seed: int) -> int:
    """Swaps big enough that a torch copy would fan out to the intra-op pool (more
    than 32 K elements per copy), every dtype, torch/NumPy/requires-grad inputs and a
    host ``bs``, with ``torch.set_num_threads(1)`` and with 4 threads: bit-exact
    against the reference each time. Restores the thread count. Returns the checks."""
    from ipc_dpsample.layout import real_reqs

    before = torch.get_num_threads()
    checked = 0
    n, max_pad_bs, shard = 4, 4 * tp, 4096
    try:
        for threads in (1, 4, 1):
            torch.set_num_threads(threads)
            for dtype in LOGITS_DTYPES:
                with _comm(
                    rank, tp, group, max_pad_bs=max_pad_bs, num_tokens_per_req=n,
                    vocab_size=shard * tp, logits_dtype=dtype,
                ) as comm:  # fmt: skip
                    chk = Checker(comm, rank, tp, seed + threads)
                    for pad_bs in (tp, max_pad_bs):
                        chk.swap(pad_bs)
                        chk.swap(pad_bs, "numpy" if dtype != "bfloat16" else "torch")
                    key = (seed, threads, len(dtype))
                    xs = [
                        random_logits((*key, s), (max_pad_bs * n, shard), dtype) for s in range(tp)
                    ]
                    full = reference_swap_batch_vocab(
                        [bits(x) for x in xs], tp=tp, num_tokens_per_req=n, pad_bs=max_pad_bs
                    )[rank]
                    mine = xs[rank].clone().requires_grad_(True)
                    got = comm.swap_batch_vocab(mine, pad_bs=max_pad_bs)
                    assert_bits(f"swap(requires_grad, {threads} threads)", got, full, "torch")
                    bs = max_pad_bs // tp + 1  # rank 0 full, rank 1 one request, others none
                    got = comm.swap_batch_vocab(xs[rank], pad_bs=max_pad_bs, bs=bs)
                    real = real_reqs(max_pad_bs // tp, bs, rank) * n
                    assert_bits(f"swap(bs={bs})", got[:real], full[:real], "torch")
                    checked += chk.checked + 2
    finally:
        torch.set_num_threads(before)
    return checked


def torch_swap_starts_no_pool_threads(rank: int, tp: int, group: Any) -> tuple[int, int]:
    """With 4 intra-op threads allowed and the pool not started yet, swaps whose copies
    are far above torch's parallel grain size start no thread: the swap's CPU hot
    path never enters the intra-op (OpenMP) pool. Returns the process's thread count
    before and after (both -1 where /proc is missing)."""
    before_threads = torch.get_num_threads()
    torch.set_num_threads(4)
    pad_bs, n, shard = 16 * tp, 4, 4096
    try:
        # inputs built without any torch kernel (a torch op could start the pool)
        raw = _rng(rank, 23).integers(1, 2**14, (pad_bs * n, shard), dtype=np.int16)
        x = torch.from_numpy(raw).view(torch.bfloat16)
        with _comm(
            rank, tp, group, max_pad_bs=pad_bs, num_tokens_per_req=n, vocab_size=shard * tp,
            logits_dtype="bfloat16",
        ) as comm:  # fmt: skip
            before = _os_threads()
            for p in (tp, pad_bs, pad_bs // 2, pad_bs):
                comm.swap_batch_vocab(x[: p * n], pad_bs=p)
            after = _os_threads()
    finally:
        torch.set_num_threads(before_threads)
    if before is None or after is None:
        return -1, -1
    assert after == before, (
        f"rank {rank}: {after - before} thread(s) started during the swaps (the intra-op pool?)"
    )
    return before, after


# -- issue 23 point 6: a peer timeout leaves only the package's message on stderr ----------
STDERR_TAG = "PACKAGE-ERROR:"


def torch_timeout_stderr(rank: int, tp: int, group: Any) -> None:
    """The last rank sleeps past timeout_s before a swap; every rank writes the error
    it got to stderr as one line starting with :data:`STDERR_TAG` (so that whatever
    else reaches fd 2, torch's C++ logging included, shows up next to it). Then a
    host all-gather that the last rank never joins runs out (the set-up path's wait)."""
    import sys

    from ipc_dpsample.group import resolve_group

    late = rank == tp - 1
    comm = _comm(
        rank, tp, group, max_pad_bs=tp, num_tokens_per_req=1, vocab_size=2 * tp,
        logits_dtype="float32", timeout_s=FAIL_TIMEOUT_S,
    )  # fmt: skip
    Checker(comm, rank, tp, 13).swap(tp)
    if late:
        time.sleep(FAIL_TIMEOUT_S + 3.0)
    exc, _ = _timed_error(lambda: comm.swap_batch_vocab(torch.ones(tp, 2), pad_bs=tp))
    line = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    sys.stderr.write(f"{STDERR_TAG} rank {rank}: {line}\n")
    comm.close()
    host = resolve_group(group)
    if not late:
        try:
            host.all_gather_bytes(b"x", timeout_s=1.0, what="a step the last rank skips")
        except DpSampleError as err:
            sys.stderr.write(f"{STDERR_TAG} rank {rank}: {err}\n".replace("\n", " ") + "\n")
        else:
            raise AssertionError("the all-gather completed without the last rank")
    # a fresh group (its own step sequence): the last rank skipped a step of the other
    resolve_group(group).barrier(timeout_s=60.0, what="end of torch_timeout_stderr")
    sys.stderr.flush()

"""``verify_batch_vocab`` in ``ipc-dpsample demo`` and the doctor's self-tests (issue 24):
its row is checked against the NumPy reference like the others (a serving mix, drafts
accepted and rejected); a backend without the op (onesided, nccl in this version) gets
the row "not available on <backend> in this version" and the demo still succeeds. The
data of the op (:mod:`ipc_dpsample.tools.verify_case`) is checked here too.

The in-process tests run the demo's rank body on thread ranks with :class:`FakeComm`,
a stand-in for ``DpSamplingComm`` whose collectives move the data through the
``ThreadGroup`` and compute the NumPy references (``tests/test_bench_verify.py`` uses
it for the bench)."""

from __future__ import annotations

import importlib
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from test_cli import CPU_BOX, _fake_demo_results, _run_cli

from ipc_dpsample.backends.base import verify_unavailable
from ipc_dpsample.layout import (
    reference_argmax_batch_vocab,
    reference_swap_batch_vocab,
    reference_verify_batch_vocab,
)
from ipc_dpsample.testing import run_threads
from ipc_dpsample.tools import cli, common, demo, demo_rank, doctor, verify_case

collect = importlib.import_module("ipc_dpsample.tools.doctor.collect")  # the package's
# attribute ``collect`` is the function of that name

_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# -- a stand-in communicator for thread ranks ------------------------------------------------
class FakeComm:
    """``DpSamplingComm``'s ops on thread ranks of a ``ThreadGroup`` (CPU tensors): every
    op gathers every rank's input through the group and returns the NumPy reference's
    output for this rank. ``verify_batch_vocab`` follows :attr:`verify`:
    ``"unavailable"`` raises the ``BackendUnavailableError`` the onesided and nccl
    backends raise in this version, ``"right"`` returns the reference, ``"wrong"`` the
    reference with one token changed. :attr:`verify_calls` counts the calls."""

    verify = "unavailable"
    name = "nccl"
    verify_calls = 0

    def __init__(self, *, tp_size: int, rank: int, group: Any, **kw: Any) -> None:
        self.tp, self.group = tp_size, group
        self.n, self.vocab = kw["num_tokens_per_req"], kw["vocab_size"]
        self.config = types.SimpleNamespace(rank=rank, tp_size=tp_size)

    @property
    def backend(self) -> str:
        return self.name

    @property
    def device(self) -> str:
        return "cpu"

    def explain(self) -> str:
        return f"{self.name}: a test fake"

    def close(self) -> None:
        return None

    def _all(self, t: torch.Tensor) -> list[np.ndarray]:
        a = common.to_numpy(t)
        raw = self.group.all_gather_bytes(a.tobytes(), timeout_s=30, what="fake comm")
        return [np.frombuffer(b, a.dtype).reshape(a.shape) for b in raw]

    def swap_batch_vocab(self, x: torch.Tensor, *, pad_bs: int, **kw: Any) -> torch.Tensor:
        out = reference_swap_batch_vocab(
            self._all(x), tp=self.tp, num_tokens_per_req=self.n, pad_bs=pad_bs
        )
        return common.to_torch(out[self.config.rank], _NAMES[x.dtype], "cpu")

    def gather_verify_outputs(self, *parts: torch.Tensor, pad_bs: int, **kw: Any) -> Any:
        return tuple(torch.from_numpy(np.concatenate(self._all(p))) for p in parts)

    def gather_verify_logprobs(self, lp: torch.Tensor, *, pad_bs: int, **kw: Any) -> Any:
        return torch.from_numpy(np.concatenate(self._all(lp)))

    def argmax_batch_vocab(
        self, x: torch.Tensor, *, pad_bs: int, vocab_limit: int | None = None, **kw: Any
    ) -> Any:
        ids, lps = reference_argmax_batch_vocab(
            self._all(x), tp=self.tp, num_tokens_per_req=self.n, pad_bs=pad_bs,
            dtype=_NAMES[x.dtype], vocab_limit=vocab_limit,
        )[self.config.rank]  # fmt: skip
        return torch.from_numpy(ids), torch.from_numpy(lps)

    def verify_batch_vocab(
        self, x: torch.Tensor, candidates: torch.Tensor, *, pad_bs: int, bs: Any = None,
        vocab_limit: int | None = None, return_logprobs: bool = False, stream: Any = None,
        **params: Any,
    ) -> Any:  # fmt: skip
        type(self).verify_calls += 1
        if self.verify == "unavailable":
            raise verify_unavailable("the NCCL kernels of this op are not written yet")
        host = {k: None if v is None else v.numpy() for k, v in params.items()}
        outs = reference_verify_batch_vocab(
            self._all(x), candidates.numpy(), tp=self.tp, pad_bs=pad_bs,
            dtype=_NAMES[x.dtype], vocab_limit=vocab_limit, **host,
        )  # fmt: skip
        if self.verify == "wrong":
            outs[0][0, 0] += 1
        return tuple(torch.from_numpy(o) for o in outs)


@pytest.fixture
def fake_comm(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FakeComm]]:
    """:class:`FakeComm` in place of ``DpSamplingComm`` (the tools import it when they
    build a communicator); torch's thread count restored afterwards (CPU rank threads
    set it)."""
    import ipc_dpsample.comm

    threads = torch.get_num_threads()
    cls = type("Fake", (FakeComm,), {"verify_calls": 0})
    monkeypatch.setattr(ipc_dpsample.comm, "DpSamplingComm", cls)
    yield cls
    torch.set_num_threads(threads)


def _thread_plan() -> common.DemoPlan:
    return common.DemoPlan(
        world=2, launch="threads", device="cpu", pad_bs=4, num_tokens=3, vocab=2 * 101,
        iters=2, rounds=2, note="in-process test",
    )  # fmt: skip


def _run_demo_in_process(monkeypatch: pytest.MonkeyPatch, plan: common.DemoPlan) -> list[Any]:
    results = run_threads(plan.world, demo.demo_rank, plan, timeout_s=120)
    monkeypatch.setattr(demo, "run_demo", lambda p, **kw: results)
    return results


# -- the demo ---------------------------------------------------------------------------------
def test_demo_prints_not_available_and_succeeds(
    fake_comm: type[FakeComm], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    built: list[Any] = []
    monkeypatch.setattr(demo_rank, "verify_case", lambda *a: built.append(a))
    plan = _thread_plan()
    results = _run_demo_in_process(monkeypatch, plan)
    assert built == []  # no reference computed for an op that cannot run
    assert fake_comm.verify_calls == plan.world  # one probe per rank, nothing timed
    record = results[0]["ops"][common.VERIFY]
    assert record["unavailable"] == "not available on nccl in this version"
    assert record["checks"] == 0 and record["times_s"] == [] and record["mismatches"] == []
    table = demo.format_report(plan, results)
    (row,) = [line for line in table.splitlines() if line.startswith(common.VERIFY + " ")]
    assert row.endswith("not available on nccl in this version"), row
    assert "argmax_batch_vocab" in table and "yes (" in table  # the other rows ran
    assert demo.mismatches(results) == []

    ns = cli.build_parser().parse_args(["demo", "--cpu", "--world-size", "2", "--iters", "2"])
    assert demo.run(ns) == 0
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    assert last.startswith("OK: every output matches the NumPy reference"), last
    assert "verify_batch_vocab not available on nccl in this version" in last


def test_demo_checks_verify_against_the_reference(
    fake_comm: type[FakeComm], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_comm.verify = "right"
    plan = _thread_plan()
    results = _run_demo_in_process(monkeypatch, plan)
    record = results[1]["ops"][common.VERIFY]
    # predict, accept_index, accept_length x (2 rounds + the bs round + the final one)
    assert record["unavailable"] == "" and record["mismatches"] == []
    assert (record["checks"], record["bs_checks"], len(record["times_s"])) == (12, 3, 2)
    row = next(ln for ln in demo.format_report(plan, results).splitlines() if "verify_" in ln)
    assert "yes (24 outputs, 6 with bs=" in row, row

    fake_comm.verify = "wrong"
    results = _run_demo_in_process(monkeypatch, plan)
    bad = [m for m in demo.mismatches(results) if common.VERIFY in m]
    assert bad and all("predict" in m for m in bad), bad
    assert "NO (" in demo.format_report(plan, results)


def test_demo_row_and_footnote_state_the_mix_and_the_record_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plan = demo.plan_demo(CPU_BOX, world_size=2)
    table = demo.format_report(plan, _fake_demo_results(plan, None))
    row = next(ln for ln in table.splitlines() if ln.startswith(common.VERIFY + " "))
    assert "[64, 16000] + [16, 4]" in row and "3 x [16, 4]" in row
    note = table.splitlines()[-1]
    assert note.startswith("note: verify_batch_vocab's mix: half greedy, half temperature 0.8")
    # 520 B records (top-k 50) for 16 x 4 rows from one peer; the swap moves 4.10 MB
    assert "a 520 B record per row per shard, 33.28 kB received per rank" in note, note
    assert "(swap_batch_vocab: 4.10 MB)" in note
    # the one-sided kernels: 1072 B records (device parameters: 128 list entries); this
    # batch (16 x 4 = 64 rows) is small enough that each is broadcast: 16 x 4 rows from
    # the one peer ...
    onesided = demo.verify_note(plan, "onesided")
    assert "a 1072 B record per row per shard, 68.61 kB received per rank" in onesided, onesided
    # ... and without the broadcast, each is sent to the row's owner only: 8 x 4 rows
    monkeypatch.setenv("IPC_DPSAMPLE_VERIFY_BROADCAST", "off")
    onesided = demo.verify_note(plan, "onesided")
    assert "a 1072 B record per row per shard, 34.30 kB received per rank" in onesided, onesided


def test_demo_cpu_end_to_end_checks_verify() -> None:
    """The CI command: the verify row is checked (every round and with bs < pad_bs)."""
    proc = _run_cli("demo", "--cpu", "--world-size", "2", "--iters", "2", timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    plan = demo.plan_demo(CPU_BOX, world_size=2)
    row = next(ln for ln in proc.stdout.splitlines() if ln.startswith(common.VERIFY + " "))
    # 3 outputs x (3 rounds + the bs round + the final one) x 2 ranks
    assert row.endswith(f"yes (30 outputs, 6 with bs={plan.bs})"), row
    assert (
        proc.stdout.strip()
        .splitlines()[-1]
        .startswith("OK: every output matches the NumPy reference")
    )


# -- the doctor --------------------------------------------------------------------------------
def test_selftest_passes_without_verify_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    test = doctor.plan_selftests(CPU_BOX)[0]
    results = _fake_demo_results(test.plan, None)
    missing = "not available on onesided in this version"
    for res in results:
        res["ops"][common.VERIFY].update(checks=0, bs_checks=0, times_s=[], unavailable=missing)
    monkeypatch.setattr(collect, "run_demo", lambda plan, **kw: results)
    entry = doctor.run_selftest(test)
    assert entry["status"] == "passed", entry
    assert "verify_batch_vocab not available on onesided in this version" in entry["detail"]
    item = doctor.SCHEMA["properties"]["selftests"]["items"]
    assert doctor.validate(entry, item) == []

    for res in results:
        res["ops"][common.VERIFY].update(checks=4, unavailable="")
    entry = doctor.run_selftest(test)
    assert entry["status"] == "passed" and "8 of them verify_batch_vocab's" in entry["detail"]
    results[1]["ops"][common.VERIFY]["mismatches"] = ["predict: 1 of 12 elements differ"]
    entry = doctor.run_selftest(test)
    assert entry["status"] == "failed" and "verify_batch_vocab: predict" in entry["detail"]


def test_cpu_selftest_runs_verify_on_the_torch_backend() -> None:
    entry = doctor.run_selftest(doctor.plan_selftests(CPU_BOX)[0], timeout_s=120)
    assert entry["status"] == "passed", entry["detail"]
    # 3 outputs x (2 rounds + the bs round + the final one) x 2 ranks
    assert "24 of them verify_batch_vocab's" in entry["detail"], entry["detail"]


# -- the data ---------------------------------------------------------------------------------
@pytest.mark.parametrize("mix", verify_case.VERIFY_MIXES)
def test_case_is_the_reference_and_accepts_and_rejects(mix: str) -> None:
    rng = np.random.default_rng(5)
    tp, pad_bs, n, vs = 2, 8, 4, 150
    inputs = [(rng.standard_normal((pad_bs * n, vs)) * 4).astype(np.float32) for _ in range(tp)]
    case = verify_case.make_verify_case(
        inputs, tp=tp, pad_bs=pad_bs, dtype="float32", mix=mix, rng=np.random.default_rng(1)
    )
    want = reference_verify_batch_vocab(
        inputs, case.candidates, tp=tp, pad_bs=pad_bs, dtype="float32", **case.params
    )
    assert case.mismatches(want) == []
    assert sorted(set(case.accept_length.tolist())) == [1, 2, 3, 4]  # every accept length
    assert case.mismatches(want, bs=3) == []
    wrong = (want[0].copy(), want[1], want[2])
    wrong[0][2, 1] += 1
    assert case.mismatches(wrong, bs=2) == [] and case.mismatches(wrong, bs=3)[0].startswith(
        "predict: 1 of 12 elements differ"
    )
    assert np.count_nonzero(inputs[0]) == inputs[0].size
    if mix != "greedy":  # sampled requests: the noise decides, not the argmax alone
        greedy = reference_verify_batch_vocab(
            inputs, case.candidates, tp=tp, pad_bs=pad_bs, dtype="float32",
            **{**case.params, "temperature": np.zeros(pad_bs, np.float32)},
        )  # fmt: skip
        assert not np.array_equal(greedy[0], want[0])


def test_mix_params_and_record_bytes_follow_the_contract() -> None:
    rng = np.random.default_rng(0)
    mixed = verify_case.mix_params("mixed", 8, rng)
    assert mixed["temperature"].tolist() == [0.0, 0.800000011920929] * 4
    assert mixed["top_k"].tolist() == [1, 50] * 4 and mixed["min_p"] is None
    assert verify_case.mix_params("greedy", 4, rng)["temperature"].tolist() == [0.0] * 4
    temps = verify_case.mix_params("temperature", 64, rng)["temperature"]
    assert set(temps.tolist()) <= {float(np.float32(t)) for t in (0.6, 0.7, 0.8, 1.0)}
    # docs/verify_contract.md, "Bytes and rounds"
    want = {"greedy": 128, "temperature": 128, "topk50": 520, "topk50-topp0.9": 520,
            "minp": 296, "topp0.9": 1312, "mixed": 520}  # fmt: skip
    got = {m: verify_case.record_bytes(m, 8, 4, 1000) for m in verify_case.VERIFY_MIXES}
    assert got == want
    assert verify_case.record_bytes("mixed", 8, 4, 1000, bs=1) == 128  # only a greedy request
    # top-k 50 is off below vocab_limit 51: top-p alone needs the 128-entry list
    assert verify_case.record_bytes("topk50-topp0.9", 8, 4, 1000, vocab_limit=40) == 1312
    with pytest.raises(ValueError, match="mix='topk'; expected one of greedy,"):
        verify_case.mix_params("topk", 8, rng)

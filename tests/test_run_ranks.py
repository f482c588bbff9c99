"""``run_ranks`` reports every rank's outcome when any rank fails (issue 23, point 6):
the surviving ranks' results stay available on :attr:`RankFailure.outcomes`, and a
rank that ends without a report (``os._exit``, a signal) is named with its exit
code or signal instead of hiding what the others returned or raised."""

from __future__ import annotations

import time

import _bodies
import pytest

from ipc_dpsample.launch import launched_world
from ipc_dpsample.testing import RankFailure, RankOutcome, run_ranks, run_threads

pytestmark = pytest.mark.skipif(
    launched_world() is not None,
    reason="harness self-tests spawn their own ranks (and kill some): plain pytest only",
)


def _failure(*args: object, **kw: object) -> RankFailure:
    with pytest.raises(RankFailure) as info:
        run_ranks(*args, **kw)  # type: ignore[arg-type]
    return info.value


def test_a_rank_that_exits_leaves_the_others_results_on_the_failure() -> None:
    t0 = time.monotonic()
    exc = _failure(3, _bodies.harness_exit, 1, 3, timeout_s=60)
    assert time.monotonic() - t0 < 45, "the exited rank was noticed only at the timeout"
    assert [o.rank for o in exc.outcomes] == [0, 1, 2]
    assert [o.kind for o in exc.outcomes] == ["returned", "exited", "returned"]
    assert exc.outcomes[1].exitcode == 3
    assert exc.results == {0: {"rank": 0, "square": 0}, 2: {"rank": 2, "square": 4}}
    assert exc.failed_ranks == [1]
    lines = str(exc).splitlines()
    assert lines[0] == "ranks [1] of 3 failed", lines
    assert lines[1:4] == [
        "  rank 0: returned {'rank': 0, 'square': 0}",
        "  rank 1: FAILED: exited with code 3 and no report",
        "  rank 2: returned {'rank': 2, 'square': 4}",
    ], lines
    assert "--- rank 1 failed ---\nrank 1 exited with code 3 and no report" in str(exc)
    assert str(exc).count("failed ---") == 1 and "did not finish" not in str(exc)


def test_a_rank_that_exits_with_code_0_and_no_report_is_not_waited_for() -> None:
    t0 = time.monotonic()
    exc = _failure(2, _bodies.harness_exit, 0, 0, timeout_s=60)
    assert time.monotonic() - t0 < 45, "a silent exit with code 0 was waited out"
    assert [o.kind for o in exc.outcomes] == ["exited", "returned"]
    assert exc.outcomes[0].exitcode == 0 and exc.results == {1: {"rank": 1, "square": 1}}
    assert "rank 0: FAILED: exited with code 0 and no report" in str(exc)


def test_a_rank_killed_by_a_signal_is_named_with_it() -> None:
    exc = _failure(2, _bodies.harness_signal, 1, timeout_s=60)
    assert exc.outcomes[1].kind == "exited" and exc.outcomes[1].exitcode == -9
    assert "rank 1: FAILED: was killed by SIGKILL (9) and left no report" in str(exc)
    assert exc.results == {0: 0}


def test_a_rank_that_raises_leaves_the_others_results_and_its_traceback() -> None:
    exc = _failure(3, _bodies.harness_fail)  # the last rank raises ZeroDivisionError
    assert [o.kind for o in exc.outcomes] == ["returned", "returned", "raised"]
    assert exc.results == {0: 0, 1: 1}
    tb = exc.outcomes[2].traceback or ""
    assert "harness_fail" in tb and "ZeroDivisionError: deliberate failure on rank 2" in tb
    text = str(exc)
    assert text.splitlines()[0] == "ranks [2] of 3 failed"
    assert "  rank 2: FAILED: raised ZeroDivisionError: deliberate failure on rank 2" in text
    assert "--- rank 2 failed ---\nTraceback (most recent call last):" in text
    assert "rank 0 failed" not in text and "rank 1 failed" not in text


def test_every_kind_of_outcome_in_rank_order() -> None:
    # the hung rank costs the whole timeout: 3x the 5 s that four spawned ranks take to
    # start and report on a 2-core machine; it is killed once the timeout ran out
    t0 = time.monotonic()
    exc = _failure(4, _bodies.harness_mixed, timeout_s=15)
    assert time.monotonic() - t0 < 15 + 20, "the hung rank was not killed at the timeout"
    assert [o.kind for o in exc.outcomes] == ["returned", "raised", "exited", "timeout"]
    assert exc.results == {0: "ok from 0"} and exc.failed_ranks == [1, 2, 3]
    text = str(exc)
    lines = text.splitlines()
    assert lines[0] == "ranks [1, 2, 3] of 4 failed"
    assert lines[1:5] == [
        "  rank 0: returned 'ok from 0'",
        "  rank 1: FAILED: raised ValueError: deliberate error on rank 1",
        "  rank 2: FAILED: exited with code 5 and no report",
        "  rank 3: FAILED: did not finish within 15 s (killed)",
    ], lines
    # the failing ranks' details follow, then the ranks that hung (tools read the tail)
    assert text.index("--- rank 1 failed ---") < text.index("--- rank 2 failed ---")
    assert lines[-1] == "--- ranks [3] did not finish within 15 s (killed) ---"


def test_run_threads_reports_every_rank_too() -> None:
    def body(rank: int, world: int, group: object) -> int:
        if rank == 1:
            raise KeyError("thread rank 1")
        return rank * 10

    with pytest.raises(RankFailure) as info:
        run_threads(3, body)
    exc = info.value
    assert [o.kind for o in exc.outcomes] == ["returned", "raised", "returned"]
    assert exc.results == {0: 0, 2: 20}
    assert "  rank 1: FAILED: raised KeyError: 'thread rank 1'" in str(exc)


def test_long_results_are_cut_in_the_message_but_whole_on_the_outcome() -> None:
    big = list(range(1000))
    outcome = RankOutcome(0, "returned", result=big)
    assert len(outcome.describe()) < 250 and outcome.describe().endswith("...")
    failure = RankFailure.from_outcomes([outcome, RankOutcome(1, "exited", exitcode=1)])
    assert failure.results == {0: big}


def test_spawned_ranks_ignore_the_parents_torchrun_agent_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # inherited from a torchrun parent, this made init_process_group wait for an agent
    # store that nobody serves in the spawned world, until the timeout
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "parent-run")
    t0 = time.monotonic()
    results = run_ranks(2, _bodies.harness_exit, -1, 2, timeout_s=60)
    assert [r["rank"] for r in results] == [0, 1]
    assert time.monotonic() - t0 < 45

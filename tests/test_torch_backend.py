"""The torch backend over gloo with several ranks: bit-exact against the NumPy reference,
config and runtime mismatches raise on every rank.

Each test spawns its ranks once (plain pytest) and batches many cases into that run;
the same file runs unchanged on the launched ranks under
``torchrun --nproc-per-node K -m pytest`` and ``mpirun -np K python -m pytest``
(tests needing more ranks than were launched skip).
"""

from __future__ import annotations

import json
from pathlib import Path

import _bodies
import pytest

from ipc_dpsample.launch import launched_world
from ipc_dpsample.testing import RankFailure, run_ranks

pytestmark = pytest.mark.multirank

SEED = 20261202


def _ranks_ran(results: list, world: int) -> list:
    """Results of the ranks this process saw: all of them when spawned, this rank's
    own (or none, if it sat out) when launched."""
    assert len(results) in (0, 1, world), results
    return results


@pytest.mark.parametrize("world", [2, 3, 4])
def test_random_data_all_dtypes_n_pad_bs_and_50_alternating_ops(world: int) -> None:
    results = _ranks_ran(run_ranks(world, _bodies.torch_matrix, SEED + world), world)
    for counts in results:
        # 3 dtypes x 2 N x 3 pad_bs x 3 ops; 50 alternating; 6 rounds x 6 ops on two comms
        assert counts == {"matrix": 54, "alternating": 50, "two_comms": 36}, counts


def test_runtime_pad_bs_mismatch_raises_on_every_rank() -> None:
    results = _ranks_ran(run_ranks(2, _bodies.runtime_mismatch_pad_bs), 2)
    for messages in results:
        assert len(messages) == 3


@pytest.mark.parametrize(("world", "odd_rank"), [(2, 1), (3, 1)])
def test_config_mismatch_of_each_field_raises_on_every_rank(world: int, odd_rank: int) -> None:
    results = _ranks_ran(run_ranks(world, _bodies.config_mismatch_fields, odd_rank), world)
    for messages in results:
        assert {"max_pad_bs", "num_tokens_per_req", "version", "record:magic"} <= set(messages)


def test_config_mismatch_of_tp_size_raises_on_every_rank() -> None:
    results = _ranks_ran(run_ranks(2, _bodies.config_mismatch_tp, timeout_s=90), 2)
    for message in results:
        assert "tp_size" in message


def test_communicators_on_overlapping_subgroups() -> None:
    results = _ranks_ran(run_ranks(4, _bodies.overlapping_subgroups, SEED, timeout_s=60), 4)
    for rank, joined in enumerate(results if len(results) == 4 else []):
        assert joined == [tuple(g) for g in _bodies.SUBGROUPS if rank in g]


# last: a process group backend that aborts on mismatched collectives would take the
# launched ranks down with it
def test_runtime_op_mismatch_raises_on_every_rank() -> None:
    results = _ranks_ran(run_ranks(2, _bodies.runtime_mismatch_op), 2)
    for messages in results:
        assert len(messages) == 6


# -- issue 13 / 14: real rows and argmax, the backend called with RealRows ----------------
@pytest.mark.parametrize("world", [1, 2, 3])
def test_real_rows_of_every_op_match_the_reference(world: int) -> None:
    results = _ranks_ran(run_ranks(world, _bodies.torch_real_rows, SEED + 13), world)
    for checked in results:
        assert checked == 24, checked  # 2 dtypes x 12 (pad_bs, bs) cases


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_argmax_batch_vocab_matches_the_reference(world: int) -> None:
    results = _ranks_ran(run_ranks(world, _bodies.torch_argmax, SEED + 14), world)
    for checked in results:
        assert checked >= 3 * 2 * 3, checked  # 3 dtypes x >= 3 vocab limits x 2 (bs)


def test_different_bs_or_op_raises_on_every_rank() -> None:
    results = _ranks_ran(run_ranks(2, _bodies.torch_divergence_bs_and_argmax), 2)
    for messages in results:
        assert len(messages) == 4, messages


# -- issue 15: bounded waits ---------------------------------------------------------------
def test_stalled_peer_raises_peer_timeout_naming_it() -> None:
    results = _ranks_ran(run_ranks(2, _bodies.torch_stalled_peer, timeout_s=90), 2)
    if len(results) == 2:
        assert [r["type"] for r in results] == ["PeerTimeoutError", "DpSampleError"], results


def test_wrapped_c10d_failure_is_a_dp_sample_error_with_cause() -> None:
    results = _ranks_ran(run_ranks(2, _bodies.torch_wrapped_c10d_failure, timeout_s=60), 2)
    for message in results:
        assert "every peer took part" in message, message


@pytest.mark.skipif(
    launched_world() is not None,
    reason="kills a rank: runs only when pytest spawns the ranks (a launched world would die)",
)
# the last rank of three, and rank 0 (the rendezvous store's host) of two
@pytest.mark.parametrize(("world", "victim"), [(3, 2), (2, 0)])
def test_dead_peer_raises_peer_timeout_naming_it(world: int, victim: int, tmp_path: Path) -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(world, _bodies.torch_dead_peer, str(tmp_path), victim, timeout_s=90)
    text = str(info.value)
    # only the killed rank failed; the survivors' bodies asserted their error and returned
    assert f"rank {victim} exited with code 17" in text, text
    assert text.count("failed ---") == 1 and "did not finish" not in text, text
    for rank in set(range(world)) - {victim}:
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["peer"] == victim, seen
        assert seen["elapsed"] < _bodies.FAIL_TIMEOUT_S + 2, seen


# -- issue 23 point 6: stderr after a peer timeout ------------------------------------------
@pytest.mark.skipif(
    launched_world() is not None,
    reason="reads a spawned world's stderr: runs only when pytest spawns the ranks",
)
def test_peer_timeout_leaves_only_the_package_message_on_stderr() -> None:
    """torch's C++ logging writes to fd 2 (not sys.stderr), so the ranks run in a
    subprocess whose stderr is read whole: a stalled peer and a host all-gather that
    runs out give the package's errors and nothing else (no c10d ``socket.cpp ...
    waitForInput`` warnings from a store wait that timed out)."""
    import subprocess
    import sys

    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); import _bodies; "
        "from ipc_dpsample.testing import run_ranks; "
        "run_ranks(2, _bodies.torch_timeout_stderr, timeout_s=90)"
    )
    tests_dir = str(Path(__file__).resolve().parent)
    proc = subprocess.run(
        [sys.executable, "-c", script, tests_dir], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    others = [ln for ln in lines if not ln.startswith(_bodies.STDERR_TAG)]
    assert not others, "stderr holds more than the package's messages:\n" + proc.stderr
    ours = "\n".join(lines)
    assert "rank 0: PeerTimeoutError: rank 0: rank 1 did not take part" in ours, ours
    assert "rank 1: DpSampleError: rank 1 reached" in ours, ours
    assert "did not join 'a step the last rank skips' within 1.0 s" in ours, ours

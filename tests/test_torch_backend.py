"""The torch backend over gloo with several ranks: bit-exact against the NumPy reference,
config and runtime mismatches raise on every rank.

The bodies of one world size run one after another on one spawned world, shared by the
tests of that size (:mod:`_shared_world`; each spawned rank's start costs about 2 s of
a CI core), and batch many cases each; the same file runs unchanged on the launched
ranks under ``torchrun --nproc-per-node K -m pytest`` and ``mpirun -np K python -m
pytest`` (tests needing more ranks than were launched skip). The tests that kill a rank
or read a world's stderr spawn worlds of their own.
"""

from __future__ import annotations

import json
from pathlib import Path

import _bodies
import pytest
from _shared_world import SharedWorlds

from ipc_dpsample.launch import launched_world
from ipc_dpsample.testing import RankFailure, run_ranks

pytestmark = pytest.mark.multirank

SEED = 20261202

#: Every shared world's bodies, in the order they run.
WORLDS = SharedWorlds(
    {
        1: [
            ("real_rows", _bodies.torch_real_rows, (SEED + 13,)),
            ("argmax", _bodies.torch_argmax, (SEED + 14,)),
        ],
        2: [
            ("matrix", _bodies.torch_matrix, (SEED + 2,)),
            ("runtime_pad_bs", _bodies.runtime_mismatch_pad_bs, ()),
            ("config_fields", _bodies.config_mismatch_fields, (1,)),
            ("config_tp", _bodies.config_mismatch_tp, ()),
            ("real_rows", _bodies.torch_real_rows, (SEED + 13,)),
            ("argmax", _bodies.torch_argmax, (SEED + 14,)),
            ("divergence", _bodies.torch_divergence_bs_and_argmax, ()),
            ("stalled", _bodies.torch_stalled_peer, ()),
            ("c10d_failure", _bodies.torch_wrapped_c10d_failure, ()),
            # last: a process group backend that aborts on mismatched collectives would
            # take the ranks down with it
            ("runtime_op", _bodies.runtime_mismatch_op, ()),
        ],
        3: [
            ("matrix", _bodies.torch_matrix, (SEED + 3,)),
            ("config_fields", _bodies.config_mismatch_fields, (1,)),
            ("real_rows", _bodies.torch_real_rows, (SEED + 13,)),
            ("argmax", _bodies.torch_argmax, (SEED + 14,)),
        ],
        4: [
            ("matrix", _bodies.torch_matrix, (SEED + 4,)),
            ("subgroups", _bodies.overlapping_subgroups, (SEED,)),
            ("argmax", _bodies.torch_argmax, (SEED + 14,)),
        ],
    }
)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_random_data_all_dtypes_n_pad_bs_and_50_alternating_ops(world: int) -> None:
    for counts in WORLDS.results(world, "matrix"):
        # 3 dtypes x 2 N x 3 pad_bs x 3 ops; 50 alternating; 6 rounds x 6 ops on two comms
        assert counts == {"matrix": 54, "alternating": 50, "two_comms": 36}, counts


def test_runtime_pad_bs_mismatch_raises_on_every_rank() -> None:
    for messages in WORLDS.results(2, "runtime_pad_bs"):
        assert len(messages) == 3


@pytest.mark.parametrize("world", [2, 3])  # rank 1 differs
def test_config_mismatch_of_each_field_raises_on_every_rank(world: int) -> None:
    for messages in WORLDS.results(world, "config_fields"):
        assert {"max_pad_bs", "num_tokens_per_req", "version", "record:magic"} <= set(messages)


def test_config_mismatch_of_tp_size_raises_on_every_rank() -> None:
    for message in WORLDS.results(2, "config_tp"):
        assert "tp_size" in message


def test_communicators_on_overlapping_subgroups() -> None:
    results = WORLDS.results(4, "subgroups")
    for rank, joined in enumerate(results if len(results) == 4 else []):
        assert joined == [tuple(g) for g in _bodies.SUBGROUPS if rank in g]


def test_runtime_op_mismatch_raises_on_every_rank() -> None:
    for messages in WORLDS.results(2, "runtime_op"):
        assert len(messages) == 6


# -- issue 13 / 14: real rows and argmax, the backend called with RealRows ----------------
@pytest.mark.parametrize("world", [1, 2, 3])
def test_real_rows_of_every_op_match_the_reference(world: int) -> None:
    for checked in WORLDS.results(world, "real_rows"):
        assert checked == 24, checked  # 2 dtypes x 12 (pad_bs, bs) cases


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_argmax_batch_vocab_matches_the_reference(world: int) -> None:
    for checked in WORLDS.results(world, "argmax"):
        assert checked >= 3 * 2 * 3, checked  # 3 dtypes x >= 3 vocab limits x 2 (bs)


def test_different_bs_or_op_raises_on_every_rank() -> None:
    for messages in WORLDS.results(2, "divergence"):
        assert len(messages) == 4, messages


# -- issue 15: bounded waits ---------------------------------------------------------------
def test_stalled_peer_raises_peer_timeout_naming_it() -> None:
    results = WORLDS.results(2, "stalled")
    if len(results) == 2:
        assert [r["type"] for r in results] == ["PeerTimeoutError", "DpSampleError"], results


def test_wrapped_c10d_failure_is_a_dp_sample_error_with_cause() -> None:
    for message in WORLDS.results(2, "c10d_failure"):
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

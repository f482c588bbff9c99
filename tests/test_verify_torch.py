"""``verify_batch_vocab`` on the torch backend over gloo with several ranks: every
rank's results equal :func:`ipc_dpsample.layout.reference_verify_batch_vocab` bit for
bit (predict, accept_index, accept_length; logprobs within 1 float32 ulp) for tp in
{1, 2, 3, 4} and one tp = 8 world, every dtype and filter, mixed rows, special rows,
``bs < pad_bs``, ``vocab_limit < V``, the probe and full-row rounds, N = 1; the same
tokens whatever tp; ranks that pass different arguments raise on every rank.

The bodies of one world size run one after another on one spawned world, shared by the
tests of that size (:mod:`_shared_world`), and batch their cases; the same file runs
unchanged on the launched ranks under ``torchrun --nproc-per-node 2 -m pytest`` and
``mpirun -np 2 python -m pytest`` (tests needing more ranks skip).
"""

from __future__ import annotations

import _verify_bodies as bodies
import pytest
from _shared_world import SharedWorlds

from ipc_dpsample.testing import run_ranks

pytestmark = pytest.mark.multirank

SEED = 20261224

#: Every shared world's bodies, in the order they run.
WORLDS = SharedWorlds(
    {
        world: [("matrix", bodies.verify_matrix, (SEED + world,))]
        + (
            [
                ("mismatch", bodies.verify_mismatch, ()),
                ("fallback", bodies.fallback_verify, (SEED + 40 + world,)),
            ]
            if world in (2, 3)
            else []
        )
        for world in (1, 2, 3, 4)
    }
)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_verify_matches_the_reference(world: int) -> None:
    results = WORLDS.results(world, "matrix")
    want = bodies.cross_tp_expected(SEED + world)
    for got in results:
        # 3 dtypes x 8 cases + greedy-vs-argmax; N = 1 x 3; the full-row fallback
        assert got["cases"] == 3 * 8 + 1 + 3 + 1, got
        assert got["round2"] > 0 and got["round3"] > 0, got
        assert got["cross"] == want, "the tokens depend on tp"
    if len(results) == world:  # every rank holds the whole batch's results
        assert all(r == results[0] for r in results), results


def test_verify_tp8_matches_the_reference() -> None:
    """tp = 8 (the issue's largest split; 8 ranks on CI's 2 cores): a mixed batch with
    special rows and ``vocab_limit < V`` and a top-p batch with probes, float32 and
    bfloat16, and the cross-tp case, on its own spawned world."""
    results = run_ranks(8, bodies.verify_matrix, SEED, True, timeout_s=300)
    assert len(results) in (0, 1, 8), results
    want = bodies.cross_tp_expected(SEED)
    for got in results:
        assert got["cases"] == 2 * 2 + 1, got
        assert got["cross"] == want, "the tokens depend on tp"


def test_cross_tp_tokens_are_the_full_row_reference_for_every_split() -> None:
    """The same seeds give the same tokens at tp 1, 2, 3, 4 and 8: each split's cross-tp
    tokens equal the unsplit rows' (checked in the worlds above), so they equal each
    other; here the expectation itself is sampled and not degenerate."""
    for seed in (SEED + 1, SEED + 2, SEED + 3, SEED + 4, SEED):  # the worlds' seeds
        predict, length = bodies.cross_tp_expected(seed)
        assert len(set(predict)) > len(predict) // 4, predict
        assert len(length) == bodies.CROSS_PAD_BS


@pytest.mark.parametrize("world", [2, 3])
def test_different_arguments_raise_on_every_rank(world: int) -> None:
    for messages in WORLDS.results(world, "mismatch"):
        assert set(messages) == set(bodies.MISMATCHES), messages


@pytest.mark.parametrize("world", [2, 3])
def test_verify_through_fallback_comm_backend(world: int) -> None:
    """TokenSpeed's collectives object: the same results, one all_gather_into_tensor
    per round, and a parameter mismatch raises on every rank."""
    for got in WORLDS.results(world, "fallback"):
        assert got["cases"] == 3, got
        assert got["mismatch_calls"] == 1, got  # round 1 shows the mismatch: no more rounds
        assert "temperature" in got["message"], got["message"]

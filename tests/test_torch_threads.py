"""The torch backend's CPU swap does not depend on torch's thread count (issue 23,
point 5): its per-call copies never enter the intra-op pool, and its results are
bit-exact with one thread and with several. No timing is asserted here:
``scripts/bench_torch_cpu.py`` measures both thread settings."""

from __future__ import annotations

import os

import _bodies
import pytest

from ipc_dpsample.testing import run_ranks

pytestmark = pytest.mark.multirank

SEED = 20261223


@pytest.mark.parametrize("world", [2, 3])
def test_swap_is_bit_exact_with_one_and_with_many_threads(world: int) -> None:
    for checked in run_ranks(world, _bodies.torch_swap_threads_bit_exact, SEED):
        assert checked == 3 * 3 * 6, checked  # 3 settings x 3 dtypes x (4 + 2) swaps


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc/self/task (Linux)")
def test_swap_hot_path_starts_no_intra_op_pool_threads() -> None:
    for before, after in run_ranks(2, _bodies.torch_swap_starts_no_pool_threads):
        assert before == after, (before, after)

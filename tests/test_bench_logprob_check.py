"""The argmax logprob check of ``ipc-dpsample bench`` and ``demo`` (issue 23, point 3):
the library's float32 output against a float64 reference, within a tolerance derived
from float32's epsilon (:func:`ipc_dpsample.tools.common.logprob_atol`). The check
passes the library's real output (the torch backend's arithmetic on the bench's
data) and flags a logprob 1000 ulps off (100 ulps of a typical one too: not too
loose)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ipc_dpsample.backends.torch.argmax import combine_partials, local_partials
from ipc_dpsample.tools import bench, common
from ipc_dpsample.tools.bench import runners


def _library_argmax(
    tp: int, pad_bs: int, n: int, vocab: int, dtype: str, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What every rank's ``argmax_batch_vocab`` returns on the torch backend for the
    bench's inputs: each shard's partials, then each owner's combination."""
    vs, own = vocab // tp, pad_bs // tp * n
    parts = []
    for s in range(tp):
        x = bench.swap_input(seed, s, tp, pad_bs, n, vocab, dtype, "cpu")
        out = torch.empty((pad_bs * n, 3), dtype=torch.int32)
        local_partials(x, vs, s * vs, out)
        parts.append(out)
    results = []
    for r in range(tp):
        mine = torch.stack([p[r * own : (r + 1) * own] for p in parts])
        ids = torch.empty(own, dtype=torch.int32)
        lps = torch.empty(own, dtype=torch.float32)
        combine_partials(mine, ids, lps)
        results.append((ids, lps))
    return results


def _ulps(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` moved ``k`` float32 ulps away from zero."""
    out = x.numpy().copy()
    for _ in range(k):
        out = np.nextafter(out, np.float32(-np.inf) * np.sign(out), dtype=np.float32)
    return torch.from_numpy(out)


@pytest.mark.parametrize(
    ("tp", "pad_bs", "vocab", "dtype"),
    [(2, 8, 32000, "float32"), (4, 4, 32000, "bfloat16"), (2, 2, 152064, "bfloat16")],
)
def test_library_output_passes_and_1000_ulps_do_not(
    tp: int, pad_bs: int, vocab: int, dtype: str
) -> None:
    n = 4
    for r, (ids, lps) in enumerate(_library_argmax(tp, pad_bs, n, vocab, dtype)):
        full = bench.swap_expected(0, r, tp, pad_bs, n, vocab, dtype, "cpu")
        want_ids, ref = runners.argmax_expected(full, vocab)
        assert torch.equal(ids, want_ids)
        assert runners.close_logprobs(lps, ref, vocab) == ""
        # the library's error is a small part of the tolerance (it is not loose to fit)
        err = (lps.double() - ref).abs().numpy()
        assert (err <= common.logprob_atol(ref.numpy(), vocab) / 4).all(), err.max()
        # 1000 ulps off at the row with the largest |logprob| (the tolerance is about
        # 40 ulps there; it is absolute, as the sum's rounding is)
        i = int(lps.abs().argmax())
        assert abs(float(lps[i])) > 1.0
        off = lps.clone()
        off[i : i + 1] = _ulps(lps[i : i + 1], 1000)
        msg = runners.close_logprobs(off, ref, vocab)
        assert msg.startswith(f"1 of {len(lps)} logprobs differ"), msg
        assert f"first at {i}:" in msg


def test_tolerance_comes_from_float32_eps_and_the_magnitude() -> None:
    eps = float(np.finfo(np.float32).eps)
    atol = common.logprob_atol(np.array([-3.5, -0.5, -10.0]), 152064)
    assert atol[0] == pytest.approx(2 * eps * (2 * 3.5 + 2.2 * np.log2(152064) + 2))
    assert 1.0e-5 < atol[0] < 1.2e-5  # the figure of the docstring
    assert atol[1] < atol[0] < atol[2]  # grows with |lp|
    assert common.logprob_atol(np.array([-3.5]), 32000)[0] < atol[0]  # and with the vocab
    ulp = np.spacing(np.float32(3.5))
    assert 10 * ulp < atol[0] < 100 * ulp  # float32 rounding passes, 100 ulps do not
    assert common.logprob_atol(np.array([-1.0]), 1)[0] > 0  # a vocab of one column


def test_demo_check_uses_the_same_tolerance() -> None:
    """The demo compares with the layout's float64 reference (rounded to float32):
    1 ulp of difference passes, 1000 do not."""
    plan = common.DemoPlan(world=2, launch="processes", device="cpu", pad_bs=4, vocab=2000)
    d = common.make_round(plan, 0)[0]
    exp = d.expect_argmax[1]
    assert common.logprobs_close(exp.copy(), exp, plan.vocab) == ""
    near = np.nextafter(exp, np.float32(-np.inf))
    assert common.logprobs_close(near, exp, plan.vocab) == ""
    far = _ulps(torch.from_numpy(exp.copy()), 1000).numpy()
    assert common.logprobs_close(far, exp, plan.vocab).startswith(f"{exp.size} of {exp.size}")

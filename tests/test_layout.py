"""The NumPy reference of the three collectives (the executable spec), checked element by
element against the layout contract of DESIGN.md, exhaustively on small shapes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ipc_dpsample.layout import (
    Layout,
    reference_gather,
    reference_gather_verify_logprobs,
    reference_gather_verify_outputs,
    reference_swap_batch_vocab,
)

# every (tp, pad_bs, N, V/tp) with tp <= 4, pad_bs <= 3*tp, N <= 3, V/tp <= 3
SMALL = [
    (tp, pad_bs, n, shard)
    for tp in (1, 2, 3, 4)
    for pad_bs in range(tp, 3 * tp + 1, tp)
    for n in (1, 2, 3)
    for shard in (1, 2, 3)
]


def _unique_inputs(tp: int, rows: int, shard: int, dtype: np.dtype) -> list[np.ndarray]:
    """Inputs whose every element is distinct, so any misplaced element shows."""
    total = tp * rows * shard
    values = np.arange(1, total + 1, dtype=np.int64)
    np.random.default_rng(total).shuffle(values)
    return [
        values[s * rows * shard : (s + 1) * rows * shard].reshape(rows, shard).astype(dtype)
        for s in range(tp)
    ]


def _swap_by_contract(xs: list[np.ndarray], tp: int, pad_bs: int, n: int) -> list[np.ndarray]:
    """The contract, one element at a time: swapped row ``local_req*N + d`` on rank ``r``
    is global request ``r*R + local_req`` at draft position ``d``; its columns
    ``[s*V/tp, (s+1)*V/tp)`` came from rank ``s``."""
    r_per = pad_bs // tp
    shard = xs[0].shape[1]
    outs = []
    for r in range(tp):
        y = np.zeros((r_per * n, tp * shard), dtype=xs[0].dtype)
        for local_req in range(r_per):
            for d in range(n):
                global_row = (r * r_per + local_req) * n + d
                for s in range(tp):
                    for c in range(shard):
                        y[local_req * n + d, s * shard + c] = xs[s][global_row, c]
        outs.append(y)
    return outs


@pytest.mark.parametrize(("tp", "pad_bs", "n", "shard"), SMALL)
def test_swap_reference_matches_the_contract(tp: int, pad_bs: int, n: int, shard: int) -> None:
    xs = _unique_inputs(tp, pad_bs * n, shard, np.dtype(np.int32))
    copies = [x.copy() for x in xs]
    got = reference_swap_batch_vocab(xs, tp=tp, num_tokens_per_req=n, pad_bs=pad_bs)
    want = _swap_by_contract(xs, tp, pad_bs, n)
    lay = Layout(tp, 3 * tp, n, tp * shard)
    assert len(got) == tp
    for r in range(tp):
        assert got[r].shape == lay.swap_output_shape(pad_bs)
        assert got[r].flags.c_contiguous
        np.testing.assert_array_equal(got[r], want[r])
    for x, c in zip(xs, copies, strict=True):
        np.testing.assert_array_equal(x, c)  # inputs untouched
    # a permutation: every input element arrives exactly once
    assert sorted(np.concatenate([g.ravel() for g in got])) == sorted(
        np.concatenate([x.ravel() for x in xs])
    )


@pytest.mark.parametrize("dtype", [np.uint16, np.float16, np.float32, np.int8, np.float64])
def test_swap_reference_moves_bits_of_any_dtype(dtype: type) -> None:
    tp, pad_bs, n, shard = 2, 4, 3, 2
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, size=(tp, pad_bs * n, shard * np.dtype(dtype).itemsize))
    xs = [np.ascontiguousarray(raw[s].astype(np.uint8)).view(dtype) for s in range(tp)]
    got = reference_swap_batch_vocab(xs, tp=tp, num_tokens_per_req=n, pad_bs=pad_bs)
    want = _swap_by_contract(xs, tp, pad_bs, n)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == np.dtype(dtype)
        assert g.tobytes() == w.tobytes()  # bit-exact, NaN patterns included


@pytest.mark.parametrize(("tp", "r", "n"), list(itertools.product((1, 2, 3, 4), (1, 2, 3), (1, 2))))
def test_gather_references_match_the_contract(tp: int, r: int, n: int) -> None:
    pred = _unique_inputs(tp, r, n, np.dtype(np.int32))
    acc = [p + 1000 for p in pred]
    length = [p[:, 0].copy() * 7 for p in pred]
    lps = [p.astype(np.float32) * -0.5 for p in pred]
    gp, ga, gl = reference_gather_verify_outputs(pred, acc, length)
    glp = reference_gather_verify_logprobs(lps)
    lay = Layout(tp, tp * r, n, tp)
    assert gp.shape == ga.shape == glp.shape == lay.verify_gathered_shape(tp * r)
    assert gl.shape == (tp * r,)
    assert gp.dtype == ga.dtype == gl.dtype == np.int32
    assert glp.dtype == np.float32
    for src in range(tp):
        for i in range(r):
            row = src * r + i  # row src*R + i is row i of rank src
            np.testing.assert_array_equal(gp[row], pred[src][i])
            np.testing.assert_array_equal(ga[row], acc[src][i])
            assert gl[row] == length[src][i]
            np.testing.assert_array_equal(glp[row], lps[src][i])


def test_swap_reference_rejects_wrong_inputs() -> None:
    xs = [np.zeros((4, 2), np.float32) for _ in range(2)]
    with pytest.raises(ValueError, match="expected tp=3"):
        reference_swap_batch_vocab(xs, tp=3, num_tokens_per_req=1, pad_bs=3)
    with pytest.raises(ValueError, match=r"inputs\[0\] shape \(4, 2\) != expected \(6, 2\)"):
        reference_swap_batch_vocab(xs, tp=2, num_tokens_per_req=3, pad_bs=2)
    bad = [np.zeros((4, 2), np.float32), np.zeros((4, 3), np.float32)]
    with pytest.raises(ValueError, match=r"inputs\[1\] shape \(4, 3\) != expected \(4, 2\)"):
        reference_swap_batch_vocab(bad, tp=2, num_tokens_per_req=2, pad_bs=2)


def test_gather_reference_rejects_ragged_inputs() -> None:
    with pytest.raises(ValueError, match=r"locals_\[1\]"):
        reference_gather([np.zeros((2, 3), np.int32), np.zeros((2, 4), np.int32)])
    with pytest.raises(ValueError, match=r"locals_\[1\]"):
        reference_gather([np.zeros((2, 3), np.int32), np.zeros((2, 3), np.int64)])


@pytest.mark.parametrize(("tp", "pad_bs", "n", "shard"), SMALL)
def test_layout_shapes(tp: int, pad_bs: int, n: int, shard: int) -> None:
    lay = Layout(tp=tp, max_pad_bs=3 * tp, num_tokens_per_req=n, vocab_size=tp * shard)
    assert lay.vocab_shard == shard
    assert lay.max_reqs_per_rank == 3
    assert lay.reqs_per_rank(pad_bs) == pad_bs // tp
    assert lay.swap_input_shape(pad_bs) == (pad_bs * n, shard)
    assert lay.swap_output_shape(pad_bs) == (pad_bs // tp * n, tp * shard)
    assert lay.verify_local_shape(pad_bs) == (pad_bs // tp, n)
    assert lay.verify_gathered_shape(pad_bs) == (pad_bs, n)
    for itemsize in (2, 4):
        assert lay.swap_bytes_per_rank(pad_bs, itemsize) == pad_bs * n * shard * itemsize
    # what a rank sends is what the whole group receives, spread over tp ranks
    rows_in, cols_in = lay.swap_input_shape(pad_bs)
    rows_out, cols_out = lay.swap_output_shape(pad_bs)
    assert rows_in * cols_in == rows_out * cols_out


# -- argmax: the NumPy reference against torch on the contract's special rows ----------
@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_argmax_reference_equals_torch_argmax_and_log_softmax(tp: int, dtype: str) -> None:
    import torch
    from _gpu_common import argmax_inputs, reference_argmax

    n, vs = 3, 21
    pad_bs = 4 * tp
    for seed, limit in ((1, tp * vs), (2, tp * vs - 5), (3, min(vs + 1, tp * vs)), (4, 1)):
        x = argmax_inputs(seed, tp, pad_bs, n, vs, dtype, limit)
        out = reference_argmax(x, tp, pad_bs, n, dtype, limit)
        full = x.permute(1, 0, 2).reshape(pad_bs * n, tp * vs)[:, :limit].float()
        ids = torch.argmax(full, dim=1)
        lps = torch.log_softmax(full, dim=1).gather(1, ids[:, None])[:, 0]
        rows = pad_bs // tp * n
        for r, (got_ids, got_lps) in enumerate(out):
            want = slice(r * rows, (r + 1) * rows)
            assert got_ids.dtype == np.int32 and got_lps.dtype == np.float32
            np.testing.assert_array_equal(got_ids, ids[want].numpy())
            np.testing.assert_allclose(got_lps, lps[want].numpy(), atol=1e-5, equal_nan=True)


def test_argmax_reference_special_rows() -> None:
    from ipc_dpsample.layout import reference_argmax_batch_vocab

    inf, nan = np.inf, np.nan
    # tp=2, one request of N=5 rows, V/tp=3: the full row is shard 0 then shard 1
    s0 = np.array(
        [[1, 2, 9], [1, nan, 2], [-inf, -inf, -inf], [0, 0, 0], [3e38, 3e38, 1]], np.float32
    )
    s1 = np.array([[9, 0, 0], [nan, 5, 5], [-inf, -inf, -inf], [0, 0, 0], [3e38, 0, 0]], np.float32)
    pad = np.zeros((5, 3), np.float32)  # the second request's rows (rank 1's)
    (ids, lps), _ = reference_argmax_batch_vocab(
        [np.concatenate([s0, pad]), np.concatenate([s1, pad])],
        tp=2,
        num_tokens_per_req=5,
        pad_bs=2,
        dtype="float32",
    )
    assert ids.tolist() == [2, 1, 0, 0, 0]  # tie across the boundary: the lower index
    row0 = -np.log(2 + np.exp(-8) + np.exp(-7) + 2 * np.exp(-9))  # [1, 2, 9 | 9, 0, 0]
    np.testing.assert_allclose(lps[[0, 3, 4]], [row0, -np.log(6), -np.log(3)], rtol=1e-6)
    assert np.isnan(lps[1]) and np.isnan(lps[2])  # a NaN row, an all -inf row
    limited = reference_argmax_batch_vocab(
        [np.concatenate([s0, pad]), np.concatenate([s1, pad])],
        tp=2,
        num_tokens_per_req=5,
        pad_bs=2,
        dtype="float32",
        vocab_limit=2,
    )[0][0]
    assert limited.tolist() == [1, 1, 0, 0, 0]  # columns >= 2 never win
    with pytest.raises(ValueError, match="vocab_limit=7"):
        reference_argmax_batch_vocab(
            [np.concatenate([s0, pad]), np.concatenate([s1, pad])],
            tp=2,
            num_tokens_per_req=5,
            pad_bs=2,
            dtype="float32",
            vocab_limit=7,
        )


@pytest.mark.parametrize(("bs", "expect"), [(None, [3, 3, 3]), (0, [0, 0, 0]), (4, [3, 1, 0])])
def test_real_reqs_is_a_prefix_split_across_ranks(bs: int | None, expect: list[int]) -> None:
    from ipc_dpsample.layout import real_reqs

    assert [real_reqs(3, bs, r) for r in range(3)] == expect
    assert sum(real_reqs(3, 7, r) for r in range(3)) == 7

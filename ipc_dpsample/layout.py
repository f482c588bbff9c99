"""Shape math and the NumPy reference of the three collectives: the executable spec.

Layout contract
---------------
* ``swap_batch_vocab``: rank ``s`` gives ``x_s[pad_bs * N, V / tp]`` (the whole padded
  batch, its own vocabulary shard). Rank ``r`` gets ``y_r[pad_bs / tp * N, V]`` where
  row ``local_req * N + d`` is global request ``r * R + local_req`` (``R = pad_bs / tp``)
  at draft position ``d`` and columns ``[s * V/tp, (s + 1) * V/tp)`` came from rank
  ``s``: ``y_r[i, s*Vs:(s+1)*Vs] = x_s[r*R*N + i, :]``.
* gathers: rank ``src`` gives ``a_src[R, ...]``; every rank gets ``[pad_bs, ...]``
  whose row ``src * R + i`` is row ``i`` of rank ``src``.
* ``argmax_batch_vocab``: the input of a swap; rank ``r`` gets, for each row of
  its swap output, the index of the first maximal element of the full row trimmed
  to ``vocab_limit`` (``torch.argmax`` semantics: a NaN wins, first NaN first) and
  its log-softmax value over those columns in float32.
* real rows (``bs``): the real requests are the prefix ``[0, bs)`` of the padded
  batch. Rank ``r`` owns :meth:`Layout.real_reqs` of them (a prefix of its
  ``R``); swap and argmax outputs are defined on the rows of those requests
  (``real_reqs * N`` leading rows), gathered outputs on their ``bs`` leading rows.
  Every other row is undefined (the one-sided backend leaves it untouched).

The swap and gather references move bits only, so they work for any NumPy dtype
(bfloat16 is carried as its ``uint16`` bit pattern); the argmax reference decodes
values (:func:`as_float32`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "Layout",
    "as_float32",
    "real_reqs",
    "reference_argmax_batch_vocab",
    "reference_gather",
    "reference_gather_verify_logprobs",
    "reference_gather_verify_outputs",
    "reference_swap_batch_vocab",
]


@dataclass(frozen=True)
class Layout:
    """Shapes of one communicator's operations.

    Parameters
    ----------
    tp : int
        Number of ranks.
    max_pad_bs : int
        Largest padded batch size; a multiple of ``tp``.
    num_tokens_per_req : int
        ``N``, rows per request (draft tokens + 1).
    vocab_size : int
        ``V``, padded communication vocabulary; a multiple of ``tp``.
    """

    tp: int
    max_pad_bs: int
    num_tokens_per_req: int
    vocab_size: int

    @property
    def vocab_shard(self) -> int:
        """``V / tp``: columns each rank holds before the swap."""
        return self.vocab_size // self.tp

    @property
    def max_reqs_per_rank(self) -> int:
        """``max_pad_bs / tp``."""
        return self.max_pad_bs // self.tp

    def reqs_per_rank(self, pad_bs: int) -> int:
        """``R = pad_bs / tp``: requests owned by each rank."""
        return pad_bs // self.tp

    def swap_input_shape(self, pad_bs: int) -> tuple[int, int]:
        """``(pad_bs * N, V / tp)``."""
        return (pad_bs * self.num_tokens_per_req, self.vocab_shard)

    def swap_output_shape(self, pad_bs: int) -> tuple[int, int]:
        """``(pad_bs / tp * N, V)``."""
        return (pad_bs // self.tp * self.num_tokens_per_req, self.vocab_size)

    def verify_local_shape(self, pad_bs: int) -> tuple[int, int]:
        """``(pad_bs / tp, N)``: ``predict``, ``accept_index`` and ``logprobs`` per rank."""
        return (pad_bs // self.tp, self.num_tokens_per_req)

    def verify_gathered_shape(self, pad_bs: int) -> tuple[int, int]:
        """``(pad_bs, N)``."""
        return (pad_bs, self.num_tokens_per_req)

    def swap_bytes_per_rank(self, pad_bs: int, itemsize: int, bs: int | None = None) -> int:
        """Bytes one rank sends in a swap (its input rows of real requests, own rows
        included; every row when ``bs`` is None)."""
        reqs = pad_bs if bs is None else min(max(bs, 0), pad_bs)
        return reqs * self.num_tokens_per_req * self.vocab_shard * itemsize

    def real_reqs(self, pad_bs: int, bs: int | None, rank: int) -> int:
        """Real requests among rank ``rank``'s ``R`` (see :func:`real_reqs`)."""
        return real_reqs(pad_bs // self.tp, bs, rank)


def real_reqs(reqs_per_rank: int, bs: int | None, rank: int) -> int:
    """How many of rank ``rank``'s requests ``[rank*R, (rank+1)*R)`` are real when the
    real ones are the prefix ``[0, bs)``: ``clamp(bs - rank*R, 0, R)`` (``R`` when
    ``bs`` is None)."""
    if bs is None:
        return reqs_per_rank
    return max(0, min(reqs_per_rank, bs - rank * reqs_per_rank))


def reference_swap_batch_vocab(
    inputs: Sequence[np.ndarray], *, tp: int, num_tokens_per_req: int, pad_bs: int
) -> list[np.ndarray]:
    """NumPy reference of ``swap_batch_vocab``.

    Parameters
    ----------
    inputs : sequence of tp arrays ``[pad_bs * N, V / tp]``, any dtype
        ``inputs[s]`` is rank ``s``'s ``local_logits``.
    tp, num_tokens_per_req, pad_bs : int

    Returns
    -------
    list of tp arrays ``[pad_bs / tp * N, V]``, same dtype
        Element ``r`` is what rank ``r`` must receive.
    """
    if len(inputs) != tp:
        raise ValueError(f"got {len(inputs)} inputs, expected tp={tp}")
    n = num_tokens_per_req
    rows_per_rank = pad_bs // tp * n
    shard = inputs[0].shape[1]
    for s, x in enumerate(inputs):
        if x.shape != (pad_bs * n, shard):
            raise ValueError(f"inputs[{s}] shape {x.shape} != expected {(pad_bs * n, shard)}")
    # [src, dst, rows, shard] -> [dst, rows, src, shard]
    stacked = np.stack(inputs).reshape(tp, tp, rows_per_rank, shard)
    out = stacked.transpose(1, 2, 0, 3).reshape(tp, rows_per_rank, tp * shard)
    return [np.ascontiguousarray(out[r]) for r in range(tp)]


def reference_gather(locals_: Sequence[np.ndarray]) -> np.ndarray:
    """NumPy reference of an all-gather along dimension 0: row ``src * R + i`` of the
    result is row ``i`` of ``locals_[src]``."""
    first = locals_[0]
    for src, a in enumerate(locals_):
        if a.shape != first.shape or a.dtype != first.dtype:
            raise ValueError(
                f"locals_[{src}] is {a.shape} {a.dtype}, expected {first.shape} {first.dtype}"
            )
    return np.concatenate(list(locals_), axis=0)


def reference_gather_verify_outputs(
    predict: Sequence[np.ndarray],
    accept_index: Sequence[np.ndarray],
    accept_length: Sequence[np.ndarray],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """NumPy reference of ``gather_verify_outputs``.

    Parameters
    ----------
    predict, accept_index : sequences of tp int32 arrays ``[R, N]``
    accept_length : sequence of tp int32 arrays ``[R]``

    Returns
    -------
    (predict ``[pad_bs, N]``, accept_index ``[pad_bs, N]``, accept_length ``[pad_bs]``), int32
    """
    return (
        reference_gather(predict),
        reference_gather(accept_index),
        reference_gather(accept_length),
    )


def reference_gather_verify_logprobs(logprobs: Sequence[np.ndarray]) -> np.ndarray:
    """NumPy reference of ``gather_verify_logprobs``: tp float32 ``[R, N]`` ->
    float32 ``[pad_bs, N]``."""
    return reference_gather(logprobs)


def as_float32(x: np.ndarray, dtype: str) -> np.ndarray:
    """Values of ``x`` as float32: ``dtype`` ``"bfloat16"`` reads ``x`` as the uint16
    bit patterns of bfloat16 values; ``"float16"``/``"float32"`` convert."""
    if dtype == "bfloat16":
        bits = np.asarray(x).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32)
    if dtype in ("float16", "float32"):
        return np.asarray(x).astype(np.float32)
    raise ValueError(f"dtype={dtype!r}; expected bfloat16, float16 or float32")


def _argmax_row_stats(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``torch.argmax`` and ``torch.log_softmax(...)[argmax]`` of each float32 row."""
    nan = np.isnan(rows)
    any_nan = nan.any(axis=1)
    idx = np.where(any_nan, nan.argmax(axis=1), np.argmax(np.where(nan, -np.inf, rows), axis=1))
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        x = rows.astype(np.float64)
        m = x.max(axis=1)
        finite_max = np.isfinite(m)
        shifted = np.where(finite_max[:, None], x - np.where(finite_max, m, 0)[:, None], np.nan)
        # (x - max) - log(sum exp(x - max)), as torch.log_softmax orders it: forming
        # max + log(sum) first would lose log(sum) next to a max of 1e38
        log_sum = np.log(np.exp(shifted).sum(axis=1))
        chosen = x[np.arange(len(x)), idx]
        lp = np.where(
            finite_max & ~any_nan, (chosen - np.where(finite_max, m, 0)) - log_sum, np.nan
        )
    return idx.astype(np.int32), lp.astype(np.float32)


def reference_argmax_batch_vocab(
    inputs: Sequence[np.ndarray],
    *,
    tp: int,
    num_tokens_per_req: int,
    pad_bs: int,
    dtype: str,
    vocab_limit: int | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """NumPy reference of ``argmax_batch_vocab``.

    Parameters
    ----------
    inputs : sequence of tp arrays ``[pad_bs * N, V / tp]``
        ``inputs[s]`` is rank ``s``'s ``local_logits`` (bfloat16 as uint16 bits).
    tp, num_tokens_per_req, pad_bs : int
    dtype : {"bfloat16", "float16", "float32"}
    vocab_limit : int or None
        Columns ``>= vocab_limit`` of the full row never count (None: ``V``).

    Returns
    -------
    list of tp pairs (token_ids int32 ``[R*N]``, logprobs float32 ``[R*N]``)
        Element ``r`` is what rank ``r`` must receive: for swap-output row ``i`` of
        rank ``r``, the first index of the row's maximum (a NaN wins, like
        ``torch.argmax``; an all ``-inf`` row gives 0) and
        ``torch.log_softmax(row.float())[index]`` (NaN when the row holds a NaN or
        ``+inf`` or only ``-inf``).
    """
    full = reference_swap_batch_vocab(
        inputs, tp=tp, num_tokens_per_req=num_tokens_per_req, pad_bs=pad_bs
    )
    v = full[0].shape[1]
    limit = v if vocab_limit is None else vocab_limit
    if not 1 <= limit <= v:
        raise ValueError(f"vocab_limit={vocab_limit}; expected 1 <= vocab_limit <= V={v}")
    return [_argmax_row_stats(as_float32(y, dtype)[:, :limit]) for y in full]

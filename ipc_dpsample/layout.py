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

All references move bits only, so they work for any NumPy dtype (bfloat16 is
carried as its ``uint16`` bit pattern).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "Layout",
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

    def swap_bytes_per_rank(self, pad_bs: int, itemsize: int) -> int:
        """Bytes one rank sends in a swap (its whole input, own rows included)."""
        rows, cols = self.swap_input_shape(pad_bs)
        return rows * cols * itemsize


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

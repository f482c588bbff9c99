"""The arithmetic of ``argmax_batch_vocab`` on the torch backend: per-shard partials
and their combination (pure functions on torch tensors, no communication).

A partial is 3 int32 words per row: the shard's float32 maximum (its bit pattern),
the *global* column index of its first maximal element, and the float32 sum of
``exp(x - max)`` over the shard's columns. The combination follows
``torch.argmax``/``torch.log_softmax``: a NaN beats everything (the smallest
global index among NaNs), otherwise the larger maximum wins and equal maxima go to
the smaller global index; the log-probability is ``-log(sum)`` when the combined
maximum is finite, else NaN.
"""

from __future__ import annotations

import torch

__all__ = ["EMPTY_INDEX", "PARTIAL_WORDS", "combine_partials", "local_partials"]

#: int32 words per row of a partial: max bits, global index, sum-of-exp bits.
PARTIAL_WORDS = 3
#: Index of a shard with no column below ``vocab_limit``: it loses every tie.
EMPTY_INDEX = 2**31 - 1


def local_partials(x: torch.Tensor, limit: int, col0: int, out: torch.Tensor) -> None:
    """Partials of each row of one vocabulary shard.

    Parameters
    ----------
    x : tensor ``[rows, V/tp]``, bfloat16, float16 or float32
        This rank's shard of ``rows`` logits rows.
    limit : int
        Columns ``>= limit`` of the shard do not count (``vocab_limit - col0``
        clamped to ``[0, V/tp]``); 0: the shard is empty.
    col0 : int
        Global index of the shard's column 0 (``rank * V/tp``).
    out : int32 tensor ``[rows, 3]``
        Receives the partials (see the module docstring). An empty shard gives
        ``(-inf, EMPTY_INDEX, 0)``.
    """
    if limit <= 0:
        out[:, 0].view(torch.float32).fill_(float("-inf"))
        out[:, 1].fill_(EMPTY_INDEX)
        out[:, 2].view(torch.float32).fill_(0.0)
        return
    xf = x[:, :limit].float()
    idx = torch.argmax(xf, dim=1, keepdim=True)  # first max; a NaN wins, first NaN first
    m = xf.gather(1, idx)
    # -inf rows shift by 0 (every exp is 0); +inf/NaN rows end NaN after combining
    shift = torch.where(torch.isfinite(m), m, 0.0)
    out[:, 0:1].copy_(m.view(torch.int32))
    out[:, 1:2].copy_(idx.add_(col0))
    out[:, 2].view(torch.float32).copy_(torch.exp(xf - shift).sum(dim=1))


def combine_partials(parts: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor) -> None:
    """Combine the partials of every shard of each row.

    Parameters
    ----------
    parts : int32 tensor ``[tp, rows, 3]``
        ``parts[s]`` are the partials of shard ``s`` (shards in column order).
    ids : int32 tensor ``[rows]``
        Receives the global index of each row's first maximum (``torch.argmax``).
    logprobs : float32 tensor ``[rows]``
        Receives ``log_softmax(row)[ids]``, NaN when the row holds a NaN or
        ``+inf`` or only ``-inf``.
    """
    m = parts[..., 0].view(torch.float32)
    idx = parts[..., 1]
    se = parts[..., 2].view(torch.float32)
    nan = torch.isnan(m)
    any_nan = nan.any(dim=0)
    best = torch.where(nan, float("-inf"), m).amax(dim=0)
    # shards are in column order: the first winning shard holds the smallest index
    first_nan = nan.to(torch.uint8).argmax(dim=0)
    first_max = (m == best).to(torch.uint8).argmax(dim=0)
    winner = torch.where(any_nan, first_nan, first_max)
    ids.copy_(idx.gather(0, winner[None])[0])
    total = (se * torch.exp(m - best)).sum(dim=0)
    ok = torch.isfinite(best) & ~any_nan
    logprobs.copy_(torch.where(ok, -torch.log(total), float("nan")))

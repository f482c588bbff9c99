"""TokenSpeed compatibility: the stateless ``swap_batch_vocab`` free function that
TokenSpeed imports as its NCCL fallback, with the same keywords and layout.

A TokenSpeed user changes one import; :class:`~ipc_dpsample.DpSamplingComm` keeps
TokenSpeed's constructor and semantics (lazy dtype, ``prepare_verify_outputs``,
``is_initialized``, ``fallback_comm_backend``); README "Differences from TokenSpeed"
lists where this package deliberately differs.
"""

from __future__ import annotations

from typing import Any

from .layout import Layout

__all__ = ["swap_batch_vocab"]


def swap_batch_vocab(
    local_logits: Any,
    *,
    tp_size: int,
    pad_bs: int,
    num_tokens_per_req: int,
    vocab_size: int,
    group: Any = None,
    rank: int | None = None,
    backend: Any = None,
) -> Any:
    """All-to-all from vocabulary shards to request shards, without a communicator.

    One ``all_to_all_single`` of the whole input, then one permute into a new
    tensor: no persistent buffers, no mismatch detection, every wait as long as
    the group's timeout (use :class:`~ipc_dpsample.DpSamplingComm` for those).

    Parameters
    ----------
    local_logits : torch.Tensor ``[pad_bs * N, V / tp_size]``
        Rows of phantom requests may hold anything; they travel too.
    tp_size, pad_bs, num_tokens_per_req, vocab_size : int
        ``pad_bs`` and ``vocab_size`` multiples of ``tp_size``.
    group : torch ProcessGroup or None
        None: the default group.
    rank : int or None
        This rank in ``group`` (accepted for TokenSpeed's signature; checked when
        given).
    backend : object or None
        TokenSpeed's ``CommBackend`` shape: ``all_to_all_single(output, input,
        group)``; None: ``torch.distributed.all_to_all_single``.

    Returns
    -------
    torch.Tensor ``[pad_bs / tp_size * N, V]``, the input's dtype and device
        Row ``local_req * N + d`` is global request ``rank * pad_bs/tp + local_req``
        at draft position ``d``; columns ``[s*V/tp, (s+1)*V/tp)`` came from rank ``s``.

    Raises
    ------
    ValueError, TypeError
        Inconsistent sizes or a non-tensor input (the message names the expected
        value).
    """
    import torch
    import torch.distributed as dist

    if not isinstance(local_logits, torch.Tensor):
        raise TypeError(f"local_logits must be a torch.Tensor, got {type(local_logits).__name__}")
    for name, value in (
        ("tp_size", tp_size),
        ("pad_bs", pad_bs),
        ("num_tokens_per_req", num_tokens_per_req),
        ("vocab_size", vocab_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}; expected a positive int")
    if pad_bs % tp_size or vocab_size % tp_size:
        raise ValueError(
            f"pad_bs={pad_bs} and vocab_size={vocab_size} must be multiples of tp_size={tp_size}"
        )
    layout = Layout(tp_size, pad_bs, num_tokens_per_req, vocab_size)
    expected = layout.swap_input_shape(pad_bs)
    if tuple(local_logits.shape) != expected:
        raise ValueError(
            f"local_logits shape {tuple(local_logits.shape)} != expected {expected} "
            f"(pad_bs*N rows with N={num_tokens_per_req}, V/tp={vocab_size // tp_size} columns)"
        )
    if rank is not None and dist.is_initialized():
        actual = dist.get_rank(group)
        if actual != rank:
            raise ValueError(f"rank={rank} != this process's rank {actual} in the group")
    x = local_logits.contiguous()
    rows, shard = pad_bs // tp_size * num_tokens_per_req, vocab_size // tp_size
    if tp_size == 1:
        return x.clone()
    received = torch.empty_like(x)
    if backend is not None:
        backend.all_to_all_single(received, x, group)
    else:
        dist.all_to_all_single(received, x, group=group)
    # [src, rows, shard] -> [rows, src, shard]
    return received.view(tp_size, rows, shard).transpose(0, 1).reshape(rows, tp_size * shard)

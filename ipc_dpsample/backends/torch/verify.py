"""``verify_batch_vocab`` on the torch backend: the sharded algorithm of
:mod:`ipc_dpsample.verify_shards` (NumPy, on the host) over the backend's all-gather.

This is the portable path, not the fast one: the logits shard and the candidates are
read on the host (zero-copy NumPy views of CPU tensors; CUDA tensors are copied to
the host and the results copied back), every rank computes its records with NumPy,
and the records travel through the backend's header + payload all-to-all.

Rounds
------
Each round is one all-gather-shaped collective: a rank sends the same block to every
peer (never to itself), the 16-byte call header, then the 80-byte *verify header*
(:func:`verify_header`), then the round's payload of real rows only:

1. every real row's record of this rank's shard
   (:func:`~ipc_dpsample.verify_shards.shard_records`, 128..1312 bytes a row, the
   capacities of :func:`~ipc_dpsample.verify_shards.record_caps`); every rank then
   runs :func:`~ipc_dpsample.verify_shards.combine_records` on all shards' records;
2. only when rows are pending (every rank derives the same pending rows from the
   same records, so no rank needs a message to know whether this round happens):
   the probes of those rows (:func:`~ipc_dpsample.verify_shards.probe_records`,
   896 bytes a row), closed by :func:`~ipc_dpsample.verify_shards.combine_probes`;
3. only when rows are still open: the shard's logits of those rows (the full-row
   fallback, :func:`~ipc_dpsample.verify_shards.full_row_tokens`), in chunks that
   fit one block.

Then every rank runs the accept chain (:func:`ipc_dpsample.layout.finish_verify`)
for the whole batch, so every rank holds every request's results.

The verify header
-----------------
20 little-endian int32 words: ``round | list_cap << 8 | stair_cap << 16 |
return_logprobs << 24``, ``vocab_limit``, the payload's item count, the chunk index,
then seven 8-byte BLAKE2b digests of the normalised parameters of the real requests
(:data:`DIGESTED`: temperature, top_k, top_p, min_p, seed, offset, candidates) and an
8-byte digest of the rows the round carries (rounds 2 and 3). Every rank compares
every peer's verify header with its own before it reads a payload: ranks whose
calls agree (the call header) but whose parameters differ raise
:class:`ParamsDiverged`, naming the arguments that differed, on every rank; the
backend turns it into the divergence error and, as after any divergence, the
communicator is then unusable. Phantom requests (``>= bs``) are not digested: their
values may differ between ranks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from ...errors import DpSampleError
from ...layout import VerifyParams, finish_verify
from ...verify_shards import (
    combine_probes,
    combine_records,
    full_row_tokens,
    probe_dtype,
    probe_records,
    record_caps,
    record_dtype,
    shard_records,
)

__all__ = [
    "DIGESTED",
    "MAX_RECORD_BYTES",
    "VHDR_BYTES",
    "VHDR_WORDS",
    "ParamsDiverged",
    "VerifyRounds",
    "differing_fields",
    "run_verify",
    "verify_header",
]

VHDR_WORDS = 20
VHDR_BYTES = 4 * VHDR_WORDS
#: The largest record (list 128, staircase 16): what round 1 may send per row.
MAX_RECORD_BYTES = record_dtype().itemsize
#: The arguments whose digests travel in the verify header, in word order.
DIGESTED = ("temperature", "top_k", "top_p", "min_p", "seed", "offset", "candidates")
_DIGEST0 = 4  # first word of the digests
_ROWS = _DIGEST0 + 2 * len(DIGESTED)  # the rows digest: words 18-19

_STORAGE = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32}

#: ``allgather(verify_header, payload)`` -> every shard's block (verify header, then
#: payload, as uint8), in rank order, this rank's own included.
AllGather = Callable[[np.ndarray, np.ndarray], Sequence[np.ndarray]]


class ParamsDiverged(Exception):
    """A peer's verify header differs from this rank's.

    Attributes
    ----------
    peer : int
    fields : list of str
        The arguments that differed (``"temperature"``, ``"vocab_limit"``...).
    internal : bool
        The parameters agree but the rounds do not (ranks computed different
        records): a bug of this library, not of the caller.
    """

    def __init__(self, peer: int, fields: list[str], internal: bool = False):
        super().__init__(f"rank {peer}: {', '.join(fields)} differ")
        self.peer, self.fields, self.internal = peer, fields, internal


class VerifyRounds(NamedTuple):
    """Real rows decided by each round of the last call (``round1 + round2 + round3
    == bs * N``)."""

    round1: int
    round2: int
    round3: int


def _digest(a: np.ndarray) -> np.ndarray:
    raw = hashlib.blake2b(np.ascontiguousarray(a).tobytes(), digest_size=8).digest()
    return np.frombuffer(raw, dtype="<i4")


def verify_header(
    params: VerifyParams,
    candidates: np.ndarray,
    *,
    caps: tuple[int, int],
    return_logprobs: bool,
) -> np.ndarray:
    """The round-1 verify header (int32 ``[VHDR_WORDS]``) of one call; see the module
    docstring. Phantom requests (``>= bs``) do not count."""
    bs = params.bs
    words = np.zeros(VHDR_WORDS, dtype="<i4")
    words[0] = 1 | caps[0] << 8 | caps[1] << 16 | int(return_logprobs) << 24
    words[1] = params.vocab_limit
    words[2] = params.real_rows
    arrays = (
        params.temperature[:bs],
        params.top_k[:bs],
        params.top_p[:bs],
        params.min_p[:bs],
        params.seed[:bs],
        params.offset[:bs],
        candidates[:bs],
    )
    for i, a in enumerate(arrays):
        words[_DIGEST0 + 2 * i : _DIGEST0 + 2 * i + 2] = _digest(a)
    return words


def _round_header(first: np.ndarray, rnd: int, rows: np.ndarray, chunk: int = 0) -> np.ndarray:
    words = first.copy()
    words[0] = (words[0] & ~0xFF) | rnd
    words[2] = len(rows)
    words[3] = chunk
    words[_ROWS : _ROWS + 2] = _digest(np.asarray(rows, dtype="<i8"))
    return words


def differing_fields(mine: np.ndarray, theirs: np.ndarray) -> tuple[list[str], bool]:
    """The arguments two verify headers disagree on, and whether the disagreement is
    internal (same arguments, different rounds). Empty when they are equal."""
    fields = []
    if (mine[0] ^ theirs[0]) >> 24 & 1:
        fields.append("return_logprobs")
    if mine[1] != theirs[1]:
        fields.append("vocab_limit")
    for i, name in enumerate(DIGESTED):
        w = slice(_DIGEST0 + 2 * i, _DIGEST0 + 2 * i + 2)
        if not np.array_equal(mine[w], theirs[w]):
            fields.append(name)
    if fields:
        return fields, False
    if not np.array_equal(mine, theirs):
        rnd = int(mine[0] & 0xFF)
        return [f"the rows of round {rnd} ({int(mine[2])} vs {int(theirs[2])})"], True
    return [], False


def _gather(
    allgather: AllGather, shard: int, header: np.ndarray, payload: np.ndarray, item: np.dtype
) -> list[np.ndarray]:
    """One round: send ``payload``, check every peer's verify header, return every
    shard's payload as ``item`` arrays (this shard's own is ``payload`` itself)."""
    blocks = allgather(header, payload.reshape(-1).view(np.uint8))
    out = []
    for s, block in enumerate(blocks):
        if s == shard:
            out.append(payload)
            continue
        theirs = block[:VHDR_BYTES].view("<i4")
        fields, internal = differing_fields(header, theirs)
        if fields:
            raise ParamsDiverged(s, fields, internal)
        out.append(block[VHDR_BYTES : VHDR_BYTES + payload.nbytes].view(item))
    return out


def run_verify(
    local: np.ndarray,
    candidates: np.ndarray,
    *,
    shard: int,
    tp: int,
    dtype: str,
    params: VerifyParams,
    return_logprobs: bool,
    allgather: AllGather,
    capacity: int,
) -> tuple[tuple[np.ndarray, ...], VerifyRounds]:
    """One ``verify_batch_vocab`` call on this rank: every round, combine and the
    accept chain (see the module docstring).

    Parameters
    ----------
    local : ``[pad_bs * N, V / tp]`` (bfloat16 as uint16 bits, float16, float32)
        This rank's shard of every row (host memory).
    candidates : int32 ``[pad_bs, N]`` (host memory)
    shard, tp : int
    dtype : {"bfloat16", "float16", "float32"}
    params : VerifyParams
        Validated (:func:`ipc_dpsample.layout.verify_params`).
    return_logprobs : bool
    allgather : callable
        ``allgather(verify_header, payload_bytes)`` -> every shard's block in rank
        order (see :data:`AllGather`); it raises on a call-header mismatch.
    capacity : int
        Most bytes one block may hold after the call header (verify header included).

    Returns
    -------
    outputs : tuple of NumPy arrays
        ``(predict, accept_index, accept_length[, logprobs])`` as
        :func:`ipc_dpsample.layout.reference_verify_batch_vocab` returns them.
    rounds : VerifyRounds

    Raises
    ------
    ParamsDiverged
        A peer's verify header differs (before any payload is read).
    """
    real = params.real_rows
    caps = record_caps(params)
    header = verify_header(params, candidates, caps=caps, return_logprobs=return_logprobs)
    rec_dt = record_dtype(*caps)
    if VHDR_BYTES + real * rec_dt.itemsize > capacity:  # M is sized for max_pad_bs rows
        raise DpSampleError(f"records of {real} rows exceed the block ({capacity} bytes)")
    mine = shard_records(
        local, shard=shard, tp=tp, dtype=dtype, params=params, list_cap=caps[0], stair_cap=caps[1]
    )[:real]
    records = _gather(allgather, shard, header, mine, rec_dt)
    comb = combine_records(records, params, stair_cap=caps[1])
    tokens, token_val = comb.tokens.copy(), comb.token_val.copy()
    n2 = n3 = 0
    left: list[int] = []
    if comb.pending:  # the same rows on every rank: no message decides this
        rows = np.array(sorted(comb.pending), dtype=np.int64)
        probes = probe_records(local, shard=shard, dtype=dtype, params=params, pending=comb.pending)
        got = _gather(allgather, shard, _round_header(header, 2, rows), probes, probe_dtype())
        for row, win in combine_probes(comb.pending, got).items():
            if win is None:
                left.append(row)
            else:
                tokens[row], token_val[row] = win
                n2 += 1
    if left:  # the exact fallback: the rows' full logits, in chunks of whole rows
        storage = np.dtype(_STORAGE[dtype])
        row_bytes = local.shape[1] * storage.itemsize
        step = max(1, (capacity - VHDR_BYTES) // max(row_bytes, 1))
        for chunk, lo in enumerate(range(0, len(left), step)):
            rows = np.array(left[lo : lo + step], dtype=np.int64)
            part = np.ascontiguousarray(local[rows])
            got = _gather(allgather, shard, _round_header(header, 3, rows, chunk), part, storage)
            full = np.concatenate([g.reshape(len(rows), -1) for g in got], axis=1)
            tokens[rows], token_val[rows] = full_row_tokens(full, rows, dtype=dtype, params=params)
        n3 = len(left)
    lps = comb.logprobs(token_val) if return_logprobs else None
    outputs = finish_verify(candidates, tokens, params, tp, lps)
    return outputs, VerifyRounds(real - n2 - n3, n2, n3)

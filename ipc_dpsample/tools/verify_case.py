"""``verify_batch_vocab`` inputs and expected outputs for the tools (bench, demo, doctor).

* :data:`VERIFY_MIXES`: per-request parameter mixes (``ipc-dpsample bench
  --verify-mix``); :func:`mix_params` draws one batch of parameters of a mix,
  :func:`mix_text` describes it in words.
* :func:`accepting_candidates`: candidates whose drafts follow the sampled tokens for a
  different number of positions per request, then differ, so every accept length from 1
  to ``N`` occurs.
* :func:`make_verify_case`: parameters, candidates and the reference's outputs of one
  batch (:class:`VerifyCase`), from every rank's ``local_logits``.
* :func:`record_bytes`: the record each shard sends per row for a batch of a mix
  (``docs/verify_contract.md``, "Bytes and rounds"); :func:`onesided_broadcasts`:
  whether the one-sided backend sends it to every rank (small batches) or to the
  row's owner.

The data is drawn from a NumPy generator the caller seeds identically on every rank, so
every rank builds the same case.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..backends.verify_plan import device_list_cap, kernel_path_refusal, list_cap
from ..backends.verify_plan import record_words as kernel_record_words
from ..layout import finish_verify, reference_verify_batch_vocab, verify_params
from ..verify_shards import record_caps, record_words
from .common import VERIFY, bits_equal

__all__ = [
    "DEMO_MIX",
    "TARGET_MIXES",
    "VERIFY",
    "VERIFY_MIXES",
    "VerifyCase",
    "accepting_candidates",
    "make_verify_case",
    "mix_params",
    "mix_text",
    "onesided_broadcasts",
    "record_bytes",
]

#: Per-request parameter mixes: every request greedy; temperature only (T drawn from
#: 0.6, 0.7, 0.8, 1.0 per request); top-k 50; top-k 50 with top-p 0.9; min-p 0.05;
#: top-p 0.9 without top-k; and ``mixed``, a serving batch of half greedy requests
#: (temperature 0, top-k 1) and half at temperature 0.8, top-k 50, top-p 0.9.
VERIFY_MIXES: tuple[str, ...] = (
    "greedy",
    "temperature",
    "topk50",
    "topk50-topp0.9",
    "minp",
    "topp0.9",
    "mixed",
)
#: The mixes issue 24's GPU targets name (temperature only, top-k 50, top-k 50 + top-p 0.9).
TARGET_MIXES: tuple[str, ...] = ("temperature", "topk50", "topk50-topp0.9")
#: The demo's (and the doctor's) mix.
DEMO_MIX = "mixed"
_TEMPERATURES = np.asarray((0.6, 0.7, 0.8, 1.0), np.float32)
_TEXT = {
    "greedy": "every request greedy (temperature 0)",
    "temperature": "temperature only (T in 0.6..1.0 per request)",
    "topk50": "top-k 50 (T in 0.6..1.0)",
    "topk50-topp0.9": "top-k 50 and top-p 0.9 (T in 0.6..1.0)",
    "minp": "min-p 0.05 without top-k (T in 0.6..1.0)",
    "topp0.9": "top-p 0.9 without top-k (T in 0.6..1.0)",
    "mixed": "half greedy, half temperature 0.8 with top-k 50 and top-p 0.9",
}


def mix_text(mix: str) -> str:
    """``mix`` in words (for tables)."""
    return _TEXT[_known(mix)]


def _known(mix: str) -> str:
    if mix not in VERIFY_MIXES:
        raise ValueError(f"mix={mix!r}; expected one of {','.join(VERIFY_MIXES)}")
    return mix


def mix_params(mix: str, pad_bs: int, rng: np.random.Generator) -> dict[str, np.ndarray | None]:
    """One batch of per-request parameters of ``mix``: the keywords of
    ``verify_batch_vocab`` (and of the reference) except the logits and candidates.

    Returns
    -------
    dict
        ``temperature`` float32 ``[pad_bs]``, ``seed`` and ``offset`` int64 ``[pad_bs]``
        (fresh random streams), ``top_k`` int32, ``top_p`` and ``min_p`` float32
        ``[pad_bs]`` or None (off for every request).

    Raises
    ------
    ValueError
        An unknown mix (the message lists the known ones).
    """
    _known(mix)
    out: dict[str, np.ndarray | None] = {
        "temperature": rng.choice(_TEMPERATURES, pad_bs).astype(np.float32),
        "top_k": None,
        "top_p": None,
        "min_p": None,
        "seed": rng.integers(-(2**62), 2**62, pad_bs, dtype=np.int64),
        "offset": rng.integers(0, 2**40, pad_bs, dtype=np.int64),
    }

    def full(value: float, dtype: type) -> np.ndarray:
        return np.full(pad_bs, value, dtype)

    if mix == "greedy":
        out["temperature"] = full(0.0, np.float32)
    elif mix in ("topk50", "topk50-topp0.9"):
        out["top_k"] = full(50, np.int32)
        if mix == "topk50-topp0.9":
            out["top_p"] = full(0.9, np.float32)
    elif mix == "minp":
        out["min_p"] = full(0.05, np.float32)
    elif mix == "topp0.9":
        out["top_p"] = full(0.9, np.float32)
    elif mix == "mixed":
        greedy = np.arange(pad_bs) % 2 == 0
        out["temperature"] = np.where(greedy, 0.0, 0.8).astype(np.float32)
        out["top_k"] = np.where(greedy, 1, 50).astype(np.int32)
        out["top_p"] = np.where(greedy, 1.0, 0.9).astype(np.float32)
    return out


def accepting_candidates(tokens: np.ndarray, vocab: int, rng: np.random.Generator) -> np.ndarray:
    """Candidates for the sampled ``tokens`` (int32 ``[pad_bs, N]``, the token each row
    samples): request ``g`` keeps ``k_g`` drafts equal to its tokens at positions
    ``0..k_g-1`` (so they are accepted), then a draft that differs from the token
    sampled before it (rejected), then random ones; ``k_g`` runs through ``0..N-1``
    from a random start, so every accept length ``1..N`` occurs once ``pad_bs >= N``.
    Column 0 (the last accepted token, which the chain does not read) is random.

    Returns
    -------
    int32 ``[pad_bs, N]``, ids in ``[0, vocab)``
    """
    pad_bs, n = tokens.shape
    cand = rng.integers(0, vocab, (pad_bs, n)).astype(np.int32)
    start = int(rng.integers(0, n))
    for g in range(pad_bs):
        keep = (start + g) % n
        cand[g, 1 : keep + 1] = tokens[g, :keep]
        if keep + 1 < n:
            shift = int(rng.integers(1, max(vocab, 2)))
            cand[g, keep + 1] = (int(tokens[g, keep]) + shift) % max(vocab, 1)
    return cand


@dataclass(frozen=True)
class VerifyCase:
    """One batch of ``verify_batch_vocab`` and what every rank must get.

    Attributes
    ----------
    mix : str
    params : dict
        :func:`mix_params` of the batch (NumPy; None = off).
    candidates : int32 ``[pad_bs, N]``
    predict, accept_index : int32 ``[pad_bs, N]``
    accept_length : int32 ``[pad_bs]``
        The reference's outputs for the whole batch (:func:`make_verify_case`).
    record_bytes : int
        Bytes of the record each shard sends per row (:func:`record_bytes`).
    """

    mix: str
    params: dict[str, np.ndarray | None]
    candidates: np.ndarray
    predict: np.ndarray
    accept_index: np.ndarray
    accept_length: np.ndarray
    record_bytes: int

    @property
    def expected(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.predict, self.accept_index, self.accept_length

    def mismatches(self, got: Sequence[np.ndarray], bs: int | None = None) -> list[str]:
        """What differs between ``got`` (predict, accept_index, accept_length as NumPy,
        the whole batch) and the reference, bit for bit, on the real requests
        ``[0, bs)`` (every request when None); empty when nothing does."""
        rows = self.predict.shape[0] if bs is None else bs
        out = []
        names = ("predict", "accept_index", "accept_length")
        for name, g, e in zip(names, got, self.expected, strict=True):
            diff = bits_equal(np.asarray(g)[:rows], e[:rows])
            if diff:
                out.append(f"{name}: {diff}")
        return out


#: Elements of the logits a thread of :func:`reference_tokens` takes at a time.
_REFERENCE_CHUNK_ELEMENTS = 1 << 24


def reference_tokens(
    inputs: Sequence[np.ndarray],
    *,
    tp: int,
    pad_bs: int,
    dtype: str,
    vocab_limit: int | None,
    params: dict[str, np.ndarray | None],
    workers: int | None = None,
) -> np.ndarray:
    """The token :func:`~ipc_dpsample.layout.reference_verify_batch_vocab` samples at
    every row, int32 ``[pad_bs, N]`` (its ``predict`` with candidates that accept
    nothing are the rows' own tokens: sampling does not read the candidates).

    A row's token depends only on its logits and its request's parameters, so large
    batches are cut into chunks of ``tp`` requests or a multiple, which a thread pool
    samples in parallel (NumPy releases the GIL in its array loops): the bench's
    reference of 256 x 4 rows of 152064 columns took 45 to 90 s on one core.
    """
    n = int(np.asarray(inputs[0]).shape[0]) // pad_bs
    row_elems = max(1, n * int(np.asarray(inputs[0]).shape[1]) * tp)
    per = max(tp, (_REFERENCE_CHUNK_ELEMENTS // row_elems) // tp * tp)
    starts = list(range(0, pad_bs, per))

    def run(a: int) -> np.ndarray:
        b = min(pad_bs, a + per)
        part = [np.asarray(x)[a * n : b * n] for x in inputs]
        prm = {k: None if v is None else v[a:b] for k, v in params.items()}
        return reference_verify_batch_vocab(
            part, np.zeros((b - a, n), np.int32), tp=tp, pad_bs=b - a, dtype=dtype,
            vocab_limit=vocab_limit, **prm,
        )[0]  # fmt: skip

    if len(starts) == 1:
        return run(0)
    from concurrent.futures import ThreadPoolExecutor

    if workers is None:
        workers = min(len(starts), max(1, (os.cpu_count() or 1)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return np.concatenate(list(pool.map(run, starts)), axis=0)


def make_verify_case(
    inputs: Sequence[np.ndarray],
    *,
    tp: int,
    pad_bs: int,
    dtype: str,
    mix: str,
    rng: np.random.Generator,
    vocab_limit: int | None = None,
) -> VerifyCase:
    """Parameters of ``mix``, candidates and the expected outputs for every rank's
    ``local_logits`` ``inputs`` (tp arrays ``[pad_bs * N, V / tp]``, bfloat16 as its
    uint16 bits).

    The tokens are :func:`~ipc_dpsample.layout.reference_verify_batch_vocab`'s; the
    candidates follow them (:func:`accepting_candidates`); ``accept_index`` and
    ``accept_length`` are the reference's own last step
    (:func:`~ipc_dpsample.layout.finish_verify`) on those candidates. Sampling does not
    read the candidates, so this is the reference's output for them without a second
    full-row pass.
    """
    n = int(np.asarray(inputs[0]).shape[0]) // pad_bs
    params = mix_params(mix, pad_bs, rng)
    tokens = reference_tokens(
        inputs, tp=tp, pad_bs=pad_bs, dtype=dtype, vocab_limit=vocab_limit, params=params
    )
    vocab = int(np.asarray(inputs[0]).shape[1]) * tp
    limit = vocab if vocab_limit is None else vocab_limit
    cand = accepting_candidates(tokens, limit, rng)
    checked = verify_params(
        pad_bs=pad_bs, num_tokens_per_req=n, vocab_size=vocab, vocab_limit=vocab_limit, **params
    )
    predict, accept_index, accept_length = finish_verify(
        cand, tokens.reshape(-1), checked, tp, None
    )
    words = record_words(*record_caps(checked))
    return VerifyCase(mix, params, cand, predict, accept_index, accept_length, 4 * words)


def record_bytes(
    mix: str,
    pad_bs: int,
    num_tokens: int,
    vocab: int,
    *,
    bs: int | None = None,
    vocab_limit: int | None = None,
    backend: str = "torch",
) -> int:
    """Bytes of the record each shard sends per row in a ``verify_batch_vocab`` call on
    a batch of ``mix`` with ``bs`` real requests.

    ``backend="torch"`` (and ``"auto"``, ``fallback``): the host algorithm's record
    (``verify_shards.record_caps``: the batch's widest mode sets it; 128 B greedy or
    temperature only, 520 B top-k 50, 296 B min-p, 1312 B top-p without top-k; the
    probe round of rows the records leave open, 896 B per open row, not included).
    ``"nccl"``: the GPU kernels' record (``verify_plan.record_words``: 48 B, plus 8 B
    per list entry of the call's largest top-k: 448 B at top-k 50). ``"onesided"``:
    the same with the parameters on the device, as the bench passes them (the list
    holds 128 entries whenever ``top_k`` is given: 1072 B). Both: 0 for a mix those
    kernels refuse (top-p or min-p without top-k: the swap route moves the logits)."""
    params = mix_params(mix, pad_bs, np.random.default_rng(0))  # the filters are fixed per mix
    checked = verify_params(
        pad_bs=pad_bs,
        num_tokens_per_req=num_tokens,
        vocab_size=vocab,
        vocab_limit=vocab_limit,
        bs=bs,
        **params,
    )
    if backend in ("onesided", "nccl"):
        if kernel_path_refusal(checked, 1) is not None:
            return 0
        if backend == "onesided":
            return 4 * kernel_record_words(device_list_cap(params["top_k"] is not None))
        return 4 * kernel_record_words(list_cap(checked))
    return 4 * record_words(*record_caps(checked))


def onesided_broadcasts(
    mix: str, pad_bs: int, num_tokens: int, vocab: int, tp: int, *, max_pad_bs: int | None = None
) -> bool:
    """Whether the one-sided backend broadcasts the records of a ``verify_batch_vocab``
    call on a batch of ``mix`` (every rank combines every request, no gather), as a
    communicator with ``max_pad_bs`` (default ``pad_bs``) decides it under the current
    ``IPC_DPSAMPLE_VERIFY_BROADCAST`` (``verify_plan.verify_broadcast``), the parameters
    on the device as the bench and the demo pass them."""
    from .. import envs
    from ..backends.onesided.contract import ArenaOffsets
    from ..backends.verify_plan import verify_broadcast

    arena = ArenaOffsets(
        tp=tp,
        max_pad_bs=max_pad_bs or pad_bs,
        num_tokens_per_req=num_tokens,
        vocab_size=vocab,
        itemsize=4,  # (the verify region does not depend on it)
    )
    params = mix_params(mix, pad_bs, np.random.default_rng(0))
    return verify_broadcast(
        rows=pad_bs * num_tokens,
        tp=tp,
        cap=device_list_cap(params["top_k"] is not None),
        region_words=arena.verify_region_bytes // 4,
        mode=envs.get("IPC_DPSAMPLE_VERIFY_BROADCAST"),
    )

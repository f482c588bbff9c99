"""Speculative verify for ``spec_decode.py``: the sampler, the acceptance bookkeeping,
and one verifier per route through :class:`ipc_dpsample.DpSamplingComm`.

Routes (``--verify``):

* ``swap`` (TokenSpeed's): ``swap_batch_vocab`` gives the rank its own requests' full
  rows, the rank verifies them (greedy or sampled with :func:`sample_full_rows`),
  ``gather_verify_outputs`` gives every rank the whole batch's results;
* ``argmax``: ``argmax_batch_vocab`` gives the rank the arg-max id of its own rows
  without moving logits (greedy only), then the same bookkeeping and gather;
* ``fused``: ``verify_batch_vocab`` does all of it in the package (when this version
  has it).

Acceptance (TokenSpeed's chain verify, ``runtime/sampling/backends/greedy.py``): draft
``i`` (column ``i`` of ``candidates``) is accepted iff it equals the target's token at
row ``i - 1`` and every earlier draft was accepted; the target's token after the last
accepted draft is the bonus token. Per request, ``predict[j]`` is the target's token at
row ``j``, ``accept_length`` = accepted drafts + 1 (the tokens the request gains), and
``accept_index[j]`` = ``local_req * N + j`` for ``j < accept_length``, else ``-1``:
TokenSpeed's Batch-DP route numbers the rows of the rank that verified the request
(``local_req = req % (pad_bs / tp)``), and so does the package's reference
(``ipc_dpsample.layout.accept_chain``).

Samplers (``--sampler``): ``torch`` is :func:`sample_full_rows` below (torch, on the
device, capturable in a CUDA graph); ``package`` is the package's own torch sampler
(``ipc_dpsample.sampling.sample_rows``, bit for bit the NumPy reference of
``verify_batch_vocab``'s sampling, ``ipc_dpsample.layout.sample_full_rows``: Philox
noise, TokenSpeed's filters), on the rows' device, so that sampled swap runs give
exactly the tokens ``verify_batch_vocab`` gives.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "Clock",
    "Fence",
    "SamplingParams",
    "StepInputs",
    "Verifier",
    "chain_verify",
    "fmix32",
    "gumbel_noise",
    "sample_full_rows",
    "top_k_ids",
]

_M32 = 0xFFFFFFFF


# -- the noise: a deterministic integer hash in torch ---------------------------------
def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in ``[0, 2**32)`` without int64 overflow:
    ``c`` is split into 16-bit halves, every product stays below ``2**48``."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding values in ``[0, 2**32)``:
    ``x ^= x >> 16; x *= 0x85EBCA6B; x ^= x >> 13; x *= 0xC2B2AE35; x ^= x >> 16``
    (multiplications mod ``2**32``). Bit-exact on every device."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def row_key(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """32-bit key of (seed, position), int64 ``[rows]`` each:
    ``fmix32(fmix32(fmix32(lo32(seed) ^ 0x9E3779B9) ^ hi32(seed)) ^ lo32(position))``."""
    k = fmix32((seed & _M32) ^ 0x9E3779B9)
    k = fmix32(k ^ ((seed >> 32) & _M32))
    return fmix32(k ^ (position & _M32))


def gumbel_noise(
    seed: torch.Tensor, position: torch.Tensor, token_ids: torch.Tensor
) -> torch.Tensor:
    """Gumbel(0, 1) noise, float64, for global token ids ``token_ids``: int64 ``[V]``
    (the same ids for every row) or ``[rows, k]``; returns ``[rows, V]`` or ``[rows, k]``.

    Element ``(r, t)`` depends only on ``(seed[r], position[r], t)``: ``h =
    fmix32(row_key(seed, position) ^ fmix32(t))``, ``u = (h + 0.5) / 2**32`` (in
    ``(0, 1)``, exact in float64), noise ``= -log(-log(u))`` in float64. So a row's
    noise is the same however the vocabulary is split and whatever batch it is in.
    """
    key = row_key(seed, position)[:, None]
    ids = token_ids[None, :] if token_ids.dim() == 1 else token_ids
    u = (fmix32(key ^ fmix32(ids)).to(torch.float64) + 0.5) * (2.0**-32)
    return -torch.log(-torch.log(u))


# -- the full-row sampler ----------------------------------------------------------------
@dataclass(frozen=True)
class SamplingParams:
    """Sampled verify: the same for every request here (an engine has them per request).

    ``temperature > 0``; ``top_k`` None or ``>= 1``; ``top_p`` None or in ``(0, 1]``.
    """

    temperature: float
    top_k: int | None = None
    top_p: float | None = None


def top_k_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` best ids of every row under the total order (value descending, id
    ascending), in that order: int64 ``[rows, k]``.

    One ``topk`` over a tie-free int64 key: the float32 value's bits mapped to an
    order-preserving signed integer, times ``2**20``, plus ``2**20 - 1 - id``
    (``V < 2**20``). Faster than a stable sort of the row, and exact on ties. The
    order of ``value / T`` in float64 is that of the float32 value (``T > 0``), so this
    is the top-k of the scaled row too.
    """
    vocab = logits.shape[-1]
    if vocab >= 1 << 20:
        raise ValueError(f"vocabulary {vocab} too large for the 20-bit id field")
    bits = (logits.to(torch.float32) + 0.0).view(torch.int32)  # -0.0 -> +0.0 first
    key = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # monotone in the value
    tie = (1 << 20) - 1 - torch.arange(vocab, device=logits.device)
    return torch.topk(key.to(torch.int64) * (1 << 20) + tie, k, dim=-1).indices


def sample_full_rows(
    logits: torch.Tensor,
    *,
    temperature: torch.Tensor,
    seed: torch.Tensor,
    position: torch.Tensor,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """One token per full row: greedy where ``temperature == 0``, else Gumbel-max.

    The one place the example samples, so that the package's own sampler can replace
    it. Semantics (TokenSpeed's FlashInfer order): scale by ``1 / temperature``; keep
    the ``top_k`` best ids under the total order (value descending, id ascending);
    renormalise and keep the smallest prefix of that order whose mass reaches
    ``top_p`` (an id is kept when the mass before it is below ``top_p``); then the
    arg-max over the kept ids of ``logit / T + gumbel_noise(seed, position, id)``
    Computed in float64, so that the result does not hang on the
    last bits of a reduction; capturable in a CUDA graph (no host sync).

    Parameters
    ----------
    logits : ``[rows, V_real]``, any float dtype
        Full rows, trimmed to the real vocabulary (column = global token id).
    temperature : float32 ``[rows]``
    seed, position : int64 ``[rows]``
        The noise key of each row: the request's seed and the index of the token
        being sampled among the request's generated tokens.
    top_k, top_p : optional, the same for every row

    Returns
    -------
    int64 ``[rows]``
    """
    greedy = torch.argmax(logits, dim=-1)
    t = temperature.to(torch.float64).clamp_min(1e-6)[:, None]
    ids: torch.Tensor | None = None  # None: every column, in id order
    if top_k is not None and top_k < logits.shape[-1]:
        ids = top_k_ids(logits, top_k)
        s = logits.gather(-1, ids).to(torch.float64) / t
    else:
        s = logits.to(torch.float64) / t
    if top_p is not None and top_p < 1.0:
        p = torch.softmax(s, dim=-1)
        if ids is None:
            sorted_p, order = torch.sort(p, dim=-1, descending=True, stable=True)
            keep_sorted = (torch.cumsum(sorted_p, dim=-1) - sorted_p) < top_p
            keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
        else:
            keep = (torch.cumsum(p, dim=-1) - p) < top_p  # already in that order
        s = s.masked_fill(~keep, float("-inf"))
    if ids is None:
        every = torch.arange(s.shape[-1], device=s.device)
        sampled = torch.argmax(s + gumbel_noise(seed, position, every), dim=-1)
    else:
        best = torch.argmax(s + gumbel_noise(seed, position, ids), dim=-1, keepdim=True)
        sampled = ids.gather(-1, best)[:, 0]
    return torch.where(temperature > 0, sampled, greedy)


# -- acceptance bookkeeping ------------------------------------------------------------
def chain_verify(
    candidates: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chain acceptance of a rank's ``R`` requests (see the module docstring).

    Parameters
    ----------
    candidates : int ``[R, N]``
        Column 0: the request's last accepted token; columns ``1..N-1``: its drafts.
    target : int ``[R, N]``
        The target's token (arg-max or sampled) at every row.

    Returns
    -------
    (predict int32 ``[R, N]``, accept_index int32 ``[R, N]``, accept_length int32 ``[R]``)
        ``accept_index`` numbers these ``R * N`` rows (TokenSpeed's Batch-DP route).
    """
    r, n = target.shape
    match = (candidates[:, 1:].to(torch.int64) == target[:, :-1].to(torch.int64)).to(torch.int32)
    accepted = torch.cumprod(match, dim=1).sum(dim=1)  # [R]: the leading run of matches
    col = torch.arange(n, device=target.device)[None, :]
    flat = torch.arange(r, device=target.device)[:, None] * n + col
    accept_index = torch.where(col <= accepted[:, None], flat, torch.full_like(flat, -1))
    return (
        target.to(torch.int32),
        accept_index.to(torch.int32),
        (accepted + 1).to(torch.int32),
    )


# -- timing and host ordering ------------------------------------------------------------
class Clock:
    """Wall time per section; on CUDA a section ends with a stream synchronisation so
    that its GPU work is counted in it (which costs a little throughput)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.enabled = True
        self.totals: dict[str, float] = defaultdict(float)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.current_stream().synchronize()

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        t = time.perf_counter()
        yield
        self.sync()
        self.totals[name] += time.perf_counter() - t


class Fence:
    """Host ordering around each collective op when rank *threads* share one GPU
    (:func:`ipc_dpsample.testing.run_threads`' rules): synchronise this rank's stream
    and wait for every rank before issuing an op (no rank allocates or copies while a
    peer's op is in flight), and wait again after issuing it (every rank issued the
    op before any rank blocks on its result). A no-op for processes and on the CPU."""

    def __init__(self, group: Any, device: torch.device, timeout_s: float):
        from ipc_dpsample import ThreadGroup

        self.group = group if isinstance(group, ThreadGroup) and device.type == "cuda" else None
        self.timeout_s = timeout_s
        self.enabled = True

    @property
    def active(self) -> bool:
        return self.group is not None and self.enabled

    def before(self, what: str) -> None:
        if self.active:
            torch.cuda.current_stream().synchronize()
            self.group.barrier(timeout_s=self.timeout_s, what=f"before {what}")

    def after(self, what: str) -> None:
        if self.active:
            self.group.barrier(timeout_s=self.timeout_s, what=f"after {what}")


# -- the verifiers -----------------------------------------------------------------------
@dataclass
class StepInputs:
    """What one verify step reads (static buffers when it is a CUDA graph).

    ``local_logits [pad_bs*N, V/tp]``; ``candidates`` int32 ``[pad_bs, N]``; per request
    ``temperature`` float32, ``seed`` and ``offset`` int64 ``[pad_bs]`` (offset: tokens
    the request generated so far, so row ``j`` samples its token number ``offset + j``);
    ``bs``: the real requests, a host int or an int32 device scalar.
    """

    local_logits: torch.Tensor
    candidates: torch.Tensor
    temperature: torch.Tensor
    seed: torch.Tensor
    offset: torch.Tensor
    bs: int | torch.Tensor


VerifyOut = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class Verifier:
    """One verify route: ``run(inputs, pad_bs)`` -> the whole batch's ``(predict [pad_bs,
    N], accept_index [pad_bs, N], accept_length [pad_bs])`` on every rank (rows of
    requests ``>= bs`` undefined).

    Parameters
    ----------
    route : ``"swap"``, ``"argmax"``, ``"fused"`` or ``"local"`` (tp=1, no
        communicator: the plain-decoding reference)
    comm : DpSamplingComm or None
    tp, rank, n, vocab_size, vocab_limit : int
    sampling : SamplingParams or None (greedy)
    sampler : ``"torch"`` or ``"package"`` (see the module docstring)
    clock : Clock
    fence : Fence
    """

    def __init__(
        self,
        route: str,
        comm: Any,
        *,
        tp: int,
        rank: int,
        n: int,
        vocab_size: int,
        vocab_limit: int,
        sampling: SamplingParams | None,
        clock: Clock,
        fence: Fence,
        sampler: str = "torch",
    ) -> None:
        if route == "argmax" and sampling is not None:
            raise ValueError("the argmax route is greedy only (argmax_batch_vocab)")
        if route == "fused" and not hasattr(comm, "verify_batch_vocab"):
            raise ValueError("this ipc_dpsample has no DpSamplingComm.verify_batch_vocab")
        self.route, self.comm = route, comm
        if sampler not in ("torch", "package"):
            raise ValueError(f"sampler={sampler!r}; expected 'torch' or 'package'")
        self.tp, self.rank, self.n = tp, rank, n
        self.vocab_size, self.vocab_limit = vocab_size, vocab_limit
        self.sampling, self.clock, self.fence, self.sampler = sampling, clock, fence, sampler
        self._top_k: dict[int, torch.Tensor] = {}
        self._top_p: dict[int, torch.Tensor] = {}

    def _op(self, name: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """A collective op of the communicator: fenced and timed as communication."""
        with self.clock.section("verify_comm"):
            self.fence.before(name)
            out = fn(*args, **kw)
            self.fence.after(name)
        return out

    def _target(self, rows: torch.Tensor, x: StepInputs, req0: int, reqs: int) -> torch.Tensor:
        """The target's token of every full row of requests ``req0 .. req0+reqs-1``."""
        if self.sampling is None:
            return torch.argmax(rows, dim=-1)
        if self.sampler == "package":
            return self._target_package(rows, x, req0, reqs)
        sl, n = slice(req0, req0 + reqs), self.n

        def per_row(t: torch.Tensor) -> torch.Tensor:  # [reqs] -> [reqs * N]
            return t[sl, None].expand(-1, n).reshape(-1)

        position = x.offset[sl, None] + torch.arange(n, device=rows.device)[None, :]
        return sample_full_rows(
            rows,
            temperature=per_row(x.temperature),
            seed=per_row(x.seed),
            position=position.reshape(-1),
            top_k=self.sampling.top_k,
            top_p=self.sampling.top_p,
        )

    def _target_package(
        self, rows: torch.Tensor, x: StepInputs, req0: int, reqs: int
    ) -> torch.Tensor:
        """The package's own full-row sampler (``ipc_dpsample.sampling``, torch, on the
        rows' device): the tokens ``verify_batch_vocab`` gives for these rows, bit for
        bit (the same contract as ``ipc_dpsample.layout.sample_full_rows``)."""
        from ipc_dpsample import sampling

        s, n = self.sampling, self.n
        assert s is not None
        pad_bs, dev = x.temperature.shape[0], x.temperature.device

        def full(value: float | int | None, dtype: torch.dtype) -> torch.Tensor | None:
            return None if value is None else torch.full((pad_bs,), value, dtype=dtype, device=dev)

        rp = sampling.row_params(
            temperature=x.temperature.to(torch.float32),
            seed=x.seed.to(torch.int64),
            offset=x.offset.to(torch.int64),
            num_tokens_per_req=n,
            vocab_limit=self.vocab_limit,
            top_k=full(s.top_k, torch.int32),
            top_p=full(s.top_p, torch.float32),
            check=False,  # the example's own flags were checked at start-up
        )
        sl = slice(req0 * n, (req0 + reqs) * n)
        tok = sampling.sample_rows(
            rows, vocab_limit=self.vocab_limit, **{k: v[sl] for k, v in rp._asdict().items()}
        )
        return tok.to(torch.int64)

    def run(self, x: StepInputs, pad_bs: int) -> VerifyOut:
        r = pad_bs // self.tp
        req0 = self.rank * r  # this rank's first request
        comm, n = self.comm, self.n
        if self.route == "local":
            with self.clock.section("verify_math"):
                rows = x.local_logits[:, : self.vocab_limit]
                target = self._target(rows, x, 0, pad_bs).view(pad_bs, n)
                return chain_verify(x.candidates, target)
        if self.route == "fused":
            return self._fused(x, pad_bs)
        if self.route == "swap":
            full = self._op("swap", comm.swap_batch_vocab, x.local_logits, pad_bs=pad_bs, bs=x.bs)
            with self.clock.section("verify_math"):
                rows = full[:, : self.vocab_limit]  # trim the padded vocabulary
                target = self._target(rows, x, req0, r).view(r, n)
        else:  # argmax: each rank reduces its shard; a few bytes per row move
            ids, _ = self._op(
                "argmax",
                comm.argmax_batch_vocab,
                x.local_logits,
                pad_bs=pad_bs,
                vocab_limit=self.vocab_limit,
                bs=x.bs,
            )
            target = ids.view(r, n)
        with self.clock.section("verify_math"):
            p, a, length = chain_verify(x.candidates[req0 : req0 + r], target)
        return self._op("gather", comm.gather_verify_outputs, p, a, length, pad_bs=pad_bs, bs=x.bs)

    def _fused(self, x: StepInputs, pad_bs: int) -> VerifyOut:
        s = self.sampling
        top_k = top_p = None
        if s is not None and s.top_k is not None:
            top_k = self._top_k.get(pad_bs)
            if top_k is None:
                top_k = torch.full((pad_bs,), s.top_k, dtype=torch.int32, device=x.seed.device)
                self._top_k[pad_bs] = top_k
        if s is not None and s.top_p is not None:
            top_p = self._top_p.get(pad_bs)
            if top_p is None:
                top_p = torch.full((pad_bs,), s.top_p, dtype=torch.float32, device=x.seed.device)
                self._top_p[pad_bs] = top_p
        prm = {"temperature": x.temperature, "top_k": top_k, "top_p": top_p}
        prm.update(seed=x.seed, offset=x.offset)
        if top_p is not None and top_k is None:
            # top-p without top-k: the GPU kernels need the row's whole key order for it;
            # host parameters let the backend take its swap route (not capturable)
            prm = {k: None if v is None else v.cpu() for k, v in prm.items()}
        return self._op(
            "verify",
            self.comm.verify_batch_vocab,
            x.local_logits,
            x.candidates,
            pad_bs=pad_bs,
            **prm,
            vocab_limit=self.vocab_limit,
            bs=x.bs,
        )

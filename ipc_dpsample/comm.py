"""The public communicator: validate, build a backend once (one rendezvous), dispatch."""

from __future__ import annotations

import numbers
import warnings
from typing import Any

from . import envs
from .arrays import ArrayInfo, normalize_dtype
from .backends.base import Backend
from .config import BackendName, CommConfig, PeerRecord
from .errors import DpSampleError
from .group import HostGroup, resolve_group
from .identity import check_device_usable, resolve_device
from .protocol import LOGITS_DTYPES
from .rendezvous import build_backend
from .validate import ArgChecker, DtypeMismatchError

__all__ = ["DpSamplingComm", "DtypeMismatchError"]

ENV_BACKEND = "IPC_DPSAMPLE_BACKEND"
ENV_BACKEND_ALIAS = "TOKENSPEED_DP_SAMPLING_BACKEND"


def requested_backend(backend: str) -> str:
    """``backend`` unless ``IPC_DPSAMPLE_BACKEND`` (or its TokenSpeed alias, which it
    beats) is set; an invalid value raises ``ValueError`` naming the variable."""
    for name in (ENV_BACKEND, ENV_BACKEND_ALIAS):
        value = envs.get(name)
        if value is not None:
            return str(value)
    return backend


class DpSamplingComm:
    """Batch-DP speculative-verify communicator for one tensor-parallel group.

    Collective: every rank of the group constructs it with the same arguments
    (except ``rank``), calls the same ops in the same order with the same
    ``pad_bs`` and ``bs``, and closes it.

    Parameters
    ----------
    tp_size : int
        Number of ranks (must equal the group's size).
    rank : int
        This rank's index in the group, ``0 <= rank < tp_size``.
    group : None, torch ProcessGroup, tuple of int, or HostGroup
        None: the torch.distributed world; a tuple: those global ranks; a
        :class:`~ipc_dpsample.group.ThreadGroup`: ranks that are threads of this
        process.
    max_pad_bs : int
        Largest padded batch; a multiple of ``tp_size``.
    num_tokens_per_req : int
        ``N`` rows per request (draft tokens + 1), ``>= 1``.
    vocab_size : int
        ``V``, the padded communication vocabulary; a multiple of ``tp_size``.
    logits_dtype : dtype or str or None
        ``bfloat16``, ``float16`` or ``float32`` (torch, NumPy or CuPy dtype, or
        name); None: the first :meth:`swap_batch_vocab` (or
        :meth:`prepare_verify_outputs`) fixes it (buffers are sized for 4-byte
        elements).
    backend : {"auto", "onesided", "nccl", "torch"}
        ``IPC_DPSAMPLE_BACKEND`` (or ``TOKENSPEED_DP_SAMPLING_BACKEND``) overrides it.
    device : None, "cpu", "cuda:k", int or torch.device
        None: the current CUDA device if there is one, else the CPU.
    timeout_s : float
        Longest wait for a peer, on the host and inside kernels (set-up waits at
        least 10 s on the CPU, 30 s on a GPU).
    fallback_comm_backend : object or None
        TokenSpeed's ``CommBackend`` shape: ``all_gather_into_tensor(output, input,
        group)`` and ``all_to_all_single(output, input, group)``. When given, the
        non-one-sided path moves its data through it.

    Raises
    ------
    ValueError, TypeError
        Inconsistent arguments (the message names the expected value).
    ConfigMismatchError
        Ranks passed different configurations (raised on every rank).
    BackendUnavailableError
        An explicitly requested backend cannot run here.
    """

    def __init__(
        self,
        *,
        tp_size: int,
        rank: int,
        group: Any = None,
        max_pad_bs: int,
        num_tokens_per_req: int,
        vocab_size: int,
        logits_dtype: Any = None,
        backend: str = "auto",
        device: Any = None,
        timeout_s: float = 30.0,
        fallback_comm_backend: Any = None,
    ) -> None:
        self._backend: Backend | None = None
        self._closed = False
        self._fallback = fallback_comm_backend
        self._group_arg = group
        self._group: HostGroup = resolve_group(group)
        raw = dict(
            tp_size=tp_size,
            rank=rank,
            max_pad_bs=max_pad_bs,
            num_tokens_per_req=num_tokens_per_req,
            vocab_size=vocab_size,
        )
        # Validate locally, but always take part in the rendezvous: a rank with a bad
        # argument must not leave its peers waiting for it.
        local_error: Exception | None = None
        self._device = -1
        try:
            if isinstance(tp_size, int) and not isinstance(tp_size, bool):
                if self._group.size != tp_size:  # checked first: the clearest message
                    raise ValueError(f"tp_size={tp_size} != the group's size {self._group.size}")
            backend = requested_backend(backend)
            dtype = None if logits_dtype is None else normalize_dtype(logits_dtype)
            self.config = CommConfig(
                logits_dtype=dtype,
                backend=backend,  # type: ignore[arg-type]
                timeout_s=timeout_s,
                **raw,
            )
            self._device = resolve_device(device)
            check_device_usable(self._device)
            if self._group.rank != rank:
                raise ValueError(
                    f"rank={rank} != this process's rank {self._group.rank} in the group"
                )
        except (ValueError, TypeError) as exc:
            local_error = exc
            self.config = None  # type: ignore[assignment]
        built = build_backend(
            self.config, self._group, self._device, raw, local_error, self._make_backend
        )
        self._records: list[PeerRecord] = built.records
        self._backend_name, self._reason, self._backend = built.name, built.reason, built.backend
        if fallback_comm_backend is not None and built.name != "onesided":
            self._backend_name = "torch"
            self._reason += "; the data moves through fallback_comm_backend"
        # the torch path over NCCL (or an engine's fallback on CUDA) reports "nccl"
        over_nccl = getattr(built.backend, "transport", "") == "nccl" or (
            fallback_comm_backend is not None and self._device >= 0
        )
        self._public_name: BackendName = (
            "nccl" if self._backend_name == "torch" and over_nccl else self._backend_name
        )
        self._logits_dtype = self.config.logits_dtype
        self._check = ArgChecker(self.config, self._device)

    def _make_backend(self, name: BackendName, records: list[PeerRecord]) -> Backend:
        if self._fallback is not None:  # TokenSpeed: the non-one-sided path uses it
            import torch

            from .backends.fallback import CollectivesBackend

            dev = torch.device("cpu") if self._device < 0 else torch.device("cuda", self._device)
            backend = CollectivesBackend(self.config, self._fallback, self._group_arg, dev)
            if self.config.logits_dtype is not None:
                backend.prepare(self.config.logits_dtype)
            return backend
        if name == "torch":
            import torch

            from .backends.torch import TorchBackend
            from .select import gpu_sharing_ranks

            dev = torch.device("cpu") if self._device < 0 else torch.device("cuda", self._device)
            shared = self._device >= 0 and gpu_sharing_ranks(records) > 0
            return TorchBackend(self.config, self._group, dev, shared)  # type: ignore[arg-type]
        if name == "nccl":
            from .backends.nccl import NcclBackend

            return NcclBackend(self.config, self._group, self._device)
        raise DpSampleError(f"backend {name!r} is not constructed here")

    # -- properties ---------------------------------------------------------------
    @property
    def backend(self) -> BackendName:
        """What moves the data: ``"onesided"``, ``"nccl"`` (the torch.distributed
        path over an NCCL group counts as ``"nccl"``, as in TokenSpeed) or
        ``"torch"`` (torch.distributed over gloo: CPU data, or CUDA data of ranks
        sharing a GPU, which NCCL refuses); :meth:`explain` names the exact path."""
        return self._public_name

    @property
    def fast_path_enabled(self) -> bool:
        """True when the one-sided CUDA IPC kernels move the data."""
        return self._backend_name == "onesided"

    @property
    def max_pad_bs(self) -> int:
        return self.config.max_pad_bs

    @property
    def is_initialized(self) -> bool:
        """TokenSpeed's meaning: True once the one-sided (fast-path) state exists
        (engines guard re-configuration on it). See :attr:`is_open`."""
        return self.fast_path_enabled and self.is_open

    @property
    def is_open(self) -> bool:
        """True between construction and :meth:`close`."""
        return self._backend is not None and not self._closed

    @property
    def device(self) -> str:
        """``"cpu"`` or ``"cuda:k"``."""
        return "cpu" if self._device < 0 else f"cuda:{self._device}"

    @property
    def logits_dtype(self) -> str | None:
        """The swap's dtype, once fixed (constructor, prepare or first swap)."""
        return self._logits_dtype

    def explain(self) -> str:
        """Why this backend was chosen (one sentence)."""
        return f"{self._backend_name}: {self._reason}"

    # -- ops ----------------------------------------------------------------------
    def prepare_verify_outputs(self, logits_dtype: Any) -> None:
        """Fix the logits dtype if nothing fixed it yet (the first dtype wins: a later
        call, or one after a swap, is a no-op). The fast path is set up at
        construction, so a gather-only communicator needs no swap.

        Parameters
        ----------
        logits_dtype : dtype or str
            ``bfloat16``, ``float16`` or ``float32``.

        Raises
        ------
        TypeError
            Unsupported dtype.
        """
        self._check_open()
        name = normalize_dtype(logits_dtype)
        if name not in LOGITS_DTYPES:
            raise TypeError(f"logits_dtype={name!r}; expected one of {LOGITS_DTYPES}")
        if self._logits_dtype is None:
            self._fix_dtype(name)

    def _fix_dtype(self, name: str) -> None:
        assert self._backend is not None
        self._backend.prepare(name)
        self._logits_dtype = name

    def swap_batch_vocab(
        self, local_logits: Any, *, pad_bs: int, bs: Any = None, stream: Any = None
    ) -> Any:
        """All-to-all from vocabulary shards to request shards.

        Parameters
        ----------
        local_logits : array ``[pad_bs * N, V / tp]``, ``logits_dtype``, C-contiguous
            This rank's vocabulary shard of the whole padded batch, on this
            communicator's device. With ``logits_dtype=None`` its dtype fixes it.
        pad_bs : int
            Padded batch size of this step, ``0 < pad_bs <= max_pad_bs``, a multiple
            of ``tp``; the same on every rank.
        bs : None, int, or int32 scalar / 1-element array on this device
            The real requests, the prefix ``[0, bs)`` of the padded batch,
            ``0 <= bs <= pad_bs``; None: every request. Rows of the others are not
            moved (the one-sided backend neither reads nor writes them). A device
            scalar is read when the op runs (values outside ``[0, pad_bs]`` are
            clamped), so one captured CUDA graph serves every ``bs`` of its bucket;
            a host int captured into a graph is fixed in it.
        stream : None, torch/CuPy stream, ``__cuda_stream__`` object or int
            None: the current stream of the input's framework. On CPU data only
            None; any other value (a str, a negative int...) raises ``TypeError``.

        Returns
        -------
        array ``[pad_bs / tp * N, V]``, ``logits_dtype``, same array type as the input
            Row ``local_req * N + d`` is global request ``rank * pad_bs/tp + local_req``
            at draft position ``d``; columns ``[s*V/tp, (s+1)*V/tp)`` came from rank
            ``s``. Rows of requests ``>= bs`` are undefined. A view of a persistent
            buffer, valid until the next op on this communicator is issued.
        """
        self._check_open()
        cfg = self.config
        pad_bs = cfg.validate_pad_bs(pad_bs)
        expected = (pad_bs * cfg.num_tokens_per_req, cfg.vocab_size // cfg.tp_size)
        info = self._logits_arg(local_logits, expected)
        rows = self._check.bs(bs, pad_bs)
        assert self._backend is not None
        return self._backend.swap_batch_vocab(
            local_logits, info, pad_bs=pad_bs, bs=rows, stream=stream
        )

    def argmax_batch_vocab(
        self,
        local_logits: Any,
        *,
        pad_bs: int,
        vocab_limit: int | None = None,
        bs: Any = None,
        stream: Any = None,
    ) -> tuple[Any, Any]:
        """Greedy verify without moving logits: the arg-max token of every full row.

        Parameters
        ----------
        local_logits : array ``[pad_bs * N, V / tp]``, ``logits_dtype``, C-contiguous
            The input :meth:`swap_batch_vocab` takes.
        pad_bs : int
        vocab_limit : int or None
            The model's real vocabulary ``<= V``: columns ``>= vocab_limit`` (the
            padded tail) never win and do not count in the softmax (None: ``V``).
        bs : see :meth:`swap_batch_vocab`
        stream : see :meth:`swap_batch_vocab`

        Returns
        -------
        (token_ids int32 ``[R * N]``, logprobs float32 ``[R * N]``), ``R = pad_bs / tp``
            For this rank's requests, in :meth:`swap_batch_vocab`'s row order: the
            first index of the row's maximum (a NaN wins, first NaN first; an all
            ``-inf`` row gives 0: ``torch.argmax`` semantics), and the token's
            log-softmax value computed in float32 (NaN when the row holds a NaN,
            ``+inf`` or only ``-inf``). Rows of requests ``>= bs`` are undefined.
            Views of persistent buffers in the input's array type.
        """
        self._check_open()
        cfg = self.config
        pad_bs = cfg.validate_pad_bs(pad_bs)
        expected = (pad_bs * cfg.num_tokens_per_req, cfg.vocab_size // cfg.tp_size)
        info = self._logits_arg(local_logits, expected)
        limit = cfg.vocab_size if vocab_limit is None else vocab_limit
        if isinstance(limit, bool) or not isinstance(limit, numbers.Integral):
            raise TypeError(f"vocab_limit must be an int or None, got {vocab_limit!r}")
        if not 1 <= limit <= cfg.vocab_size:
            raise ValueError(
                f"vocab_limit={limit} out of range: expected 1 <= vocab_limit <= "
                f"vocab_size={cfg.vocab_size}"
            )
        rows = self._check.bs(bs, pad_bs)
        assert self._backend is not None
        return self._backend.argmax_batch_vocab(
            local_logits, info, pad_bs=pad_bs, vocab_limit=int(limit), bs=rows, stream=stream
        )

    def verify_batch_vocab(
        self,
        local_logits: Any,
        candidates: Any,
        *,
        pad_bs: int,
        temperature: Any,
        top_k: Any = None,
        top_p: Any = None,
        min_p: Any = None,
        seed: Any,
        offset: Any,
        vocab_limit: int | None = None,
        bs: Any = None,
        return_logprobs: bool = False,
        stream: Any = None,
    ) -> tuple[Any, ...]:
        """Sampled speculative verify without moving logits: every rank gives its
        vocabulary shard of every row and gets the whole batch's verify results.

        Each row is sampled with Gumbel-max (TokenSpeed's Triton noise stream, its
        top-k / top-p / min-p filters; temperature below 1e-6 or top-k 1 is greedy,
        the :meth:`argmax_batch_vocab` token), then drafts are accepted by "sample,
        then match". The spec, bit for bit, is
        :func:`ipc_dpsample.layout.reference_verify_batch_vocab`;
        ``docs/verify_contract.md`` has the noise, the filters, the degenerate rows
        (NaN, ``±inf``) and how the shards compute it exactly.

        Parameters
        ----------
        local_logits : array ``[pad_bs * N, V / tp]``, ``logits_dtype``, C-contiguous
            The input :meth:`swap_batch_vocab` takes: row ``req * N + d`` is request
            ``req`` at draft position ``d``, this rank's columns ``[rank*V/tp,
            (rank+1)*V/tp)``.
        candidates : int32 array ``[pad_bs, N]``, C-contiguous, on this device
            Column 0 the last accepted token, columns ``1..N-1`` the drafts.
        pad_bs : int
            As :meth:`swap_batch_vocab`.
        temperature : float32 array ``[pad_bs]``
            Finite, ``>= 0``; ``< 1e-6`` means greedy for that request.
        top_k : int32 array ``[pad_bs]`` or None
            ``1..128`` on; ``0``, ``1 << 30`` or any value ``>= vocab_limit`` off;
            ``129..vocab_limit-1`` raise. None: off for every request.
        top_p : float32 array ``[pad_bs]`` or None
            In ``(0, 1]``, 1 = off. None: off.
        min_p : float32 array ``[pad_bs]`` or None
            In ``[0, 1)``, 0 = off. None: off.
        seed, offset : int64 arrays ``[pad_bs]``
            The noise stream of each request (draft position ``d`` draws from
            ``offset + d``).
        vocab_limit : int or None
            Columns ``>= vocab_limit`` never win and count in no mass (None: ``V``);
            ``1 <= vocab_limit <= min(V, 2**21)``.
        bs : see :meth:`swap_batch_vocab`
            Requests ``>= bs`` are padding: their parameters are neither checked nor
            used. A device scalar is read when the op runs (clamped to
            ``[0, pad_bs]``).
        return_logprobs : bool
            Also return ``log_softmax(raw logits[:vocab_limit])[predict]`` (no
            temperature), float32.
        stream : see :meth:`swap_batch_vocab`

        The parameter arrays may be host arrays (NumPy, CPU torch tensors) or arrays
        on this communicator's device (CUDA torch tensors, CuPy) of exactly that dtype
        and shape (see below for when device arrays are read on the host).

        Returns
        -------
        predict : int32 ``[pad_bs, N]``
            The token sampled at every row (also after the accepted drafts).
        accept_index : int32 ``[pad_bs, N]``
            ``(g % R) * N + j`` for the accepted positions ``j < accept_length[g]``,
            ``-1`` after them, ``R = pad_bs / tp``: rows of the owning rank's swap
            output (TokenSpeed's Batch-DP numbering).
        accept_length : int32 ``[pad_bs]``
            Accepted drafts + 1.
        logprobs : float32 ``[pad_bs, N]``, only with ``return_logprobs``
            Within 1 float32 ulp of the reference (NaN for rows with a NaN, ``+inf``
            or only ``-inf``).

        Every rank gets the same values for the whole batch. Rows of requests
        ``>= bs`` are undefined. Views of persistent buffers in ``local_logits``'
        array type, valid until the next op on this communicator is issued.

        Backends: ``onesided`` runs CUDA kernels (``kernels/verify.cuh``): each rank
        reduces each real row of its shard to a record (48 bytes, plus 8 bytes per
        list entry when the batch has top-k rows: the largest top-k of the call) and
        pushes it into the row owner's arena; the owner combines its rows and runs the
        accept chain, and the results are all-gathered (two launches, then the gather
        kernels). It decides greedy, temperature-only and top-k rows (with top-p and
        min-p) this way; a batch with a request that has top-p or min-p but no top-k
        takes the backend's swap, the package's torch sampler
        (:func:`ipc_dpsample.sampling.verify_rows`) on the rank's rows, and the
        gathers instead: the same results, moving the logits. ``nccl`` runs the same
        kernels around one NCCL group that moves each owner's records (host parameters
        only; the same swap route). ``torch`` runs the
        sharded algorithm (:mod:`ipc_dpsample.verify_shards`) with NumPy on the host
        and moves 128..1312 bytes per row per peer in one all-gather (a probe round and
        a full-row round only for rows the records leave open); it is the portable
        path, not the fast one: CUDA inputs are copied to the host and the results
        back. Through ``fallback_comm_backend`` the same algorithm runs, one
        ``all_gather_into_tensor`` per round.

        On ``onesided``, when every parameter array is on this communicator's device,
        nothing is read on the host: the kernels read the values when they run, check
        their ranges there (a refused value, or top-p / min-p without top-k, raises
        :class:`~ipc_dpsample.errors.DpSampleError` at the next call or :meth:`check`)
        and the call can be captured in a CUDA graph. Otherwise the parameters are
        read and validated on the host and the call cannot be captured.

        Raises
        ------
        ValueError, TypeError
            A wrong shape, dtype, device or value (the message names the argument
            and the expected value), before anything is exchanged.
        DpSampleError
            Ranks called different ops, or passed a different ``pad_bs``, ``bs``,
            dtype, ``candidates``, per-request parameter, ``vocab_limit`` or
            ``return_logprobs``: raised on every rank, naming what differed; the
            communicator is then unusable (every later call raises it again).
        BackendUnavailableError
            The backend cannot run this op (see Backends).
        DpSampleError
            On ``onesided``: called while the stream is being captured into a CUDA
            graph; ranks that passed different parameters or candidates (raised at the
            next call or :meth:`check` on the ranks owning the rows concerned; the
            others time out waiting for them).
        """
        self._check_open()
        cfg = self.config
        pad_bs = cfg.validate_pad_bs(pad_bs)
        expected = (pad_bs * cfg.num_tokens_per_req, cfg.vocab_size // cfg.tp_size)
        info = self._logits_arg(local_logits, expected)
        cand, params, rows = self._check.verify(
            candidates,
            pad_bs=pad_bs,
            vocab_limit=vocab_limit,
            bs=bs,
            return_logprobs=return_logprobs,
            device_params=self._backend is not None and self._backend.device_verify_params,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seed=seed,
            offset=offset,
        )
        assert self._backend is not None
        return self._backend.verify_batch_vocab(
            local_logits,
            info,
            candidates,
            cand,
            pad_bs=pad_bs,
            params=params,
            return_logprobs=return_logprobs,
            bs=rows,
            stream=stream,
        )

    def gather_verify_outputs(
        self,
        predict_local: Any,
        accept_index_local: Any,
        accept_length_local: Any,
        *,
        pad_bs: int,
        bs: Any = None,
        stream: Any = None,
    ) -> tuple[Any, Any, Any]:
        """All-gather the verify results of every rank's requests.

        Parameters
        ----------
        predict_local, accept_index_local : int32 arrays ``[pad_bs / tp, N]``
        accept_length_local : int32 array ``[pad_bs / tp]``
            All of one array type, C-contiguous, on this communicator's device.
        pad_bs : int
        bs : see :meth:`swap_batch_vocab`
        stream : see :meth:`swap_batch_vocab`

        Returns
        -------
        (predict ``[pad_bs, N]``, accept_index ``[pad_bs, N]``, accept_length ``[pad_bs]``)
            int32; row ``src * pad_bs/tp + i`` is row ``i`` of rank ``src``; rows
            ``>= bs`` are undefined. Views of persistent buffers.
        """
        self._check_open()
        cfg = self.config
        pad_bs = cfg.validate_pad_bs(pad_bs)
        r, n = pad_bs // cfg.tp_size, cfg.num_tokens_per_req
        arg = self._check.arg
        info = arg(predict_local, "predict_local", (r, n), "int32")
        arg(accept_index_local, "accept_index_local", (r, n), "int32", info.kind)
        arg(accept_length_local, "accept_length_local", (r,), "int32", info.kind)
        rows = self._check.bs(bs, pad_bs)
        assert self._backend is not None
        return self._backend.gather_verify_outputs(
            predict_local,
            accept_index_local,
            accept_length_local,
            info,
            pad_bs=pad_bs,
            bs=rows,
            stream=stream,
        )

    def gather_verify_logprobs(
        self, logprobs_local: Any, *, pad_bs: int, bs: Any = None, stream: Any = None
    ) -> Any:
        """All-gather per-request log-probabilities.

        Parameters
        ----------
        logprobs_local : float32 array ``[pad_bs / tp, N]``
            A non-contiguous array is made contiguous first (a copy, as TokenSpeed).
        pad_bs : int
        bs : see :meth:`swap_batch_vocab`
        stream : see :meth:`swap_batch_vocab`

        Returns
        -------
        float32 array ``[pad_bs, N]``
            Row ``src * pad_bs/tp + i`` is row ``i`` of rank ``src``; rows ``>= bs``
            are undefined; a view of a persistent buffer.
        """
        self._check_open()
        cfg = self.config
        pad_bs = cfg.validate_pad_bs(pad_bs)
        shape = (pad_bs // cfg.tp_size, cfg.num_tokens_per_req)
        logprobs_local, info = self._check.logprobs(logprobs_local, shape)
        rows = self._check.bs(bs, pad_bs)
        assert self._backend is not None
        return self._backend.gather_verify_logprobs(
            logprobs_local, info, pad_bs=pad_bs, bs=rows, stream=stream
        )

    def check(self) -> None:
        """Raise an error that an asynchronous op reported (e.g.
        :class:`PeerTimeoutError` from a kernel); synchronise the op's stream first."""
        self._check_open()
        assert self._backend is not None
        self._backend.check()

    def close(self) -> None:
        """Release every resource (collective; idempotent)."""
        if self._closed:
            return
        self._closed = True
        backend, self._backend = self._backend, None
        if backend is not None:
            backend.close()

    def __enter__(self) -> DpSamplingComm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_backend", None) is not None and not getattr(self, "_closed", True):
            warnings.warn(
                "DpSamplingComm was not closed; call close() (or use it as a context "
                "manager): releasing collective resources in a destructor can hang",
                ResourceWarning,
                stacklevel=2,
            )

    def __repr__(self) -> str:
        c = self.config
        state = "open" if self.is_open else "closed"
        return (
            f"DpSamplingComm(rank={c.rank}/{c.tp_size}, "
            f"backend={getattr(self, '_backend_name', '?')}, device={self.device}, "
            f"max_pad_bs={c.max_pad_bs}, N={c.num_tokens_per_req}, "
            f"V={c.vocab_size}, dtype={self._logits_dtype}, {state})"
        )

    # -- validation ---------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed or self._backend is None:
            raise DpSampleError("this DpSamplingComm is closed; create a new one")

    def _logits_arg(self, x: Any, shape: tuple[int, int]) -> ArrayInfo:
        """``local_logits`` checked; with the dtype not fixed yet, its dtype fixes it."""
        info, fix = self._check.logits(x, shape, self._logits_dtype)
        if fix:
            self._fix_dtype(info.dtype)
        return info

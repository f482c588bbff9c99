"""The public communicator: validate, pick a backend once, dispatch."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

from . import __version__
from .arrays import ITEMSIZE, ArrayInfo, ArrayKind, describe, normalize_dtype, torch_fast_info
from .backends.base import Backend
from .config import (
    BACKENDS,
    BackendName,
    CommConfig,
    PeerRecord,
    check_agreement,
    pack_record,
    unpack_record,
)
from .errors import BackendUnavailableError, DpSampleError
from .group import HostGroup, resolve_group
from .identity import boot_id, cupy_device_count, gpu_uuid, host_id, nccl_available
from .layout import Layout
from .select import Facts, onesided_blockers, select_backend

__all__ = ["DpSamplingComm"]

ENV_BACKEND = "IPC_DPSAMPLE_BACKEND"
_SETUP_TIMEOUT_S = 60.0


def _gpu_sharing_ranks(recs: Sequence[PeerRecord]) -> int:
    """Ranks whose (host, boot, GPU UUID) a lower rank already has; ranks whose GPU
    UUID is unknown ("") are not counted (no evidence that they share)."""
    known = [(r.host_id, r.boot_id, r.gpu_uuid) for r in recs if r.gpu_uuid]
    return len(known) - len(set(known))


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def _cuda_device_count() -> int:
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.device_count())
    except Exception:
        pass
    return cupy_device_count()


def _check_device_usable(device: int) -> None:
    if device < 0:
        return
    count = _cuda_device_count()
    if device >= count:
        raise ValueError(
            f"device=cuda:{device} but this process sees {count} CUDA device(s); use "
            f"device='cpu' or a CUDA ordinal < {count}"
            if count
            else f"device=cuda:{device} but no CUDA device is usable here (torch and CuPy "
            "see none); use device='cpu'"
        )


def _resolve_device(device: Any) -> int:
    """CUDA ordinal, or -1 for the CPU."""
    if device is None:
        try:
            import torch

            if torch.cuda.is_available() and torch.cuda.device_count() > 0:
                return int(torch.cuda.current_device())
        except Exception:
            pass
        if cupy_device_count() > 0:
            import cupy

            return int(cupy.cuda.runtime.getDevice())
        return -1
    if isinstance(device, bool):
        raise TypeError(
            f"device={device!r}; expected None, 'cpu', 'cuda:k', an int or torch.device"
        )
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device={device} must be >= 0 (a CUDA ordinal) or 'cpu'")
        return device
    text = str(device)
    if text == "cpu":
        return -1
    if text == "cuda":
        return _resolve_device(None) if cupy_device_count() > 0 else 0
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    raise ValueError(f"device={device!r}; expected None, 'cpu', 'cuda:k', an int or torch.device")


class DpSamplingComm:
    """Batch-DP speculative-verify communicator for one tensor-parallel group.

    Collective: every rank of the group constructs it with the same arguments
    (except ``rank``), calls the same ops in the same order with the same
    ``pad_bs``, and closes it.

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
        name); None to choose later with :meth:`prepare_verify_outputs` (buffers
        are then sized for 4-byte elements).
    backend : {"auto", "onesided", "nccl", "torch"}
        ``IPC_DPSAMPLE_BACKEND`` overrides it.
    device : None, "cpu", "cuda:k", int or torch.device
        None: the current CUDA device if there is one, else the CPU.
    timeout_s : float
        Longest wait for a peer, on the host and inside kernels.

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
    ) -> None:
        self._backend: Backend | None = None
        self._closed = False
        self._group: HostGroup = resolve_group(group)
        # Validate locally, but always take part in the agreement exchange: a rank
        # with a bad argument must not leave its peers waiting for it.
        raw = dict(
            tp_size=tp_size,
            rank=rank,
            max_pad_bs=max_pad_bs,
            num_tokens_per_req=num_tokens_per_req,
            vocab_size=vocab_size,
        )
        local_error: Exception | None = None
        dtype: str | None = None
        try:
            env = os.environ.get(ENV_BACKEND)
            if env is not None and env.strip() != "":
                env = env.strip().lower()
                if env not in BACKENDS:
                    raise ValueError(f"{ENV_BACKEND}={env!r}; expected one of {BACKENDS}")
                backend = env
            dtype = None if logits_dtype is None else normalize_dtype(logits_dtype)
            self.config = CommConfig(
                logits_dtype=dtype,
                backend=backend,  # type: ignore[arg-type]
                timeout_s=timeout_s,
                **raw,
            )
            self._device = _resolve_device(device)
            _check_device_usable(self._device)
            if self._group.size != tp_size:
                raise ValueError(f"tp_size={tp_size} != group size {self._group.size}")
            if self._group.rank != rank:
                raise ValueError(
                    f"rank={rank} != this process's rank {self._group.rank} in the group"
                )
        except (ValueError, TypeError) as exc:
            local_error = exc
        self._exchange_records(raw, dtype, backend, local_error)
        assert local_error is None  # raised by _exchange_records
        self.layout = Layout(tp_size, max_pad_bs, num_tokens_per_req, vocab_size)
        self._logits_dtype = dtype
        self._backend_name, self._reason, self._backend = self._choose_backend()

    # -- construction -------------------------------------------------------------
    def _exchange_records(
        self,
        raw: dict[str, Any],
        dtype: str | None,
        backend: str,
        local_error: Exception | None,
    ) -> None:
        """All-gather every rank's config and identity; raise on every rank if any
        rank's arguments were invalid or differ from the others'."""

        def as_int(v: Any) -> int:
            ok = isinstance(v, int) and not isinstance(v, bool) and -(2**31) <= v < 2**31
            return int(v) if ok else -1

        valid = local_error is None
        device = self._device if valid else -1
        mine = PeerRecord(
            tp_size=as_int(raw["tp_size"]),
            rank=as_int(raw["rank"]),
            max_pad_bs=as_int(raw["max_pad_bs"]),
            num_tokens_per_req=as_int(raw["num_tokens_per_req"]),
            vocab_size=as_int(raw["vocab_size"]),
            logits_dtype=dtype if dtype in ("bfloat16", "float16", "float32") else None,
            backend=backend if backend in BACKENDS else "auto",
            device_kind="cpu" if device < 0 else "cuda",
            version=__version__,
            pid=os.getpid(),
            host_id=host_id(),
            boot_id=boot_id(),
            gpu_uuid=gpu_uuid(device),
            error="" if valid else f"{type(local_error).__name__}: {local_error}",
        )
        gathered = self._group.all_gather_bytes(
            pack_record(mine), timeout_s=_SETUP_TIMEOUT_S, what="config agreement"
        )
        if local_error is not None:
            raise local_error
        records = [unpack_record(r) for r in gathered]
        check_agreement(records, self.config.rank)
        self._records = records

    def _facts(self, ipc_verified: bool | None = None, ipc_detail: str = "") -> Facts:
        recs = self._records
        cuda = self._device >= 0
        return Facts(
            requested=self.config.backend,
            device_kind="cuda" if cuda else "cpu",
            tp_size=self.config.tp_size,
            hosts=len({r.host_id for r in recs}),
            boots=len({(r.host_id, r.boot_id) for r in recs}),
            cupy_gpu=cuda and self._gather_flag(cupy_device_count() > 0, "cupy probe"),
            nccl_available=cuda and self._gather_flag(nccl_available(), "nccl probe"),
            p2p_ok=self._p2p_fact() if cuda else None,
            nccl_p2p_disable=self._gather_flag(
                _env_true("NCCL_P2P_DISABLE"), "env probe", any_=True
            ),
            has_torch_group=hasattr(self._group, "process_group"),
            ipc_verified=ipc_verified,
            ipc_detail=ipc_detail,
            gpu_sharing_ranks=_gpu_sharing_ranks(recs) if cuda else 0,
        )

    def _gather_flag(self, value: bool, what: str, any_: bool = False) -> bool:
        flags = self._group.all_gather_bytes(
            b"\1" if value else b"\0", timeout_s=_SETUP_TIMEOUT_S, what=what
        )
        bits = [f == b"\1" for f in flags]
        return any(bits) if any_ else all(bits)

    def _p2p_fact(self) -> bool | None:
        from .ipc import p2p_matrix_ok

        return p2p_matrix_ok(self._device, [r.gpu_uuid for r in self._records])

    def _choose_backend(self) -> tuple[BackendName, str, Backend]:
        facts = self._facts()
        if (
            self._device >= 0
            and facts.requested in ("auto", "onesided")
            and not onesided_blockers(facts)
        ):
            from .backends.onesided import setup_onesided

            backend, detail = setup_onesided(self.config, self._group, self._device, self._records)
            facts = self._facts(ipc_verified=backend is not None, ipc_detail=detail)
            if backend is not None:
                name, reason = select_backend(facts)
                return name, reason, backend
            if facts.requested == "auto":
                warnings.warn(
                    f"ipc_dpsample: one-sided backend unavailable, falling back: {detail}",
                    RuntimeWarning,
                    stacklevel=3,
                )
        name, reason = select_backend(facts)
        try:
            backend = self._make_backend(name)
        except BackendUnavailableError as exc:
            if facts.requested != "auto":
                raise
            raise BackendUnavailableError(
                f"backend='auto' chose {name} ({reason}), but it cannot run: {exc}"
            ) from exc
        return name, reason, backend

    def _make_backend(self, name: BackendName) -> Backend:
        if name == "torch":
            import torch

            from .backends.torch_backend import TorchBackend

            dev = torch.device("cpu") if self._device < 0 else torch.device("cuda", self._device)
            return TorchBackend(self.config, self._group, dev)  # type: ignore[arg-type]
        if name == "nccl":
            from .backends.nccl import NcclBackend

            return NcclBackend(self.config, self._group, self._device)
        raise DpSampleError(f"backend {name!r} is not constructed here")

    # -- properties ---------------------------------------------------------------
    @property
    def backend(self) -> BackendName:
        """``"onesided"``, ``"nccl"`` or ``"torch"``."""
        return self._backend_name

    @property
    def fast_path_enabled(self) -> bool:
        """True when the one-sided CUDA IPC kernels move the data."""
        return self._backend_name == "onesided"

    @property
    def max_pad_bs(self) -> int:
        return self.config.max_pad_bs

    @property
    def is_initialized(self) -> bool:
        """True between construction and :meth:`close`."""
        return self._backend is not None and not self._closed

    @property
    def device(self) -> str:
        """``"cpu"`` or ``"cuda:k"``."""
        return "cpu" if self._device < 0 else f"cuda:{self._device}"

    @property
    def logits_dtype(self) -> str | None:
        return self._logits_dtype

    def explain(self) -> str:
        """Why this backend was chosen (one sentence)."""
        return f"{self._backend_name}: {self._reason}"

    # -- ops ----------------------------------------------------------------------
    def prepare_verify_outputs(self, logits_dtype: Any) -> None:
        """Set (or change) the logits dtype of :meth:`swap_batch_vocab`.

        Parameters
        ----------
        logits_dtype : dtype or str
            ``bfloat16``, ``float16`` or ``float32``. Every rank must use the same
            dtype (the one-sided backend checks this on every swap).

        Raises
        ------
        TypeError
            Unsupported dtype.
        ValueError
            The dtype needs larger buffers than were allocated at construction.
        """
        self._check_open()
        name = normalize_dtype(logits_dtype)
        if name not in ("bfloat16", "float16", "float32"):
            raise TypeError(f"logits_dtype={name!r}; expected bfloat16, float16 or float32")
        fixed = self.config.logits_dtype
        if fixed is not None and ITEMSIZE[name] > ITEMSIZE[fixed]:
            raise ValueError(
                f"logits_dtype={name} needs {ITEMSIZE[name]}-byte elements but the "
                f"communicator was built for {fixed} ({ITEMSIZE[fixed]} bytes); construct it "
                "with logits_dtype=None or float32"
            )
        assert self._backend is not None
        self._backend.prepare(name)
        self._logits_dtype = name

    def swap_batch_vocab(self, local_logits: Any, *, pad_bs: int, stream: Any = None) -> Any:
        """All-to-all from vocabulary shards to request shards.

        Parameters
        ----------
        local_logits : array ``[pad_bs * N, V / tp]``, ``logits_dtype``, C-contiguous
            This rank's vocabulary shard of the whole padded batch, on this
            communicator's device.
        pad_bs : int
            Padded batch size of this step, ``0 < pad_bs <= max_pad_bs``, a multiple
            of ``tp``; the same on every rank.
        stream : None, torch/CuPy stream, ``__cuda_stream__`` object or int
            None: the current stream of the input's framework.

        Returns
        -------
        array ``[pad_bs / tp * N, V]``, ``logits_dtype``, same array type as the input
            Row ``local_req * N + d`` is global request ``rank * pad_bs/tp + local_req``
            at draft position ``d``; columns ``[s*V/tp, (s+1)*V/tp)`` came from rank
            ``s``. A view of a persistent buffer, valid until the next op on this
            communicator is issued.
        """
        self._check_open()
        cfg = self.config
        cfg.validate_pad_bs(pad_bs)
        dtype = self._logits_dtype
        if dtype is None:
            raise DpSampleError(
                "logits dtype unknown: pass logits_dtype= to the constructor or call "
                "prepare_verify_outputs(dtype) first"
            )
        expected = (pad_bs * cfg.num_tokens_per_req, cfg.vocab_size // cfg.tp_size)
        info = self._arg(local_logits, "local_logits", expected, dtype)
        assert self._backend is not None
        return self._backend.swap_batch_vocab(local_logits, info, pad_bs=pad_bs, stream=stream)

    def gather_verify_outputs(
        self,
        predict_local: Any,
        accept_index_local: Any,
        accept_length_local: Any,
        *,
        pad_bs: int,
        stream: Any = None,
    ) -> tuple[Any, Any, Any]:
        """All-gather the verify results of every rank's requests.

        Parameters
        ----------
        predict_local, accept_index_local : int32 arrays ``[pad_bs / tp, N]``
        accept_length_local : int32 array ``[pad_bs / tp]``
            All of one array type, C-contiguous, on this communicator's device.
        pad_bs : int
        stream : see :meth:`swap_batch_vocab`

        Returns
        -------
        (predict ``[pad_bs, N]``, accept_index ``[pad_bs, N]``, accept_length ``[pad_bs]``)
            int32; row ``src * pad_bs/tp + i`` is row ``i`` of rank ``src``. Views of
            persistent buffers (the same storage on every call).
        """
        self._check_open()
        cfg = self.config
        cfg.validate_pad_bs(pad_bs)
        r, n = pad_bs // cfg.tp_size, cfg.num_tokens_per_req
        info = self._arg(predict_local, "predict_local", (r, n), "int32")
        self._arg(accept_index_local, "accept_index_local", (r, n), "int32", info.kind)
        self._arg(accept_length_local, "accept_length_local", (r,), "int32", info.kind)
        assert self._backend is not None
        return self._backend.gather_verify_outputs(
            predict_local,
            accept_index_local,
            accept_length_local,
            info,
            pad_bs=pad_bs,
            stream=stream,
        )

    def gather_verify_logprobs(
        self, logprobs_local: Any, *, pad_bs: int, stream: Any = None
    ) -> Any:
        """All-gather per-request log-probabilities.

        Parameters
        ----------
        logprobs_local : float32 array ``[pad_bs / tp, N]``, C-contiguous
        pad_bs : int
        stream : see :meth:`swap_batch_vocab`

        Returns
        -------
        float32 array ``[pad_bs, N]``
            Row ``src * pad_bs/tp + i`` is row ``i`` of rank ``src``; a view of a
            persistent buffer.
        """
        self._check_open()
        cfg = self.config
        cfg.validate_pad_bs(pad_bs)
        info = self._arg(
            logprobs_local,
            "logprobs_local",
            (pad_bs // cfg.tp_size, cfg.num_tokens_per_req),
            "float32",
        )
        assert self._backend is not None
        return self._backend.gather_verify_logprobs(
            logprobs_local, info, pad_bs=pad_bs, stream=stream
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
        state = "open" if self.is_initialized else "closed"
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

    def _arg(
        self,
        x: Any,
        name: str,
        shape: tuple[int, ...],
        dtype: str,
        kind: ArrayKind | None = None,
    ) -> ArrayInfo:
        """``x`` described and checked against ``shape``, ``dtype``, this device and
        (when given) the array ``kind`` of the call's other arguments."""
        info = torch_fast_info(x, shape, dtype, self._device)
        if info is None or (kind is not None and kind is not ArrayKind.TORCH):
            info = describe(x, name)
            self._check_array(name, info, shape, dtype, kind)
        return info

    def _check_array(
        self,
        name: str,
        info: ArrayInfo,
        shape: tuple[int, ...],
        dtype: str,
        kind: ArrayKind | None = None,
    ) -> None:
        if kind is not None and info.kind is not kind:
            raise TypeError(
                f"{name} is a {info.kind.value} array; expected {kind.value} like the others"
            )
        if info.dtype != dtype:
            raise TypeError(f"{name} dtype {info.dtype} != expected {dtype}")
        if info.device != self._device:
            where = "cpu" if info.device < 0 else f"cuda:{info.device}"
            raise TypeError(f"{name} is on {where}; expected {self.device}")
        if info.shape != shape:
            c = self.config
            raise ValueError(
                f"{name} shape {info.shape} != expected {shape} (tp={c.tp_size}, "
                f"N={c.num_tokens_per_req}, V/tp={c.vocab_size // c.tp_size})"
            )
        if not info.contiguous:
            raise ValueError(f"{name} must be C-contiguous (call .contiguous() first)")

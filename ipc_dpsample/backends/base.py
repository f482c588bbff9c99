"""The interface every backend implements: one method per collective, each ending
in keywords ``bs`` and ``stream``.

The communicator validates every argument before it calls a backend, so backends
may assume shapes, dtypes, devices, ``pad_bs`` and ``bs`` are right. Every method
returns views of persistent buffers in the caller's array type.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, NamedTuple

from ..arrays import ArrayInfo
from ..config import BackendName
from ..errors import BackendUnavailableError
from ..layout import VerifyParams

__all__ = ["Backend", "DeviceVerifyParams", "RealRows", "verify_unavailable"]


class RealRows(NamedTuple):
    """Which requests of the padded batch are real: the prefix ``[0, bs)``.

    Attributes
    ----------
    bs : int
        The number of real requests when the caller gave a host int; ``pad_bs``
        when it gave ``None`` (every row moves) or a device scalar (then ``bs`` is
        only an upper bound).
    ptr : int
        Device address of the caller's int32 scalar holding ``bs``, read when the
        op runs (CUDA-graph replays see the value written before ``replay()``);
        0 for a host value.
    given : bool
        False when the caller passed ``bs=None``.
    """

    bs: int
    ptr: int = 0
    given: bool = False

    @classmethod
    def every(cls, pad_bs: int) -> RealRows:
        """``bs=None``: every request of the padded batch is real."""
        return cls(pad_bs, 0, False)

    @property
    def on_device(self) -> bool:
        return self.ptr != 0


class DeviceVerifyParams(NamedTuple):
    """``verify_batch_vocab``'s per-request parameters left on the device (a backend that
    reads them when the op runs: the one-sided kernels). Their structure (dtype, shape
    ``[pad_bs]``, device, contiguity) is checked; their values are checked by the
    kernels, which report a refused value at the next call or ``check()``.

    Attributes
    ----------
    pad_bs, num_tokens_per_req, vocab_limit : int
    temperature, top_k, top_p, min_p, seed, offset : int
        Device addresses of the caller's arrays (float32, int32, float32, float32,
        int64, int64 ``[pad_bs]``); 0 for an absent ``top_k`` / ``top_p`` / ``min_p``
        (off for every request).
    """

    pad_bs: int
    num_tokens_per_req: int
    vocab_limit: int
    temperature: int
    top_k: int
    top_p: int
    min_p: int
    seed: int
    offset: int

    @property
    def pointers(self) -> tuple[int, int, int, int, int, int]:
        """The six addresses in kernel-argument order."""
        return (self.temperature, self.top_k, self.top_p, self.min_p, self.seed, self.offset)


class Backend(ABC):
    """One communicator's data mover."""

    name: ClassVar[BackendName]
    #: True when :meth:`verify_batch_vocab` takes :class:`DeviceVerifyParams`.
    device_verify_params: ClassVar[bool] = False

    @abstractmethod
    def prepare(self, logits_dtype: str) -> None:
        """Make the swap ready for ``logits_dtype`` (canonical name)."""

    @abstractmethod
    def swap_batch_vocab(
        self, x: Any, info: ArrayInfo, *, pad_bs: int, bs: RealRows, stream: Any
    ) -> Any:
        """``x[pad_bs*N, V/tp]`` -> ``[pad_bs/tp*N, V]`` (see :mod:`ipc_dpsample.layout`);
        rows of requests ``>= bs`` are undefined in the output."""

    @abstractmethod
    def gather_verify_outputs(
        self,
        predict: Any,
        accept_index: Any,
        accept_length: Any,
        info: ArrayInfo,
        *,
        pad_bs: int,
        bs: RealRows,
        stream: Any,
    ) -> tuple[Any, Any, Any]:
        """int32 ``[R, N]``, ``[R, N]``, ``[R]`` -> ``[pad_bs, N]``, ``[pad_bs, N]``,
        ``[pad_bs]``; ``info`` describes ``predict``."""

    @abstractmethod
    def gather_verify_logprobs(
        self, logprobs: Any, info: ArrayInfo, *, pad_bs: int, bs: RealRows, stream: Any
    ) -> Any:
        """float32 ``[R, N]`` -> ``[pad_bs, N]``."""

    @abstractmethod
    def argmax_batch_vocab(
        self,
        x: Any,
        info: ArrayInfo,
        *,
        pad_bs: int,
        vocab_limit: int,
        bs: RealRows,
        stream: Any,
    ) -> tuple[Any, Any]:
        """``x[pad_bs*N, V/tp]`` -> (token_ids int32 ``[R*N]``, logprobs float32
        ``[R*N]``) for this rank's requests (see
        :func:`ipc_dpsample.layout.reference_argmax_batch_vocab`)."""

    def verify_batch_vocab(
        self,
        x: Any,
        info: ArrayInfo,
        candidates: Any,
        candidates_info: ArrayInfo,
        *,
        pad_bs: int,
        params: VerifyParams | DeviceVerifyParams,
        return_logprobs: bool,
        bs: RealRows,
        stream: Any,
    ) -> tuple[Any, ...]:
        """``x[pad_bs*N, V/tp]`` and int32 ``candidates[pad_bs, N]`` -> (predict int32
        ``[pad_bs, N]``, accept_index int32 ``[pad_bs, N]``, accept_length int32
        ``[pad_bs]``, and with ``return_logprobs`` logprobs float32 ``[pad_bs, N]``) of
        the whole batch, as :func:`ipc_dpsample.layout.reference_verify_batch_vocab`.

        ``params`` are validated and on the host (:func:`ipc_dpsample.layout.
        verify_params`; ``params.bs`` real requests, also in ``bs``, a host value), or,
        for a backend with ``device_verify_params`` set, :class:`DeviceVerifyParams`
        when the caller passed every parameter on the device (``bs`` may then be a
        device scalar).
        A backend without this op raises :class:`BackendUnavailableError` (this
        default)."""
        raise verify_unavailable(
            f"the {type(self).__name__} path (backend {self.name!r}"
            + (", through fallback_comm_backend)" if self.name == "torch" else ")")
            + " does not implement it in this version"
        )

    def check(self) -> None:  # noqa: B027 - optional hook
        """Raise any error an earlier asynchronous op reported."""

    @abstractmethod
    def close(self) -> None:
        """Release every resource; called once, collectively."""


def verify_unavailable(why: str) -> BackendUnavailableError:
    """The error of a backend that cannot run ``verify_batch_vocab``: ``why``, then
    where the op runs in this version."""
    return BackendUnavailableError(
        f"verify_batch_vocab is not available here: {why}. In this version the op runs on "
        'the onesided backend (CUDA IPC, ranks on one host: backend="onesided"), on the '
        'nccl backend (one GPU per rank: backend="nccl") and on the torch backend '
        '(backend="torch"; it moves CUDA tensors over NCCL, gloo for ranks that share a '
        "GPU, and CPU tensors over gloo)"
    )

"""The interface every backend implements: one method per collective, each ending
in a keyword ``stream``.

The communicator validates every argument before it calls a backend, so backends
may assume shapes, dtypes, devices and ``pad_bs`` are right. Every method returns
views of persistent buffers in the caller's array type.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from ..arrays import ArrayInfo
from ..config import BackendName

__all__ = ["Backend"]


class Backend(ABC):
    """One communicator's data mover."""

    name: ClassVar[BackendName]

    @abstractmethod
    def prepare(self, logits_dtype: str) -> None:
        """Make the swap ready for ``logits_dtype`` (canonical name)."""

    @abstractmethod
    def swap_batch_vocab(self, x: Any, info: ArrayInfo, *, pad_bs: int, stream: Any) -> Any:
        """``x[pad_bs*N, V/tp]`` -> ``[pad_bs/tp*N, V]`` (see :mod:`ipc_dpsample.layout`)."""

    @abstractmethod
    def gather_verify_outputs(
        self,
        predict: Any,
        accept_index: Any,
        accept_length: Any,
        info: ArrayInfo,
        *,
        pad_bs: int,
        stream: Any,
    ) -> tuple[Any, Any, Any]:
        """int32 ``[R, N]``, ``[R, N]``, ``[R]`` -> ``[pad_bs, N]``, ``[pad_bs, N]``,
        ``[pad_bs]``; ``info`` describes ``predict``."""

    @abstractmethod
    def gather_verify_logprobs(
        self, logprobs: Any, info: ArrayInfo, *, pad_bs: int, stream: Any
    ) -> Any:
        """float32 ``[R, N]`` -> ``[pad_bs, N]``."""

    def check(self) -> None:  # noqa: B027 - optional hook
        """Raise any error an earlier asynchronous op reported."""

    @abstractmethod
    def close(self) -> None:
        """Release every resource; called once, collectively."""

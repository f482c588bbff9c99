"""Exception hierarchy of ipc_dpsample.

Every error the library raises on purpose derives from :class:`DpSampleError`
(a ``RuntimeError``), except plain user-input mistakes, which raise ``ValueError``
or ``TypeError`` naming the expected value.
"""

from __future__ import annotations

__all__ = [
    "BackendUnavailableError",
    "ConfigMismatchError",
    "DpSampleError",
    "PeerTimeoutError",
]


class DpSampleError(RuntimeError):
    """Base class of the library's runtime errors (a ``RuntimeError``)."""


class ConfigMismatchError(DpSampleError):
    """Ranks of one communicator were constructed with different configurations.

    Attributes
    ----------
    fields : dict[str, dict[int, object]]
        For every field that differs, the value each rank passed.
    """

    def __init__(self, message: str, fields: dict[str, dict[int, object]] | None = None):
        super().__init__(message)
        self.fields = fields or {}


class PeerTimeoutError(DpSampleError):
    """A peer did not take part in an operation within ``timeout_s``.

    Attributes
    ----------
    rank, peer : int
        The waiting rank and the peer it waited for.
    op : str
        The operation (``"swap_batch_vocab"``, ``"gather_verify_outputs"``...).
    expected_epoch, seen_epoch : int
        The epoch the waiting rank expected and the one it last saw from the peer.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int = -1,
        peer: int = -1,
        op: str = "",
        expected_epoch: int = -1,
        seen_epoch: int = -1,
    ):
        super().__init__(message)
        self.rank = rank
        self.peer = peer
        self.op = op
        self.expected_epoch = expected_epoch
        self.seen_epoch = seen_epoch


class BackendUnavailableError(DpSampleError):
    """An explicitly requested backend cannot run here; the message says why and
    how to fall back."""

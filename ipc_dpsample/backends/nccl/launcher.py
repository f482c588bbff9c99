"""Prepared kernel launches of one device's NCCL-backend kernels (the bottom layer of
the NCCL backend: :mod:`.setup` builds a :class:`Launcher`, :mod:`.plan` uses it)."""

from __future__ import annotations

from typing import Any

from ..common import PreparedLaunch
from .geometry import BLOCK

__all__ = ["Launcher"]


class Launcher:
    """Prepared launches of one device's NCCL-backend kernels.

    Parameters
    ----------
    kernels : dict of str to cupy.RawKernel
        Every name of :data:`~.geometry.KERNEL_NAMES` (name expressions for the
        permute instantiations).
    device : int
    """

    def __init__(self, kernels: dict[str, Any], device: int):
        self.kernels = kernels
        self.device = device

    def prepare(
        self, name: str, grid: int, args: tuple[int, ...], n_var: int, block: int = BLOCK
    ) -> PreparedLaunch:
        """``name`` on ``grid`` x ``block`` threads with ``args``, whose first ``n_var``
        entries are set per call."""
        return PreparedLaunch(self.kernels[name], self.device, grid, block, args, n_var)

    def header(self, tag: int, pad_bs: int, my_hdr: int, counter: int) -> PreparedLaunch:
        """``nccl_header``: per call ``(bs, bs_ptr)``."""
        return self.prepare("nccl_header", 1, (0, 0, my_hdr, tag, pad_bs, counter), 2, block=1)

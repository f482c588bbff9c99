"""Argument checks of the communicator's ops: every rejected call raises
``ValueError``/``TypeError`` (or :class:`DtypeMismatchError`) naming the argument
and the expected value, before anything is launched.

The hot path is :func:`~ipc_dpsample.arrays.torch_fast_info`: a dense contiguous
torch tensor of the right shape, dtype and device costs a few attribute reads;
anything else takes :func:`~ipc_dpsample.arrays.describe` and the full checks.
"""

from __future__ import annotations

import numbers
from typing import Any

from .arrays import ArrayInfo, ArrayKind, describe, torch_fast_info
from .backends.base import RealRows
from .config import CommConfig
from .errors import DpSampleError
from .protocol import LOGITS_DTYPES

__all__ = ["ArgChecker", "DtypeMismatchError"]


class DtypeMismatchError(DpSampleError, TypeError):
    """A swap's logits dtype differs from the one the communicator fixed (a
    ``RuntimeError`` like every :class:`DpSampleError`, as TokenSpeed raises, and a
    ``TypeError`` like every other dtype error of this library)."""


class ArgChecker:
    """The checks of one communicator's arguments.

    Parameters
    ----------
    config : CommConfig
    device : int
        CUDA ordinal, or -1 for the CPU.
    """

    def __init__(self, config: CommConfig, device: int):
        self.config = config
        self.device = device
        self.where = "cpu" if device < 0 else f"cuda:{device}"

    def logits(self, x: Any, shape: tuple[int, int], dtype: str | None) -> tuple[ArrayInfo, bool]:
        """``local_logits`` checked against ``dtype``; with ``dtype`` None, any logits
        dtype is accepted and the second value says that it must now be fixed."""
        if dtype is None:
            info = describe(x, "local_logits")
            if info.dtype not in LOGITS_DTYPES:
                raise TypeError(f"local_logits dtype {info.dtype}; expected one of {LOGITS_DTYPES}")
            self.array("local_logits", info, shape, info.dtype)
            return info, True
        info = torch_fast_info(x, shape, dtype, self.device)
        if info is None:
            info = describe(x, "local_logits")
            if info.dtype in LOGITS_DTYPES and info.dtype != dtype:
                raise DtypeMismatchError(
                    f"local_logits dtype {info.dtype} != this communicator's logits dtype "
                    f"{dtype} (fixed by the constructor, prepare_verify_outputs or the first "
                    "swap); build another communicator for another dtype"
                )
            self.array("local_logits", info, shape, dtype)
        return info, False

    def bs(self, bs: Any, pad_bs: int) -> RealRows:
        """The ``bs`` argument as :class:`RealRows` (see
        :meth:`~ipc_dpsample.DpSamplingComm.swap_batch_vocab`)."""
        if bs is None:
            return RealRows(pad_bs, 0, False)
        if isinstance(bs, bool):
            raise TypeError(f"bs={bs!r}; expected None, an int or an int32 device scalar")
        if isinstance(bs, numbers.Integral):
            value = int(bs)
        else:
            try:
                info = describe(bs, "bs")
            except TypeError:
                raise TypeError(
                    f"bs={bs!r}; expected None, an int in [0, pad_bs={pad_bs}] or an int32 "
                    f"scalar / 1-element array on {self.where}"
                ) from None
            if info.dtype != "int32":
                raise TypeError(f"bs dtype {info.dtype} != expected int32")
            if info.shape not in ((), (1,)):
                raise ValueError(f"bs shape {info.shape} != expected () or (1,)")
            if info.device != self.device:
                where = "cpu" if info.device < 0 else f"cuda:{info.device}"
                raise ValueError(f"bs is on {where}; expected {self.where}")
            if info.device >= 0:
                return RealRows(pad_bs, info.ptr, True)
            value = int(bs.reshape(-1)[0])  # host memory: read it now
        if not 0 <= value <= pad_bs:
            raise ValueError(f"bs={value} out of range: expected 0 <= bs <= pad_bs={pad_bs}")
        return RealRows(value, 0, True)

    def arg(
        self,
        x: Any,
        name: str,
        shape: tuple[int, ...],
        dtype: str,
        kind: ArrayKind | None = None,
    ) -> ArrayInfo:
        """``x`` described and checked against ``shape``, ``dtype``, the device and
        (when given) the array ``kind`` of the call's other arguments."""
        info = torch_fast_info(x, shape, dtype, self.device)
        if info is None or (kind is not None and kind is not ArrayKind.TORCH):
            info = describe(x, name)
            self.array(name, info, shape, dtype, kind)
        return info

    def array(
        self,
        name: str,
        info: ArrayInfo,
        shape: tuple[int, ...],
        dtype: str,
        kind: ArrayKind | None = None,
    ) -> None:
        """Raise unless ``info`` has ``kind``, ``dtype``, the device, ``shape`` and is
        C-contiguous."""
        if kind is not None and info.kind is not kind:
            raise TypeError(
                f"{name} is a {info.kind.value} array; expected {kind.value} like the others"
            )
        if info.dtype != dtype:
            raise TypeError(f"{name} dtype {info.dtype} != expected {dtype}")
        if info.device != self.device:
            where = "cpu" if info.device < 0 else f"cuda:{info.device}"
            raise TypeError(f"{name} is on {where}; expected {self.where}")
        if info.shape != shape:
            c = self.config
            if name == "local_logits":
                dims = f"rows pad_bs*N with N={c.num_tokens_per_req}, V/tp={shape[1]} columns"
            else:
                dims = f"R=pad_bs/tp={shape[0]} rows, N={c.num_tokens_per_req}"
            raise ValueError(
                f"{name} shape {info.shape} != expected {shape} (tp={c.tp_size}, {dims})"
            )
        if not info.contiguous:
            raise ValueError(f"{name} must be C-contiguous (call .contiguous() first)")

    def logprobs(self, x: Any, shape: tuple[int, int]) -> tuple[Any, ArrayInfo]:
        """``logprobs_local``: a strided float32 torch/CuPy/NumPy array of the right
        shape is made contiguous (a copy, as TokenSpeed does); then the usual checks.
        Returns the (possibly copied) array and its info."""
        if torch_fast_info(x, shape, "float32", self.device) is None:
            info = describe(x, "logprobs_local")
            if not info.contiguous and info.dtype == "float32" and info.shape == shape:
                x = _contiguous(x, info.kind)
        return x, self.arg(x, "logprobs_local", shape, "float32")


def _contiguous(x: Any, kind: ArrayKind) -> Any:
    if kind is ArrayKind.TORCH:
        return x.contiguous()
    if kind is ArrayKind.CUPY:
        import cupy

        return cupy.ascontiguousarray(x)
    if kind is ArrayKind.NUMPY:
        import numpy as np

        return np.ascontiguousarray(x)
    return x  # numba: the contiguity check names the problem

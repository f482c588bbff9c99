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
from .backends.base import DeviceVerifyParams, RealRows
from .config import CommConfig
from .errors import DpSampleError
from .layout import VerifyParams, verify_params, verify_vocab_limit
from .protocol import LOGITS_DTYPES

__all__ = ["VERIFY_PARAM_DTYPES", "ArgChecker", "DtypeMismatchError"]

#: ``verify_batch_vocab``'s per-request parameter arrays ``[pad_bs]`` and their dtypes.
VERIFY_PARAM_DTYPES = {
    "temperature": "float32",
    "top_k": "int32",
    "top_p": "float32",
    "min_p": "float32",
    "seed": "int64",
    "offset": "int64",
}
_VERIFY_REQUIRED = ("temperature", "seed", "offset")


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
            elif name == "candidates":
                dims = f"pad_bs={shape[0]} rows, N={c.num_tokens_per_req}"
            else:
                dims = f"R=pad_bs/tp={shape[0]} rows, N={c.num_tokens_per_req}"
            raise ValueError(
                f"{name} shape {info.shape} != expected {shape} (tp={c.tp_size}, {dims})"
            )
        if not info.contiguous:
            raise ValueError(f"{name} must be C-contiguous (call .contiguous() first)")

    def host_bs(self, bs: Any, pad_bs: int) -> RealRows:
        """:meth:`bs`, with a device scalar read now (a synchronous copy; clamped to
        ``[0, pad_bs]`` as the ops clamp it): ops computed on the host need the value."""
        rows = self.bs(bs, pad_bs)
        if not rows.on_device:
            return rows
        value = int(_to_host(bs, describe(bs, "bs")).reshape(-1)[0])
        return RealRows(min(max(value, 0), pad_bs), 0, True)

    def host_param(self, x: Any, name: str, dtype: str, pad_bs: int) -> Any:
        """A per-request parameter array ``[pad_bs]`` of ``dtype``, on the host or this
        device, C-contiguous, read into a NumPy array (zero-copy for host memory; a
        synchronous copy from a GPU)."""
        return _to_host(x, self.param_info(x, name, dtype, pad_bs))

    def param_info(self, x: Any, name: str, dtype: str, pad_bs: int) -> ArrayInfo:
        """The structure checks of a per-request parameter array: ``[pad_bs]`` of
        ``dtype``, on the host or this device, C-contiguous."""
        where = "the host" if self.device < 0 else f"the host or {self.where}"
        try:
            info = describe(x, name)
        except TypeError:
            raise TypeError(
                f"{name}={x!r:.80}; expected a {dtype} array [pad_bs={pad_bs}] (NumPy, torch "
                f"or CuPy) on {where}"
            ) from None
        if info.dtype != dtype:
            raise TypeError(f"{name} dtype {info.dtype} != expected {dtype}")
        if info.device not in (-1, self.device):
            raise TypeError(f"{name} is on cuda:{info.device}; expected {where}")
        if info.shape != (pad_bs,):
            raise ValueError(
                f"{name} shape {info.shape} != expected ({pad_bs},) (one value per request of "
                f"pad_bs={pad_bs})"
            )
        if not info.contiguous:
            raise ValueError(f"{name} must be C-contiguous (call .contiguous() first)")
        return info

    def verify(
        self,
        candidates: Any,
        *,
        pad_bs: int,
        vocab_limit: Any,
        bs: Any,
        return_logprobs: Any,
        device_params: bool = False,
        **arrays: Any,
    ) -> tuple[ArrayInfo, VerifyParams | DeviceVerifyParams, RealRows]:
        """The arguments of ``verify_batch_vocab`` besides ``local_logits``: the
        structure checked here (array type, dtype, shape, device), the values by
        :func:`ipc_dpsample.layout.verify_params` (the one implementation of the range
        rules), every parameter read on the host. ``arrays``: the
        :data:`VERIFY_PARAM_DTYPES` arguments (None: off / absent).

        With ``device_params`` (a backend that reads them when the op runs) and every
        given parameter an array on this communicator's device, nothing is read: the
        result is :class:`~ipc_dpsample.backends.base.DeviceVerifyParams` and a device
        ``bs`` stays on the device (a CUDA graph can capture the call)."""
        cfg = self.config
        cand = self.arg(candidates, "candidates", (pad_bs, cfg.num_tokens_per_req), "int32")
        if vocab_limit is not None and (
            isinstance(vocab_limit, bool) or not isinstance(vocab_limit, numbers.Integral)
        ):
            raise TypeError(f"vocab_limit must be an int or None, got {vocab_limit!r}")
        if not isinstance(return_logprobs, bool):
            raise TypeError(f"return_logprobs must be a bool, got {return_logprobs!r}")
        if device_params and self.device >= 0:
            dev = self._device_params(pad_bs, vocab_limit, arrays)
            if dev is not None:
                return cand, dev, self.bs(bs, pad_bs)
        rows = self.host_bs(bs, pad_bs)
        host: dict[str, Any] = {}
        for name, dtype in VERIFY_PARAM_DTYPES.items():
            value = arrays[name]
            if value is None and name in _VERIFY_REQUIRED:
                raise TypeError(f"{name} is required: a {dtype} array [pad_bs={pad_bs}]")
            host[name] = None if value is None else self.host_param(value, name, dtype, pad_bs)
        params = verify_params(
            pad_bs=pad_bs,
            num_tokens_per_req=cfg.num_tokens_per_req,
            vocab_size=cfg.vocab_size,
            vocab_limit=None if vocab_limit is None else int(vocab_limit),
            bs=rows.bs if rows.given else None,
            **host,
        )
        return cand, params, rows

    def _device_params(
        self, pad_bs: int, vocab_limit: Any, arrays: dict[str, Any]
    ) -> DeviceVerifyParams | None:
        """:class:`DeviceVerifyParams` when every given parameter is an array on this
        device (structure checked), else None (they are then read on the host)."""
        infos: dict[str, ArrayInfo | None] = {}
        for name, dtype in VERIFY_PARAM_DTYPES.items():
            value = arrays[name]
            if value is None:
                if name in _VERIFY_REQUIRED:
                    raise TypeError(f"{name} is required: a {dtype} array [pad_bs={pad_bs}]")
                infos[name] = None
                continue
            info = self.param_info(value, name, dtype, pad_bs)
            if info.device < 0:
                return None
            infos[name] = info
        limit = verify_vocab_limit(vocab_limit, self.config.vocab_size)
        ptr = {name: 0 if info is None else info.ptr for name, info in infos.items()}
        return DeviceVerifyParams(
            pad_bs=pad_bs,
            num_tokens_per_req=self.config.num_tokens_per_req,
            vocab_limit=limit,
            **ptr,
        )

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


def _to_host(x: Any, info: ArrayInfo) -> Any:
    """``x`` as a NumPy array: itself, a zero-copy view of host memory, or a
    synchronous copy of device memory."""
    if info.kind is ArrayKind.NUMPY:
        return x
    if info.kind is ArrayKind.TORCH:
        t = x.detach()
        return (t.cpu() if info.device >= 0 else t).numpy()
    if info.kind is ArrayKind.CUPY:
        return x.get()
    return x.copy_to_host()  # numba

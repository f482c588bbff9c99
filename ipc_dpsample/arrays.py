"""Array interop: torch tensors, CuPy arrays, numba device arrays and NumPy arrays.

Everything here is zero-copy. The per-call path reads a raw pointer, the shape,
the dtype and the device of the caller's array (no DLPack, no framework op) and
hands back prebuilt views of the backend's persistent buffers in the caller's own
array type.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import numpy as np

from .protocol import LOGITS_DTYPES, Dtype

__all__ = [
    "ITEMSIZE",
    "LOGITS_DTYPES",
    "ArrayInfo",
    "ArrayKind",
    "StreamHandle",
    "as_torch",
    "check_host_stream",
    "check_stream_type",
    "cupy_stream",
    "describe",
    "make_view",
    "normalize_dtype",
    "resolve_stream",
    "torch_view",
]

#: Canonical dtype names this library moves, and their sizes in bytes (from
#: :class:`ipc_dpsample.protocol.Dtype`, where the codes are defined once).
ITEMSIZE: dict[str, int] = {d.canonical: d.itemsize for d in Dtype}

_ALIASES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float16": "float16",
    "fp32": "float32",
    "float": "float32",
    "float32": "float32",
    "int32": "int32",
    "int": "int32",
}


class ArrayKind(enum.Enum):
    """Framework of an array."""

    TORCH = "torch"
    CUPY = "cupy"
    NUMBA = "numba"
    NUMPY = "numpy"


class ArrayInfo(NamedTuple):
    """What the library needs to know about one array (immutable; a named tuple
    because the per-call path builds one per argument and a frozen dataclass costs
    several times more).

    Attributes
    ----------
    kind : ArrayKind
    ptr : int
        Address of element 0 (host address for CPU arrays).
    shape : tuple[int, ...]
    dtype : str
        Canonical name (``"bfloat16"``, ``"float16"``, ``"float32"``, ``"int32"``) or the
        framework's own name for other dtypes.
    device : int
        CUDA device ordinal, or -1 for host memory.
    contiguous : bool
        C-contiguous.
    """

    kind: ArrayKind
    ptr: int
    shape: tuple[int, ...]
    dtype: str
    device: int
    contiguous: bool


def normalize_dtype(dtype: Any) -> str:
    """Canonical name of a torch, NumPy or CuPy dtype, or of a dtype name.

    Raises
    ------
    TypeError
        For a dtype the library does not move.
    """
    if isinstance(dtype, str):
        name = dtype.lower().removeprefix("torch.")
    else:
        name = str(dtype).removeprefix("torch.")
        if name.startswith("<class"):
            try:
                name = np.dtype(dtype).name
            except TypeError:
                pass
    name = _ALIASES.get(name, name)
    if name not in ITEMSIZE:
        raise TypeError(
            f"unsupported dtype {dtype!r}; expected one of bfloat16, float16, float32 "
            "(logits) or int32"
        )
    return name


_TORCH_DTYPE_NAMES: dict[Any, str] = {}


def _torch_dtype_name(dtype: Any) -> str:
    name = _TORCH_DTYPE_NAMES.get(dtype)
    if name is None:
        name = str(dtype).removeprefix("torch.")
        _TORCH_DTYPE_NAMES[dtype] = name
    return name


_KINDS: dict[type, ArrayKind] = {}


def _kind_of(x: Any) -> ArrayKind:
    kind = _KINDS.get(type(x))
    if kind is None:
        kind = _kind_of_type(x)
        if kind is not ArrayKind.NUMBA:  # duck-typed: decided per object
            _KINDS[type(x)] = kind
    return kind


def _kind_of_type(x: Any) -> ArrayKind:
    mod = type(x).__module__
    if mod.startswith("torch"):
        return ArrayKind.TORCH
    if mod.startswith("cupy"):
        return ArrayKind.CUPY
    if isinstance(x, np.ndarray):
        return ArrayKind.NUMPY
    if hasattr(x, "__cuda_array_interface__"):
        return ArrayKind.NUMBA
    raise TypeError(
        f"unsupported array type {type(x).__module__}.{type(x).__qualname__}; expected a "
        "torch.Tensor, cupy.ndarray, numba device array or numpy.ndarray"
    )


def describe(x: Any, name: str = "array") -> ArrayInfo:
    """Describe ``x`` without copying it or touching a GPU.

    Parameters
    ----------
    x : array
    name : str
        The argument's name, used in error messages.

    Raises
    ------
    TypeError
        ``x`` is not a strided array of a supported framework, lives on a device
        other than the CPU or a CUDA GPU, or exposes a malformed
        ``__cuda_array_interface__``.
    """
    try:
        kind = _kind_of(x)
    except TypeError as exc:
        raise TypeError(f"{name}: {exc}") from None
    if kind is ArrayKind.TORCH:
        # the cheap attributes only (``x.device.type`` alone costs about 1 us)
        if x.is_cuda:
            dev = x.get_device()
        elif x.is_cpu:
            dev = -1
        else:
            raise TypeError(f"{name} is on {x.device.type}; expected cpu or cuda")
        if x.is_nested or x.is_sparse or str(x.layout) != "torch.strided":
            kind_name = "nested" if x.is_nested else str(x.layout)
            raise TypeError(f"{name} is a {kind_name} tensor; expected a dense (strided) tensor")
        return ArrayInfo(
            kind,
            x.data_ptr(),
            tuple(x.shape),
            _torch_dtype_name(x.dtype),
            dev,
            x.is_contiguous(),
        )
    if kind is ArrayKind.CUPY:
        return ArrayInfo(
            kind,
            x.data.ptr,
            tuple(x.shape),
            _numpy_dtype_name(x.dtype),
            x.device.id,
            bool(x.flags.c_contiguous),
        )
    if kind is ArrayKind.NUMPY:
        return ArrayInfo(
            kind,
            x.ctypes.data,
            tuple(x.shape),
            _numpy_dtype_name(x.dtype),
            -1,
            bool(x.flags.c_contiguous),
        )
    try:
        cai = x.__cuda_array_interface__
        shape = tuple(int(d) for d in cai["shape"])
        dtype = np.dtype(cai["typestr"])
        ptr = int(cai["data"][0])
        strides = cai.get("strides")
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise TypeError(
            f"{name} has a malformed __cuda_array_interface__ ({type(exc).__name__}: {exc})"
        ) from None
    contiguous = strides is None or tuple(strides) == _c_strides(shape, dtype.itemsize)
    dev = _numba_device(x)
    return ArrayInfo(kind, ptr, shape, _numpy_dtype_name(dtype), dev, contiguous)


_TORCH_DTYPES: dict[str, Any] = {}  # canonical name -> torch dtype, filled on first use
_TORCH_STRIDED: list[Any] = []  # [torch.strided] once torch has been imported here


def torch_fast_info(x: Any, shape: tuple[int, ...], dtype: str, device: int) -> ArrayInfo | None:
    """The hot path of argument checking: ``x``'s :class:`ArrayInfo` when it is a
    dense C-contiguous torch tensor of exactly ``shape`` and ``dtype`` on ``device``
    (-1: host memory), else None. None decides nothing: the caller then runs
    :func:`describe` and its full checks, which accept or name what is wrong. About a
    third of the cost of :func:`describe` plus those checks (no ``tuple(x.shape)``,
    no dtype string, a single tuple allocation)."""
    if _KINDS.get(type(x)) is not ArrayKind.TORCH:
        return None
    want = _TORCH_DTYPES.get(dtype)
    if want is None:
        import torch

        want = getattr(torch, dtype, None)
        if not isinstance(want, torch.dtype):
            return None
        _TORCH_DTYPES[dtype] = want
        if not _TORCH_STRIDED:
            _TORCH_STRIDED.append(torch.strided)
    try:  # anything unusual (nested, sparse, meta, subclasses...) takes the full path
        if x.is_nested or x.layout is not _TORCH_STRIDED[0]:
            return None
        if x.dtype is not want or x.shape != shape:
            return None
        if device >= 0:
            if not x.is_cuda or x.get_device() != device:
                return None
        elif not x.is_cpu:
            return None
        if not x.is_contiguous():
            return None
        ptr = x.data_ptr()
    except Exception:
        return None
    return tuple.__new__(ArrayInfo, (ArrayKind.TORCH, ptr, shape, dtype, device, True))


def _numpy_dtype_name(dtype: Any) -> str:
    """The dtype's name, marked when its byte order is not native (never accepted)."""
    if dtype.byteorder not in ("=", "|") and dtype.byteorder != _NATIVE:
        return f"{dtype.name} (non-native byte order {dtype.str})"
    return dtype.name


_NATIVE = "<" if np.little_endian else ">"


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides = []
    acc = itemsize
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def _numba_device(x: Any) -> int:
    try:
        from numba import cuda

        return int(cuda.get_current_device().id)
    except Exception:
        return 0


class _CudaArrayInterface:
    """A minimal ``__cuda_array_interface__`` exporter over raw device memory."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str, owner: Any):
        self._owner = owner
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (ptr, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


def _storage_typestr(dtype: str) -> str:
    # bfloat16 travels as its uint16 bit pattern and is re-viewed by torch.
    return {"bfloat16": "<u2", "float16": "<f2", "float32": "<f4", "int32": "<i4"}[dtype]


def make_view(
    kind: ArrayKind,
    ptr: int,
    shape: tuple[int, ...],
    dtype: str,
    device: int,
    owner: Any = None,
) -> Any:
    """A zero-copy array of framework ``kind`` over device memory at ``ptr``.

    Parameters
    ----------
    kind : ArrayKind
        Framework of the result (``NUMPY`` is not valid here: device memory).
    ptr : int
        Device address; the memory must outlive the view (``owner`` is kept alive
        by it).
    shape : tuple of int
    dtype : str
        Canonical dtype name.
    device : int
        CUDA device ordinal.
    """
    typestr = _storage_typestr(dtype)
    if kind is ArrayKind.TORCH:
        import torch

        t = torch.as_tensor(
            _CudaArrayInterface(ptr, shape, typestr, owner), device=f"cuda:{device}"
        )
        if dtype == "bfloat16":
            t = t.view(torch.bfloat16)
        return t
    if dtype == "bfloat16":
        raise TypeError(f"{kind.value} has no bfloat16 dtype; pass torch tensors for bfloat16")
    if kind is ArrayKind.CUPY:
        import cupy

        nbytes = int(np.prod(shape, dtype=np.int64)) * ITEMSIZE[dtype]
        mem = cupy.cuda.UnownedMemory(ptr, nbytes, owner, device)
        return cupy.ndarray(shape, dtype=np.dtype(typestr), memptr=cupy.cuda.MemoryPointer(mem, 0))
    if kind is ArrayKind.NUMBA:
        from numba import cuda

        return cuda.from_cuda_array_interface(
            _CudaArrayInterface(ptr, shape, typestr, owner).__cuda_array_interface__,
            owner=owner,
            sync=False,
        )
    raise TypeError(f"cannot make a device view of kind {kind.value}")


_TORCH_RAW_STREAM: list[Any] = []  # [torch._C._cuda_getCurrentRawStream] once found


_STREAM_FORMS = (
    "None, a torch or CuPy stream, an object with __cuda_stream__, or an int handle >= 0"
)


def _bad_stream(stream: Any, why: str = "") -> TypeError:
    return TypeError(
        f"stream={stream!r} ({type(stream).__module__}.{type(stream).__qualname__})"
        f"{why}; expected {_STREAM_FORMS}"
    )


def check_host_stream(stream: Any) -> None:
    """The ``stream`` argument of an op on CPU data: only None (host ops run on the
    calling thread; there is no stream to order them on).

    Raises
    ------
    TypeError
        ``stream`` is not None: naming the value, its type and what is expected.
    """
    if stream is not None:
        raise TypeError(
            f"stream={stream!r} ({type(stream).__module__}.{type(stream).__qualname__}) "
            "for an op on CPU data; expected None (host ops run on the calling thread)"
        )


def check_stream_type(stream: Any) -> None:
    """Raise ``TypeError`` unless ``stream`` has one of the forms
    :func:`resolve_stream` accepts (no CUDA call: the form only)."""
    if stream is None:
        return
    if isinstance(stream, (bool, str, bytes, float)):  # bool is an int: not a handle
        raise _bad_stream(stream)
    if isinstance(stream, int):
        if stream < 0:
            raise _bad_stream(stream, ", a negative handle")
        return
    if not any(
        getattr(stream, attr, None) is not None
        for attr in ("cuda_stream", "ptr", "__cuda_stream__", "handle")
    ):
        raise _bad_stream(stream)


def resolve_stream(kind: ArrayKind, stream: Any, device: int) -> int:
    """Raw ``cudaStream_t`` handle for an op on ``device``.

    ``stream=None`` means the current stream of the input's framework (torch's
    current stream, CuPy's current stream, the legacy default stream for numba).
    An explicit torch or CuPy stream, an object with ``__cuda_stream__`` or a raw
    integer handle ``>= 0`` is honoured.

    Raises
    ------
    TypeError
        Any other ``stream`` (a str, bool, float, negative int, or an object with
        none of those attributes), naming the value, its type and the forms
        accepted.
    """
    if stream is None:
        if kind is ArrayKind.TORCH:
            if _TORCH_RAW_STREAM:  # bound once: no import statement on the hot path
                return int(_TORCH_RAW_STREAM[0](device))
            import torch

            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            if raw is not None:  # the handle alone: no Python Stream object per call
                _TORCH_RAW_STREAM.append(raw)
                return int(raw(device))
            return int(torch.cuda.current_stream(device).cuda_stream)
        if kind is ArrayKind.CUPY:
            import cupy

            return int(cupy.cuda.get_current_stream().ptr)
        return 0
    if isinstance(stream, int) and not isinstance(stream, bool):  # bool: not a handle
        if stream < 0:
            raise _bad_stream(stream, ", a negative handle")
        return stream
    # a str, bytes or float has none of the attributes below: it ends in the TypeError
    handle = getattr(stream, "cuda_stream", None)  # torch.cuda.Stream
    if handle is not None:
        return int(handle)
    ptr = getattr(stream, "ptr", None)  # cupy.cuda.Stream
    if ptr is not None:
        return int(ptr)
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        value = proto() if callable(proto) else proto
        return int(value[1])
    handle = getattr(stream, "handle", None)  # numba stream
    if handle is not None:
        return int(getattr(handle, "value", handle) or 0)
    raise _bad_stream(stream)


class StreamHandle:
    """A raw ``cudaStream_t`` behind the CUDA stream protocol (``__cuda_stream__``)."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def cupy_stream(handle: int, device: int) -> Any:
    """A CuPy stream object for the raw handle: ``Stream.from_external`` in CuPy 14
    (``ExternalStream`` is deprecated there), ``ExternalStream`` before."""
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(StreamHandle(handle))
    return cupy.cuda.ExternalStream(handle, device)


def as_torch(x: Any, kind: ArrayKind, device: Any = None) -> Any:
    """A torch tensor sharing ``x``'s memory (zero-copy: DLPack for CuPy/numba)."""
    import torch

    if kind is ArrayKind.TORCH:
        return x
    if kind is ArrayKind.NUMPY:
        return torch.from_numpy(x)
    if hasattr(x, "__dlpack__"):
        return torch.from_dlpack(x)
    return torch.as_tensor(x, device=device)


def torch_view(kind: ArrayKind, t: Any) -> Any:
    """The torch tensor ``t`` as an array of framework ``kind`` (zero-copy)."""
    if kind is ArrayKind.TORCH:
        return t
    if kind is ArrayKind.NUMPY:
        return t.numpy()
    if kind is ArrayKind.CUPY:
        import cupy

        return cupy.from_dlpack(t)
    from numba import cuda

    return cuda.as_cuda_array(t)

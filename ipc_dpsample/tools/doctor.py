"""``ipc-dpsample doctor``: is this machine ready, and which backend would run?

The report (``--json`` prints it; :data:`SCHEMA` describes it) holds, in order:

``verdict``
    ``ok``, ``level`` (``healthy``, ``healthy-cpu`` or ``unhealthy``) and one line of
    text; computed by the pure function :func:`verdict` (rules in its docstring).
``host``, ``versions``
    Python, torch, CuPy, NCCL (CuPy's and torch's), driver, CUDA runtime.
``gpus``
    The CUDA devices with UUIDs, as torch and CuPy see them.
``p2p``
    Peer access as the driver reports it (``cudaDeviceCanAccessPeer``) and as
    verified for real: for every GPU pair ``(a, b)``, ``a <= b``, two spawned
    processes each ``cudaMalloc`` a buffer, export it with ``cudaIpcGetMemHandle``,
    open the peer's with ``cudaIpcOpenMemHandle``, write a random pattern into it
    (half with a kernel's stores, half with ``cudaMemcpy``) and read their own
    buffer back. ``a == b`` checks two processes sharing one GPU.
``topology``
    NVLink state per GPU and per pair from NVML (``pynvml``) when it loads, and the
    ``nvidia-smi topo -m`` matrix when ``nvidia-smi`` exists.
``hazards``
    Settings and environments known to break or slow the library (severity
    ``error``, ``warning`` or ``info``).
``backends``, ``selection``
    Which optional backends import, and the backend ``auto`` would choose for a
    group of all local GPUs (:func:`ipc_dpsample.select.select_backend` on facts
    gathered here) with its reason.
``selftests``
    A short bit-exact run of every backend that can run here (the demo's rank
    body on tiny shapes).

Exit code 0 when the verdict is ok, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import multiprocessing as mp
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .. import __version__
from .common import DemoPlan, Machine, detect_machine
from .demo import mismatches, run_demo

__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "collect",
    "find_hazards",
    "format_human",
    "plan_selftests",
    "selection_facts",
    "validate",
    "verdict",
    "verify_ipc_pairs",
]

SCHEMA_VERSION = 1
TOOL = "ipc-dpsample doctor"
VERSION_KEYS = (
    "python",
    "ipc_dpsample",
    "numpy",
    "torch",
    "torch_cuda",
    "cupy",
    "nccl_cupy",
    "nccl_torch",
    "cuda_driver_api",
    "cuda_runtime",
    "driver",
)
#: /dev/shm smaller than this is Docker's default-sized one, not the host's.
SHM_MIN_BYTES = 1 << 30
_IPC_BYTES = 4 << 20

# -- schema -------------------------------------------------------------------------
_STR = {"type": "string"}
_STR_OR_NULL = {"type": ["string", "null"]}
_INT = {"type": "integer", "minimum": 0}
_INT_OR_NULL = {"type": ["integer", "null"]}
_BOOL_OR_NULL = {"type": ["boolean", "null"]}


def _obj(props: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": list(props),
        "additionalProperties": False,
        "properties": props,
    }


_MATRIX = {"type": "array", "items": {"type": "array", "items": _BOOL_OR_NULL}}

#: JSON Schema (draft 2020-12 subset) of the ``--json`` report. Every key is
#: required; consumers may rely on this shape for a given ``schema_version``.
SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": f"https://ipc-dpsample/schemas/doctor-{SCHEMA_VERSION}.json",
    "title": "ipc-dpsample doctor report",
    **_obj(
        {
            "schema_version": {"const": SCHEMA_VERSION},
            "tool": {"const": TOOL},
            "generated_at": _STR,
            "verdict": _obj(
                {
                    "ok": {"type": "boolean"},
                    "level": {"enum": ["healthy", "healthy-cpu", "unhealthy"]},
                    "text": _STR,
                }
            ),
            "host": _obj(
                {
                    "hostname": _STR,
                    "platform": _STR,
                    "cpu_count": _INT,
                    "boot_id": _STR,
                    "shm_bytes": _INT_OR_NULL,
                    "container": {"type": "boolean"},
                }
            ),
            "versions": _obj({k: _STR_OR_NULL for k in VERSION_KEYS}),
            "gpus": _obj(
                {
                    "torch_count": _INT,
                    "cupy_count": _INT,
                    "devices": {
                        "type": "array",
                        "items": _obj(
                            {
                                "index": _INT,
                                "name": _STR,
                                "uuid": _STR,
                                "compute_capability": _STR,
                                "memory_bytes": _INT,
                                "pci_bus_id": _STR_OR_NULL,
                            }
                        ),
                    },
                    "error": _STR_OR_NULL,
                }
            ),
            "p2p": _obj(
                {
                    "driver": _MATRIX,
                    "verified": _MATRIX,
                    "pairs": {
                        "type": "array",
                        "items": _obj(
                            {
                                "a": _INT,
                                "b": _INT,
                                "driver": _BOOL_OR_NULL,
                                "verified": {"type": "boolean"},
                                "detail": _STR,
                                "seconds": {"type": "number"},
                            }
                        ),
                    },
                    "skipped": _STR_OR_NULL,
                }
            ),
            "topology": _obj(
                {
                    "source": {"enum": ["nvml", "nvidia-smi", "none"]},
                    "gpus": {
                        "type": "array",
                        "items": _obj(
                            {
                                "nvml_index": _INT,
                                "cuda_index": _INT_OR_NULL,
                                "uuid": _STR,
                                "name": _STR,
                                "nvlink_active": _INT_OR_NULL,
                                "nvlink_version": _INT_OR_NULL,
                            }
                        ),
                    },
                    "pairs": {
                        "type": "array",
                        "items": _obj(
                            {
                                "a": _INT,
                                "b": _INT,
                                "ancestor": _STR_OR_NULL,
                                "nvlink_p2p": _BOOL_OR_NULL,
                            }
                        ),
                    },
                    "text": _STR_OR_NULL,
                    "detail": _STR,
                }
            ),
            "hazards": {
                "type": "array",
                "items": _obj(
                    {
                        "id": _STR,
                        "severity": {"enum": ["error", "warning", "info"]},
                        "message": _STR,
                        "fix": _STR,
                    }
                ),
            },
            "backends": _obj(
                {
                    name: _obj({"importable": {"type": "boolean"}, "error": _STR})
                    for name in ("onesided", "nccl")
                }
            ),
            "selection": _obj(
                {
                    "requested": _STR,
                    "backend": {"enum": ["onesided", "nccl", "torch", None]},
                    "reason": _STR,
                    "note": _STR,
                    "facts": {"type": "object"},
                }
            ),
            "selftests": {
                "type": "array",
                "items": _obj(
                    {
                        "name": _STR,
                        "backend": _STR,
                        "resolved": _STR_OR_NULL,
                        "device": {"enum": ["cpu", "cuda"]},
                        "ranks": _INT,
                        "launch": {"enum": ["processes", "threads"]},
                        "status": {"enum": ["passed", "failed", "skipped"]},
                        "detail": _STR,
                        "seconds": {"type": "number"},
                    }
                ),
            },
        }
    ),
}

_TYPES: dict[str, Any] = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "null": type(None),
}


def _is_type(value: Any, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[name])


def validate(obj: Any, schema: Mapping[str, Any] = SCHEMA, path: str = "$") -> list[str]:
    """Errors of ``obj`` against ``schema`` (the JSON Schema keywords :data:`SCHEMA`
    uses: type, const, enum, required, properties, additionalProperties, items,
    minimum). Empty means valid."""
    errors: list[str] = []
    if "const" in schema and obj != schema["const"]:
        errors.append(f"{path}: {obj!r} != const {schema['const']!r}")
    if "enum" in schema and obj not in schema["enum"]:
        errors.append(f"{path}: {obj!r} not in {schema['enum']!r}")
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is_type(obj, t) for t in types):
            return [*errors, f"{path}: {type(obj).__name__} is not {'/'.join(types)}"]
    if "minimum" in schema and _is_type(obj, "number") and obj < schema["minimum"]:
        errors.append(f"{path}: {obj} < minimum {schema['minimum']}")
    if isinstance(obj, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in obj:
                errors.append(f"{path}: missing key {key!r}")
        for key, value in obj.items():
            if key in props:
                errors.extend(validate(value, props[key], f"{path}.{key}"))
            elif schema.get("additionalProperties", True) is False:
                errors.append(f"{path}: unexpected key {key!r}")
    if isinstance(obj, list) and "items" in schema:
        for i, item in enumerate(obj):
            errors.extend(validate(item, schema["items"], f"{path}[{i}]"))
    return errors


# -- versions, host, GPUs -----------------------------------------------------------
def _cuda_version(code: int) -> str | None:
    """``12090`` -> ``"12.9"``; None for 0 (no driver)."""
    if code <= 0:
        return None
    return f"{code // 1000}.{(code % 1000) // 10}"


def nccl_version_string(code: int) -> str:
    """NCCL's integer version as text (``22805`` -> ``"2.28.5"``, ``2708`` -> ``"2.7.8"``)."""
    if code >= 10000:
        return f"{code // 10000}.{(code % 10000) // 100}.{code % 100}"
    return f"{code // 1000}.{(code % 1000) // 100}.{code % 100}"


def _try(fn: Any) -> Any:
    try:
        return fn()
    except Exception:
        return None


def _run_text(cmd: Sequence[str], timeout_s: float = 20.0) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(
            list(cmd), capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def collect_versions() -> dict[str, str | None]:
    """Versions of everything the library stands on (None: missing or unknown)."""
    v: dict[str, str | None] = dict.fromkeys(VERSION_KEYS)
    v["python"] = platform.python_version()
    v["ipc_dpsample"] = __version__
    v["numpy"] = np.__version__
    try:
        import torch

        v["torch"] = str(torch.__version__)
        v["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            nv = _try(torch.cuda.nccl.version)
            if nv is not None:
                v["nccl_torch"] = ".".join(map(str, nv)) if isinstance(nv, tuple) else str(nv)
    except Exception:
        pass
    try:
        import cupy

        v["cupy"] = str(cupy.__version__)
        v["cuda_runtime"] = _try(lambda: _cuda_version(cupy.cuda.runtime.runtimeGetVersion()))
        v["cuda_driver_api"] = _try(lambda: _cuda_version(cupy.cuda.runtime.driverGetVersion()))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from cupy.cuda import nccl

            if getattr(nccl, "available", False) and hasattr(nccl, "get_version"):
                v["nccl_cupy"] = nccl_version_string(int(nccl.get_version()))
    except Exception:
        pass
    v["driver"] = _nvml_driver_version() or _first_line(
        _run_text(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    )
    return v


def _first_line(text: str | None) -> str | None:
    return text.splitlines()[0].strip() if text else None


def _nvml_driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        raw = pynvml.nvmlSystemGetDriverVersion()
        return raw.decode() if isinstance(raw, bytes) else str(raw)
    except Exception:
        return None
    finally:
        _try(pynvml.nvmlShutdown)


def shm_bytes(path: str = "/dev/shm") -> int | None:
    """Size of the shared-memory file system, or None where it is missing."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return int(st.f_blocks * st.f_frsize)


def collect_host() -> dict[str, Any]:
    """Host name, platform, CPUs, boot id, /dev/shm size and a container hint."""
    from ..identity import boot_id

    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count() or 1,
        "boot_id": boot_id(),
        "shm_bytes": shm_bytes(),
        "container": os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv"),
    }


def collect_gpus(machine: Machine) -> dict[str, Any]:
    """CUDA devices: index, name, UUID, compute capability, memory, PCI bus id."""
    from ..identity import gpu_uuid

    error = None
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        error = f"CuPy: {type(exc).__name__}: {exc}"
    devices = []
    n = max(machine.cupy_gpus, machine.torch_gpus)
    for i in range(n):
        devices.append(_describe_gpu(i, gpu_uuid(i) if machine.cupy_gpus else ""))
    return {
        "torch_count": machine.torch_gpus,
        "cupy_count": machine.cupy_gpus,
        "devices": devices,
        "error": error,
    }


def _describe_gpu(index: int, uuid: str) -> dict[str, Any]:
    name, cc, mem, bus = "unknown", "unknown", 0, None
    try:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(index)
        raw = props["name"]
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        cc = f"{props['major']}.{props['minor']}"
        mem = int(props["totalGlobalMem"])
        bus = _try(lambda: str(cupy.cuda.runtime.deviceGetPCIBusId(index)))
    except Exception:
        try:
            import torch

            p = torch.cuda.get_device_properties(index)
            name, cc, mem = p.name, f"{p.major}.{p.minor}", int(p.total_memory)
            if not uuid and getattr(p, "uuid", None) is not None:
                uuid = f"GPU-{p.uuid}"
        except Exception:
            pass
    return {
        "index": index,
        "name": name,
        "uuid": uuid,
        "compute_capability": cc,
        "memory_bytes": mem,
        "pci_bus_id": bus,
    }


# -- P2P: driver and verified -------------------------------------------------------
def driver_p2p_matrix(n: int) -> list[list[bool | None]]:
    """``cudaDeviceCanAccessPeer(a, b)`` for every ordered pair (None on the
    diagonal and where the query fails)."""
    matrix: list[list[bool | None]] = [[None] * n for _ in range(n)]
    try:
        import cupy
    except Exception:
        return matrix
    for a in range(n):
        for b in range(n):
            if a != b:
                matrix[a][b] = _try(
                    lambda a=a, b=b: bool(cupy.cuda.runtime.deviceCanAccessPeer(a, b))
                )
    return matrix


def _pattern(seed: int, a: int, b: int, role: int, words: int) -> np.ndarray:
    rng = np.random.default_rng([seed, a, b, role])
    return rng.integers(1, 2**32, words, dtype=np.uint32)


def _recv(conn: Any, timeout_s: float, what: str) -> tuple[Any, ...]:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"peer did not send '{what}' within {timeout_s:.0f} s")
    msg = conn.recv()
    if msg[0] == "error":
        raise RuntimeError(f"peer failed: {msg[1]}")
    if msg[0] != what:
        raise RuntimeError(f"expected '{what}' from the peer, got {msg[0]!r}")
    return tuple(msg)


def _ipc_pair_child(
    pair: int,
    role: int,
    devices: tuple[int, int],
    conn: Any,
    queue: Any,
    nbytes: int,
    seed: int,
    timeout_s: float,
) -> None:
    """One side of a pair check (spawned process). ``devices = (a, b)``; role 0 runs
    on ``a``, role 1 on ``b``. Each side exports its buffer, writes a pattern into
    the peer's, and checks what the peer wrote into its own."""
    t0 = time.perf_counter()
    dev = devices[role]
    step = "start"
    try:
        import cupy

        rt = cupy.cuda.runtime
        step = "cudaSetDevice"
        rt.setDevice(dev)
        step = "cudaMalloc"
        ptr = rt.malloc(nbytes)
        rt.memset(ptr, 0, nbytes)
        rt.deviceSynchronize()
        step = "cudaIpcGetMemHandle"
        conn.send(("handle", bytes(rt.ipcGetMemHandle(ptr)), os.getpid()))
        step = "handle exchange"
        peer_handle = _recv(conn, timeout_s, "handle")[1]
        step = "cudaIpcOpenMemHandle"
        peer_ptr = rt.ipcOpenMemHandle(peer_handle)
        words = nbytes // 4
        half = words // 2
        local = cupy.asarray(_pattern(seed, *devices, role, words))

        def view(p: int) -> Any:
            mem = cupy.cuda.UnownedMemory(p, nbytes, None, dev)
            return cupy.ndarray((words,), np.uint32, cupy.cuda.MemoryPointer(mem, 0))

        step = "peer write (kernel stores)"
        store = cupy.ElementwiseKernel("uint32 x", "uint32 y", "y = x", "ipc_dpsample_doctor_put")
        store(local[:half], view(peer_ptr)[:half])
        step = "peer write (cudaMemcpy)"
        rt.memcpy(peer_ptr + half * 4, local.data.ptr + half * 4, (words - half) * 4, 3)
        rt.deviceSynchronize()
        conn.send(("written",))
        step = "waiting for the peer's write"
        _recv(conn, timeout_s, "written")
        step = "read-back"
        got = cupy.asnumpy(view(ptr))
        expected = _pattern(seed, *devices, 1 - role, words)
        bad = np.flatnonzero(got != expected)
        detail = ""
        if bad.size:
            part = "kernel-store half" if bad[0] < half else "cudaMemcpy half"
            detail = (
                f"GPU {dev} read back {bad.size} of {words} words wrong written by GPU "
                f"{devices[1 - role]} (first at word {bad[0]}, {part}: got {got[bad[0]]:#x}, "
                f"expected {expected[bad[0]]:#x})"
            )
        conn.send(("checked",))
        _recv(conn, timeout_s, "checked")
        step = "cudaIpcCloseMemHandle"
        rt.ipcCloseMemHandle(peer_ptr)
        conn.send(("closed",))
        _recv(conn, timeout_s, "closed")  # the peer unmapped our buffer: free it
        rt.free(ptr)
        queue.put((pair, role, not detail, detail, time.perf_counter() - t0))
    except BaseException as exc:
        text = f"GPU {dev} at {step}: {type(exc).__name__}: {exc}"
        try:
            conn.send(("error", text))
        except Exception:
            pass
        queue.put((pair, role, False, text, time.perf_counter() - t0))


def verify_ipc_pairs(
    n: int,
    *,
    nbytes: int = _IPC_BYTES,
    timeout_s: float = 60.0,
    parallel: int = 4,
    seed: int = 1,
) -> list[dict[str, Any]]:
    """Check CUDA IPC write/read-back for every GPU pair ``a <= b`` with two spawned
    processes per pair, ``parallel`` pairs at a time.

    Returns
    -------
    list of dict
        ``a``, ``b``, ``verified`` (both directions read back right), ``detail``
        (the first failure) and ``seconds``; ``driver`` is filled in by the caller.
    """
    ctx = mp.get_context("spawn")
    pairs = [(a, b) for a in range(n) for b in range(a, n)]
    out: list[dict[str, Any]] = []
    for start in range(0, len(pairs), max(1, parallel)):
        batch = pairs[start : start + max(1, parallel)]
        queue = ctx.Queue()
        procs = []
        for k, (a, b) in enumerate(batch):
            ends = ctx.Pipe()
            for role in (0, 1):
                p = ctx.Process(
                    target=_ipc_pair_child,
                    args=(k, role, (a, b), ends[role], queue, nbytes, seed, timeout_s),
                    daemon=True,
                )
                p.start()
                procs.append(p)
        reports: dict[tuple[int, int], tuple[bool, str, float]] = {}
        deadline = time.monotonic() + timeout_s + 30.0
        while len(reports) < 2 * len(batch) and time.monotonic() < deadline:
            try:
                k, role, ok, detail, secs = queue.get(timeout=1.0)
            except Exception:
                if not any(p.is_alive() for p in procs):
                    break
                continue
            reports[(k, role)] = (ok, detail, secs)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
        for k, (a, b) in enumerate(batch):
            sides = [reports.get((k, r)) for r in (0, 1)]
            details = [
                s[1] if s is not None else f"GPU {(a, b)[r]}: no report (crashed or timed out)"
                for r, s in enumerate(sides)
                if s is None or not s[0]
            ]
            out.append(
                {
                    "a": a,
                    "b": b,
                    "driver": None,
                    "verified": not details,
                    "detail": "; ".join(details),
                    "seconds": round(max((s[2] for s in sides if s is not None), default=0.0), 3),
                }
            )
    return out


def collect_p2p(n: int) -> dict[str, Any]:
    """Driver matrix plus the verified pair checks for ``n`` GPUs."""
    driver = driver_p2p_matrix(n)
    if n == 0:
        return {"driver": [], "verified": [], "pairs": [], "skipped": "no GPU CuPy can drive"}
    pairs = verify_ipc_pairs(n)
    verified: list[list[bool | None]] = [[None] * n for _ in range(n)]
    for p in pairs:
        p["driver"] = driver[p["a"]][p["b"]]
        verified[p["a"]][p["b"]] = verified[p["b"]][p["a"]] = p["verified"]
    return {"driver": driver, "verified": verified, "pairs": pairs, "skipped": None}


# -- topology -----------------------------------------------------------------------
_ANCESTORS = {0: "same board", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


def collect_topology(cuda_uuids: Sequence[str]) -> dict[str, Any]:
    """NVLink state from NVML (when ``pynvml`` loads) and ``nvidia-smi topo -m``."""
    topo: dict[str, Any] = {"source": "none", "gpus": [], "pairs": [], "text": None, "detail": ""}
    notes = []
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:
        notes.append(f"NVML unavailable ({type(exc).__name__}: {exc})")
    else:
        try:
            topo["gpus"], topo["pairs"] = _nvml_topology(pynvml, list(cuda_uuids))
            topo["source"] = "nvml"
        except Exception as exc:
            notes.append(f"NVML query failed ({type(exc).__name__}: {exc})")
        finally:
            _try(pynvml.nvmlShutdown)
    text = _run_text(["nvidia-smi", "topo", "-m"])
    if text is not None:
        topo["text"] = text
        if topo["source"] == "none":
            topo["source"] = "nvidia-smi"
    elif shutil.which("nvidia-smi") is None:
        notes.append("nvidia-smi not found")
    else:
        notes.append("nvidia-smi topo -m failed")
    topo["detail"] = "; ".join(notes)
    return topo


def _nvml_topology(
    nv: Any, cuda_uuids: list[str]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    def text(raw: Any) -> str:
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    count = nv.nvmlDeviceGetCount()
    handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    gpus = []
    for i, h in enumerate(handles):
        uuid = text(nv.nvmlDeviceGetUUID(h))
        active: int | None = None
        version: int | None = None
        for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                state = nv.nvmlDeviceGetNvLinkState(h, link)
            except Exception:
                continue
            active = (active or 0) + (1 if state == nv.NVML_FEATURE_ENABLED else 0)
            if state == nv.NVML_FEATURE_ENABLED and version is None:
                version = _try(lambda h=h, link=link: int(nv.nvmlDeviceGetNvLinkVersion(h, link)))
        gpus.append(
            {
                "nvml_index": i,
                "cuda_index": cuda_uuids.index(uuid) if uuid in cuda_uuids else None,
                "uuid": uuid,
                "name": text(nv.nvmlDeviceGetName(h)),
                "nvlink_active": active,
                "nvlink_version": version,
            }
        )
    pairs = []
    caps = getattr(nv, "NVML_P2P_CAPS_INDEX_NVLINK", None)
    for a in range(count):
        for b in range(a + 1, count):
            level = _try(
                lambda a=a, b=b: nv.nvmlDeviceGetTopologyCommonAncestor(handles[a], handles[b])
            )
            nvlink = None
            if caps is not None:
                status = _try(
                    lambda a=a, b=b: nv.nvmlDeviceGetP2PStatus(handles[a], handles[b], caps)
                )
                if status is not None:
                    nvlink = status == nv.NVML_P2P_STATUS_OK
            pairs.append(
                {
                    "a": a,
                    "b": b,
                    "ancestor": None if level is None else _ANCESTORS.get(int(level), str(level)),
                    "nvlink_p2p": nvlink,
                }
            )
    return gpus, pairs


# -- hazards ------------------------------------------------------------------------
def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() not in ("", "0", "false", "no", "off")


def find_hazards(
    *,
    env: Mapping[str, str],
    shm: int | None,
    gpus: Mapping[str, Any],
    p2p: Mapping[str, Any],
    backends: Mapping[str, Mapping[str, Any]],
) -> list[dict[str, str]]:
    """Known hazards, from the environment and the facts collected (pure).

    Severities: ``error`` breaks the fast path on a GPU machine (the verdict
    fails), ``warning`` degrades it or breaks neighbours, ``info`` is context.
    """
    out: list[dict[str, str]] = []

    def add(id_: str, severity: str, message: str, fix: str) -> None:
        out.append({"id": id_, "severity": severity, "message": message, "fix": fix})

    n_gpus = max(int(gpus["torch_count"]), int(gpus["cupy_count"]))
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        conf = env.get(var, "").replace(" ", "").lower()
        if "expandable_segments:true" in conf:
            add(
                "expandable-segments",
                "warning",
                f"{var} enables expandable_segments: such torch allocations cannot be "
                "exported through CUDA IPC (ipc_dpsample's own cudaMalloc arena is "
                "unaffected; torch symmetric memory and IPC-based all-reduce are not)",
                f"unset {var} or set expandable_segments:False",
            )
    if _truthy(env.get("NCCL_P2P_DISABLE")):
        add(
            "nccl-p2p-disable",
            "warning",
            f"NCCL_P2P_DISABLE={env.get('NCCL_P2P_DISABLE')}: auto will not use the one-sided "
            "backend and NCCL avoids NVLink peer-to-peer",
            "unset NCCL_P2P_DISABLE unless peer-to-peer is broken on purpose",
        )
    if shm is None:
        add(
            "no-dev-shm",
            "warning",
            "/dev/shm is missing: NCCL's shared-memory transport and torch multiprocessing fail",
            "mount a tmpfs at /dev/shm (docker: --ipc=host or --shm-size=16g)",
        )
    elif shm < SHM_MIN_BYTES:
        add(
            "small-dev-shm",
            "warning",
            f"/dev/shm is only {shm / 2**20:.0f} MiB (a container's private IPC namespace with "
            "the default size): NCCL's shared-memory transport can fail",
            "run the container with --ipc=host (or --shm-size=16g)",
        )
    if int(gpus["torch_count"]) > 0 and int(gpus["cupy_count"]) == 0:
        add(
            "cupy-no-gpu",
            "error",
            f"torch sees {gpus['torch_count']} GPU(s) but CuPy cannot drive them "
            f"({gpus.get('error') or 'no detail'}): the one-sided and NCCL backends cannot run",
            "install the CuPy wheel matching the driver's CUDA (cupy-cuda12x or cupy-cuda13x)",
        )
    elif int(gpus["cupy_count"]) > 0 and int(gpus["torch_count"]) == 0:
        add(
            "torch-no-cuda",
            "warning",
            f"CuPy sees {gpus['cupy_count']} GPU(s) but torch has no CUDA (a CPU build?)",
            "install a CUDA build of torch",
        )
    elif int(gpus["torch_count"]) != int(gpus["cupy_count"]):
        add(
            "gpu-count-mismatch",
            "warning",
            f"torch sees {gpus['torch_count']} GPUs, CuPy {gpus['cupy_count']}",
            "check CUDA_VISIBLE_DEVICES and that both use the same driver",
        )
    for pair in p2p.get("pairs", []):
        if pair["verified"]:
            continue
        a, b = pair["a"], pair["b"]
        expected = a == b or pair["driver"] is not False
        add(
            f"ipc-failed-{a}-{b}",
            "error" if expected else "warning",
            f"CUDA IPC write/read-back between processes on GPU {a} and GPU {b} failed: "
            f"{pair['detail']}"
            + ("" if expected else " (the driver reports no peer access for this pair)"),
            "run containers with --ipc=host --pid=host (or share the IPC namespace), make "
            "every process see the same GPUs, check nvidia-smi topo -m and the driver log",
        )
    if n_gpus > 0:
        for name, what in (("onesided", "the one-sided backend"), ("nccl", "the NCCL backend")):
            info = backends.get(name, {})
            if not info.get("importable", False):
                add(
                    f"{name}-unavailable",
                    "warning",
                    f"{what} is unavailable here: {info.get('error') or 'unknown reason'}",
                    "install the missing dependency (cupy-cuda12x/13x, nvidia-nccl-cu12/13)",
                )
    if env.get("IPC_DPSAMPLE_BACKEND"):
        add(
            "backend-override",
            "info",
            f"IPC_DPSAMPLE_BACKEND={env['IPC_DPSAMPLE_BACKEND']} overrides every "
            "communicator's backend argument",
            "unset it to let auto choose",
        )
    if env.get("CUDA_VISIBLE_DEVICES") is not None:
        add(
            "cuda-visible-devices",
            "info",
            f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}: only these GPUs are checked",
            "unset it to check every GPU",
        )
    return out


# -- selection ----------------------------------------------------------------------
def selection_facts(report: Mapping[str, Any], env: Mapping[str, str]) -> tuple[Any, str]:
    """The :class:`~ipc_dpsample.select.Facts` of a group made of every local GPU
    (or one CPU rank), from the collected report; and a note on the request."""
    from ..config import BACKENDS
    from ..select import Facts

    note = ""
    requested = (env.get("IPC_DPSAMPLE_BACKEND") or "auto").strip().lower()
    if requested not in BACKENDS:
        note = f"IPC_DPSAMPLE_BACKEND={requested!r} is invalid (expected one of {BACKENDS})"
        requested = "auto"
    gpus = report["gpus"]
    n = int(gpus["torch_count"]) or int(gpus["cupy_count"])
    p2p = report["p2p"]
    off_diag = [
        (a, b, ok)
        for a, row in enumerate(p2p["driver"])
        for b, ok in enumerate(row)
        if a != b and ok is not None
    ]
    bad = [(a, b) for a, b, ok in off_diag if not ok]
    pairs = p2p["pairs"]
    failed = [p for p in pairs if not p["verified"]]
    facts = Facts(
        requested=requested,  # type: ignore[arg-type]
        device_kind="cuda" if n > 0 else "cpu",
        tp_size=max(1, n),
        cupy_gpu=int(gpus["cupy_count"]) > 0,
        nccl_available=report["versions"]["nccl_cupy"] is not None,
        p2p_ok=(not bad) if off_diag or n == 1 else None,
        p2p_detail=f"GPU {bad[0][0]} -> GPU {bad[0][1]}" if bad else "",
        nccl_p2p_disable=_truthy(env.get("NCCL_P2P_DISABLE")),
        has_torch_group=True,
        ipc_verified=(not failed) if pairs else None,
        ipc_detail=failed[0]["detail"] if failed else "",
    )
    return facts, note


def collect_selection(report: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """What ``backend="auto"`` (or ``IPC_DPSAMPLE_BACKEND``) would choose, and why."""
    from ..errors import BackendUnavailableError
    from ..select import select_backend

    facts, note = selection_facts(report, env)
    try:
        backend, reason = select_backend(facts)
    except BackendUnavailableError as exc:
        backend, reason = None, str(exc)
    if backend in ("onesided", "nccl") and not report["backends"][backend]["importable"]:
        extra = (
            f"but ipc_dpsample.backends.{backend} does not import "
            f"({report['backends'][backend]['error']})"
        )
        note = f"{note}; {extra}" if note else extra
    return {
        "requested": facts.requested,
        "backend": backend,
        "reason": reason,
        "note": note,
        "facts": dataclasses.asdict(facts),
    }


# -- self-tests ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SelfTest:
    """One planned self-test: a tiny demo plan, or the reason it cannot run."""

    name: str
    backend: str
    device: str
    ranks: int
    launch: str
    plan: DemoPlan | None
    skip: str = ""


def _tiny(world: int, launch: str, device: str, backend: str, vocab_per_rank: int) -> DemoPlan:
    # Odd V/tp (tails of vector stores), bf16 (2-byte elements), fresh data per round.
    return DemoPlan(
        world=world,
        launch=launch,  # type: ignore[arg-type]
        device=device,  # type: ignore[arg-type]
        backend=backend,
        pad_bs=4 * world,
        num_tokens=3,
        vocab=vocab_per_rank * world,
        dtype="bfloat16",
        iters=3,
        rounds=2,
        note=f"self-test {backend} on {device}",
    )


def plan_selftests(machine: Machine) -> list[SelfTest]:
    """Self-tests for this machine (pure).

    Always: the torch backend over gloo with 2 spawned CPU ranks. With GPUs: the
    one-sided backend with 4 in-process ranks on GPU 0, the NCCL backend with
    tp=1, the torch backend on CUDA (1 or 2 processes) and, with two or more GPUs,
    ``auto`` with one process per GPU.
    """
    tests = [
        SelfTest(
            "torch-cpu-gloo",
            "torch",
            "cpu",
            2,
            "processes",
            _tiny(2, "processes", "cpu", "torch", 501),
        )
    ]
    gpus = machine.gpus
    if gpus == 0:
        return tests
    no_cupy = "" if machine.cupy_gpus > 0 else "CuPy cannot drive the GPU"
    skip = no_cupy or ("" if machine.onesided else f"does not import: {machine.onesided_error}")
    tests.append(
        SelfTest(
            "onesided-threads",
            "onesided",
            "cuda",
            4,
            "threads",
            None if skip else _tiny(4, "threads", "cuda", "onesided", 1025),
            skip,
        )
    )
    skip = no_cupy or ("" if machine.nccl_backend else f"unavailable: {machine.nccl_error}")
    tests.append(
        SelfTest(
            "nccl-tp1",
            "nccl",
            "cuda",
            1,
            "threads",
            None if skip else _tiny(1, "threads", "cuda", "nccl", 1025),
            skip,
        )
    )
    world = min(2, gpus)
    tests.append(
        SelfTest(
            "torch-cuda",
            "torch",
            "cuda",
            world,
            "processes",
            _tiny(world, "processes", "cuda", "torch", 1025),
        )
    )
    if gpus >= 2:
        tests.append(
            SelfTest(
                "auto-all-gpus",
                "auto",
                "cuda",
                gpus,
                "processes",
                _tiny(gpus, "processes", "cuda", "auto", 1025),
            )
        )
    return tests


def run_selftest(test: SelfTest, *, timeout_s: float = 180.0) -> dict[str, Any]:
    """Run one self-test; never raises."""
    from ..testing import RankFailure

    entry: dict[str, Any] = {
        "name": test.name,
        "backend": test.backend,
        "resolved": None,
        "device": test.device,
        "ranks": test.ranks,
        "launch": test.launch,
        "status": "skipped",
        "detail": test.skip,
        "seconds": 0.0,
    }
    if test.plan is None:
        return entry
    t0 = time.perf_counter()
    try:
        results = run_demo(test.plan, timeout_s=timeout_s)
    except RankFailure as exc:
        entry.update(status="failed", detail=_tail(str(exc)))
    except Exception as exc:
        entry.update(status="failed", detail=f"{type(exc).__name__}: {exc}")
    else:
        bad = mismatches(results)
        entry["resolved"] = results[0]["backend"]
        checks = sum(rec["checks"] for res in results for rec in res["ops"].values())
        if bad:
            entry.update(status="failed", detail=f"{len(bad)} wrong outputs; " + bad[0])
        else:
            entry.update(
                status="passed",
                detail=f"{checks} outputs bit-exact ({results[0]['explain']})",
            )
    entry["seconds"] = round(time.perf_counter() - t0, 2)
    return entry


def _tail(text: str, lines: int = 12, chars: int = 2000) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])[-chars:]


# -- verdict ------------------------------------------------------------------------
def verdict(report: Mapping[str, Any]) -> tuple[bool, str]:
    """The verdict on a report (pure: reads ``gpus``, ``p2p``, ``hazards``,
    ``selection`` and ``selftests``).

    Rules
    -----
    1. Any self-test that ran and failed, or any hazard of severity ``error``
       (e.g. a CUDA IPC pair that the driver calls peer-capable failed its
       write/read-back, or CuPy cannot drive the GPUs torch sees): unhealthy.
    2. No GPU (torch and CuPy both count 0): healthy for the CPU path exactly when
       the torch-over-gloo CPU self-test passed.
    3. With GPUs: healthy exactly when, in addition, ``auto`` resolves to a backend
       and at least one GPU self-test passed. Skipped self-tests and warnings do not
       fail the verdict; they are listed in the report.

    Returns
    -------
    (ok, text)
        ``text`` starts with ``HEALTHY``, ``HEALTHY (CPU path)`` or ``UNHEALTHY``.
    """
    tests = list(report["selftests"])
    problems = [f"self-test {t['name']} failed" for t in tests if t["status"] == "failed"]
    problems += [h["message"] for h in report["hazards"] if h["severity"] == "error"]
    warns = sum(1 for h in report["hazards"] if h["severity"] == "warning")
    passed = [t for t in tests if t["status"] == "passed"]
    ran = [t for t in tests if t["status"] != "skipped"]
    gpus = max(int(report["gpus"]["torch_count"]), int(report["gpus"]["cupy_count"]))
    suffix = f" ({warns} warning{'s' if warns != 1 else ''})" if warns else ""
    sel = report["selection"]
    if gpus == 0:
        if not any(t["device"] == "cpu" for t in passed):
            problems.append("the CPU self-test (torch backend over gloo) did not pass")
        if problems:
            return False, "UNHEALTHY: " + "; ".join(problems)
        return True, (
            "HEALTHY (CPU path): no CUDA GPU found; the torch backend over gloo passed "
            f"its self-test, auto chooses {sel['backend']}{suffix}"
        )
    if sel["backend"] is None:
        problems.append(f"no backend can run ({sel['reason']})")
    if not any(t["device"] == "cuda" for t in passed):
        problems.append("no GPU self-test passed")
    if problems:
        return False, "UNHEALTHY: " + "; ".join(problems)
    pairs = report["p2p"]["pairs"]
    good = sum(1 for p in pairs if p["verified"])
    return True, (
        f"HEALTHY: {gpus} GPU{'s' if gpus != 1 else ''}, CUDA IPC verified on "
        f"{good}/{len(pairs)} pairs, auto chooses {sel['backend']}, "
        f"{len(passed)}/{len(ran)} self-tests passed{suffix}"
    )


def _level(ok: bool, report: Mapping[str, Any]) -> str:
    if not ok:
        return "unhealthy"
    gpus = max(int(report["gpus"]["torch_count"]), int(report["gpus"]["cupy_count"]))
    return "healthy" if gpus > 0 else "healthy-cpu"


# -- collect ------------------------------------------------------------------------
def collect(*, env: Mapping[str, str] | None = None, progress: Any = None) -> dict[str, Any]:
    """Gather the whole report (spawns processes for the IPC and self-tests).

    Parameters
    ----------
    env : mapping or None
        Environment to judge (default: ``os.environ``).
    progress : callable(str) or None
        Called with the name of each step as it starts.
    """
    env = dict(os.environ if env is None else env)
    say = progress or (lambda _step: None)
    say("versions")
    machine = detect_machine()
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "tool": TOOL,
        "generated_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "verdict": {"ok": False, "level": "unhealthy", "text": ""},
        "host": collect_host(),
        "versions": collect_versions(),
    }
    say("GPUs")
    report["gpus"] = collect_gpus(machine)
    say("peer-to-peer and CUDA IPC")
    report["p2p"] = collect_p2p(machine.cupy_gpus)
    say("topology")
    report["topology"] = collect_topology([d["uuid"] for d in report["gpus"]["devices"]])
    report["backends"] = {
        "onesided": {"importable": machine.onesided, "error": machine.onesided_error},
        "nccl": {"importable": machine.nccl_backend, "error": machine.nccl_error},
    }
    report["hazards"] = find_hazards(
        env=env,
        shm=report["host"]["shm_bytes"],
        gpus=report["gpus"],
        p2p=report["p2p"],
        backends=report["backends"],
    )
    report["selection"] = collect_selection(report, env)
    report["selftests"] = []
    for test in plan_selftests(machine):
        say(f"self-test {test.name}")
        report["selftests"].append(run_selftest(test))
    ok, text = verdict(report)
    report["verdict"] = {"ok": ok, "level": _level(ok, report), "text": text}
    return report


# -- human output -------------------------------------------------------------------
def _mark(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def format_human(report: Mapping[str, Any]) -> str:
    """The report as text, verdict first."""
    v = report["verdict"]
    lines = [f"ipc-dpsample doctor: {v['text']}", ""]
    lines.append("versions")
    width = max(len(k) for k in report["versions"])
    for k, val in report["versions"].items():
        lines.append(f"  {k.ljust(width)}  {val if val is not None else '-'}")
    h = report["host"]
    shm = "-" if h["shm_bytes"] is None else f"{h['shm_bytes'] / 2**30:.1f} GiB"
    lines.append(
        f"host: {h['hostname']}, {h['cpu_count']} CPUs, /dev/shm {shm}"
        + (", in a container" if h["container"] else "")
    )
    g = report["gpus"]
    lines.append("")
    lines.append(f"GPUs (torch sees {g['torch_count']}, CuPy {g['cupy_count']})")
    if not g["devices"]:
        lines.append(f"  none{' - ' + g['error'] if g['error'] else ''}")
    for d in g["devices"]:
        lines.append(
            f"  {d['index']}: {d['name']} sm_{d['compute_capability'].replace('.', '')} "
            f"{d['memory_bytes'] / 2**30:.0f} GiB {d['uuid'] or '(uuid unknown)'}"
            + (f" bus {d['pci_bus_id']}" if d["pci_bus_id"] else "")
        )
    p = report["p2p"]
    lines.append("")
    if p["skipped"]:
        lines.append(f"P2P: not checked ({p['skipped']})")
    else:
        n = len(p["driver"])
        lines.append("P2P: driver says / CUDA IPC write+read-back between two processes")
        cell = 9
        lines.append("        " + "".join(f"GPU{b}".ljust(cell) for b in range(n)))
        for a in range(n):
            row = "".join(
                f"{_mark(p['driver'][a][b])}/{_mark(p['verified'][a][b])}".ljust(cell)
                for b in range(n)
            )
            lines.append(f"  GPU{a}  {row}")
        for pair in p["pairs"]:
            if not pair["verified"]:
                lines.append(f"  GPU{pair['a']}<->GPU{pair['b']}: {pair['detail']}")
    t = report["topology"]
    lines.append("")
    lines.append(f"topology (source: {t['source']}){': ' + t['detail'] if t['detail'] else ''}")
    for d in t["gpus"]:
        lines.append(
            f"  NVML {d['nvml_index']} (CUDA {d['cuda_index']}): {d['name']}, "
            f"{d['nvlink_active'] if d['nvlink_active'] is not None else 'no'} NVLinks active"
            + (f" (NVLink {d['nvlink_version']})" if d["nvlink_version"] else "")
        )
    if t["text"]:
        lines.extend("  " + line for line in t["text"].splitlines())
    lines.append("")
    lines.append("hazards" + ("" if report["hazards"] else ": none"))
    for hz in report["hazards"]:
        lines.append(f"  [{hz['severity']}] {hz['message']}")
        lines.append(f"      fix: {hz['fix']}")
    s = report["selection"]
    lines.append("")
    lines.append(
        f"backend {s['requested']} would choose: {s['backend'] or 'nothing'} - {s['reason']}"
        + (f" ({s['note']})" if s["note"] else "")
    )
    lines.append("")
    lines.append("self-tests")
    for st in report["selftests"]:
        where = f"{st['ranks']} rank{'s' if st['ranks'] != 1 else ''} ({st['launch']})"
        lines.append(
            f"  {st['status']:<8}{st['name']:<18}{st['device']:<5}{where:<24}"
            f"{st['seconds']:6.1f} s  {st['detail'].splitlines()[0] if st['detail'] else ''}"
        )
        if st["status"] == "failed" and "\n" in st["detail"]:
            lines.extend("      " + line for line in st["detail"].splitlines()[1:])
    return "\n".join(lines)


# -- command line -------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``ipc-dpsample doctor``."""
    p.add_argument(
        "--json",
        action="store_true",
        help=f"print the report as JSON (schema_version {SCHEMA_VERSION}, see doctor.SCHEMA)",
    )


def run(ns: argparse.Namespace) -> int:
    """Run ``ipc-dpsample doctor``; 0 when healthy, 1 otherwise."""

    def progress(step: str) -> None:
        if not ns.json and sys.stderr.isatty():
            print(f"  checking {step}...", file=sys.stderr)

    report = collect(progress=progress)
    if ns.json:
        print(json.dumps(report, indent=2, sort_keys=False))
    else:
        print(format_human(report))
    return 0 if report["verdict"]["ok"] else 1

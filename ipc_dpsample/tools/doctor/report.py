"""The doctor report's shape and its reading: the JSON :data:`SCHEMA` with a small
validator (:func:`validate`), the :func:`verdict` on a report, and the text form
(:func:`format_human`). Everything here is pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "TOOL",
    "VERSION_KEYS",
    "format_human",
    "level",
    "validate",
    "verdict",
]

SCHEMA_VERSION = 1
TOOL = "ipc-dpsample doctor"
VERSION_KEYS = (
    "python",
    "ipc_dpsample",
    "ipc_dpsample_commit",
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


def level(ok: bool, report: Mapping[str, Any]) -> str:
    if not ok:
        return "unhealthy"
    gpus = max(int(report["gpus"]["torch_count"]), int(report["gpus"]["cupy_count"]))
    return "healthy" if gpus > 0 else "healthy-cpu"


# -- human output -------------------------------------------------------------------
def _gpu_line(d: dict[str, Any]) -> str:
    """One GPU of the report's ``gpus.devices``."""
    bus = f" bus {d['pci_bus_id']}" if d["pci_bus_id"] else ""
    memory = f"{d['memory_bytes'] / 2**30:.0f} GiB"
    cc = d["compute_capability"].replace(".", "")
    return f"  {d['index']}: {d['name']} sm_{cc} {memory} {d['uuid'] or '(uuid unknown)'}{bus}"


def _nvml_line(d: dict[str, Any]) -> str:
    """One GPU of the report's ``topology.gpus``."""
    links = "no" if d["nvlink_active"] is None else d["nvlink_active"]
    version = f" (NVLink {d['nvlink_version']})" if d["nvlink_version"] else ""
    where = f"NVML {d['nvml_index']} (CUDA {d['cuda_index']})"
    return f"  {where}: {d['name']}, {links} NVLinks active{version}"


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
    lines.extend(_gpu_line(d) for d in g["devices"])
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
    lines.extend(_nvml_line(d) for d in t["gpus"])
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

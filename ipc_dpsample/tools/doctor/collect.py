"""Gathering the doctor's report: versions, host, GPUs, topology, self-tests, and
:func:`collect`, which runs every step (spawning processes for the CUDA IPC pair
checks and the self-tests) and adds the hazards, selection and verdict.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import re
import shutil
import socket
import subprocess
import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..._version import __version__, package_commit
from ..common import VERIFY, DemoPlan, Machine, detect_machine
from ..demo import mismatches, run_demo, unavailable
from .hazards import collect_selection, find_hazards
from .p2p import collect_p2p
from .report import SCHEMA_VERSION, TOOL, VERSION_KEYS, level, verdict

__all__ = [
    "SelfTest",
    "collect",
    "collect_gpus",
    "collect_host",
    "collect_topology",
    "collect_versions",
    "nccl_version_string",
    "plan_selftests",
    "run_selftest",
    "shm_bytes",
    "verify_detail",
]


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


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _run_text(cmd: Sequence[str], timeout_s: float = 20.0) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(
            list(cmd), capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    text = _ANSI.sub("", out.stdout).strip()  # nvidia-smi underlines headers with escapes
    return text if out.returncode == 0 and text else None


def collect_versions() -> dict[str, str | None]:
    """Versions of everything the library stands on (None: missing or unknown)."""
    v: dict[str, str | None] = dict.fromkeys(VERSION_KEYS)
    v["python"] = platform.python_version()
    v["ipc_dpsample"] = __version__
    v["ipc_dpsample_commit"] = package_commit()
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
    from ...identity import boot_id

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
    from ...identity import gpu_uuid

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
    from ...testing import RankFailure

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
                detail=f"{checks} outputs bit-exact, {verify_detail(results)} "
                f"({results[0]['explain']})",
            )
    entry["seconds"] = round(time.perf_counter() - t0, 2)
    return entry


def verify_detail(results: Sequence[dict[str, Any]]) -> str:
    """What a self-test's demo results say about ``verify_batch_vocab``: how many of its
    outputs were checked, or that the backend lacks it ("not available on <backend> in
    this version", which does not fail the self-test)."""
    missing = unavailable(results, VERIFY)
    if missing:
        return f"{VERIFY} {missing}"
    checks = sum(res["ops"][VERIFY]["checks"] for res in results)
    return f"{checks} of them {VERIFY}'s (sampled, with accepted and rejected drafts)"


def _tail(text: str, lines: int = 12, chars: int = 2000) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])[-chars:]


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
    report["verdict"] = {"ok": ok, "level": level(ok, report), "text": text}
    return report

"""Backend choice as a pure function of facts gathered from every rank.

``select_backend(facts)`` returns ``(backend, reason)`` or raises
:class:`~ipc_dpsample.errors.BackendUnavailableError` when an explicitly requested
backend cannot run. Nothing here touches a GPU or the network, so every
combination is tested on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .config import BackendName, PeerRecord, RequestedBackend, gpu_digest
from .errors import BackendUnavailableError

__all__ = ["Facts", "combine", "gpu_sharing_ranks", "onesided_blockers", "select_backend"]


@dataclass(frozen=True)
class Facts:
    """What every rank found, already combined across the group.

    Attributes
    ----------
    requested : {"auto", "onesided", "nccl", "torch"}
    device_kind : {"cpu", "cuda"}
    tp_size : int
    hosts : int
        Distinct host ids in the group.
    boots : int
        Distinct (host id, boot id) pairs.
    cupy_gpu : bool
        CuPy drives the GPU on every rank.
    nccl_available : bool
        ``cupy.cuda.nccl`` loads on every rank.
    p2p_ok : bool or None
        Every pair of ranks' GPUs is P2P-capable or the same device; None where a
        peer's GPU is not visible to query (then the IPC check decides).
    p2p_detail : str
        The first failing pair, if any.
    nccl_p2p_disable : bool
        ``NCCL_P2P_DISABLE`` is set to a true value on some rank.
    has_torch_group : bool
        The group has a torch.distributed process group.
    ipc_verified : bool or None
        The IPC open and write/read-back check succeeded on every rank; None when
        it was not attempted.
    ipc_detail : str
        Why the IPC check failed (rank and cause).
    gpu_sharing_ranks : int
        Ranks that share a GPU with a lower rank (same host, boot and GPU UUID).
        NCCL refuses two ranks on one GPU, so any such rank rules NCCL out.
    """

    requested: RequestedBackend
    device_kind: str
    tp_size: int = 1
    hosts: int = 1
    boots: int = 1
    cupy_gpu: bool = True
    nccl_available: bool = True
    p2p_ok: bool | None = True
    p2p_detail: str = ""
    nccl_p2p_disable: bool = False
    has_torch_group: bool = True
    ipc_verified: bool | None = None
    ipc_detail: str = ""
    gpu_sharing_ranks: int = 0


def _p2p(records: Sequence[PeerRecord]) -> tuple[bool | None, str]:
    """Every pair of ranks' GPUs P2P-capable (or the same GPU)? False names the first
    pair a rank sees but cannot reach; None when some rank cannot see a peer's GPU."""
    unknown = ""
    for i, a in enumerate(records):
        for j, b in enumerate(records):
            if i == j or not b.gpu_uuid or b.gpu_uuid == a.gpu_uuid or a.host_id != b.host_id:
                continue
            d = gpu_digest(b.gpu_uuid)
            if d in a.reach:
                continue
            if d in a.visible:
                return False, f"rank {i}'s GPU {a.gpu_uuid} cannot access rank {j}'s {b.gpu_uuid}"
            unknown = unknown or f"rank {i} cannot see rank {j}'s GPU {b.gpu_uuid}"
    return (None, unknown) if unknown else (True, "")


def gpu_sharing_ranks(records: Sequence[PeerRecord]) -> int:
    """Ranks whose (host, boot, GPU UUID) a lower rank already has; ranks whose GPU
    UUID is unknown ("") are not counted (no evidence that they share)."""
    known = [(r.host_id, r.boot_id, r.gpu_uuid) for r in records if r.gpu_uuid]
    return len(known) - len(set(known))


def combine(
    records: Sequence[PeerRecord],
    *,
    requested: RequestedBackend,
    device_kind: str,
    has_torch_group: bool,
    ipc_verified: bool | None = None,
    ipc_detail: str = "",
) -> Facts:
    """The group's :class:`Facts` from every rank's record (pure: every rank computes
    the same facts from the same records; the doctor uses it too)."""
    cuda = device_kind == "cuda"
    p2p_ok, p2p_detail = _p2p(records) if cuda else (None, "")
    return Facts(
        requested=requested,
        device_kind=device_kind,
        tp_size=len(records),
        hosts=len({r.host_id for r in records}),
        boots=len({(r.host_id, r.boot_id) for r in records}),
        cupy_gpu=cuda and all(r.cupy_gpu for r in records),
        nccl_available=cuda and all(r.nccl for r in records),
        p2p_ok=p2p_ok,
        p2p_detail=p2p_detail,
        nccl_p2p_disable=any(r.nccl_p2p_disable for r in records),
        has_torch_group=has_torch_group,
        ipc_verified=ipc_verified,
        ipc_detail=ipc_detail,
        gpu_sharing_ranks=gpu_sharing_ranks(records) if cuda else 0,
    )


def onesided_blockers(f: Facts) -> list[str]:
    """Reasons, known before any IPC handle is opened, why the one-sided backend
    cannot run. Empty means: try the IPC check."""
    reasons = []
    if f.device_kind != "cuda":
        reasons.append("the data is on the CPU (one-sided needs CUDA arrays)")
    if not f.cupy_gpu:
        reasons.append("CuPy cannot drive a GPU on every rank")
    if f.hosts > 1:
        reasons.append(f"the ranks span {f.hosts} hosts (CUDA IPC works within one host)")
    elif f.boots > 1:
        reasons.append("the ranks report different boot ids (different machines or containers)")
    if f.nccl_p2p_disable:
        reasons.append("NCCL_P2P_DISABLE is set (peer-to-peer is disabled on purpose)")
    if f.p2p_ok is False:
        reasons.append(f"a pair of GPUs cannot access each other peer-to-peer ({f.p2p_detail})")
    return reasons


def _nccl_blockers(f: Facts) -> list[str]:
    reasons = []
    if f.device_kind != "cuda":
        reasons.append("the data is on the CPU (NCCL needs CUDA arrays)")
    if not f.cupy_gpu:
        reasons.append("CuPy cannot drive a GPU on every rank")
    if not f.nccl_available:
        reasons.append("cupy.cuda.nccl is not available (install NCCL, e.g. nvidia-nccl-cu12)")
    if f.device_kind == "cuda" and f.gpu_sharing_ranks:
        reasons.append(
            f"{f.gpu_sharing_ranks} rank(s) share a GPU with another rank (NCCL refuses two "
            "ranks on one GPU)"
        )
    return reasons


def select_backend(f: Facts) -> tuple[BackendName, str]:
    """Choose the backend.

    Returns
    -------
    (backend, reason)
        ``backend`` is ``"onesided"``, ``"nccl"`` or ``"torch"``; ``reason`` is one
        human sentence.

    Raises
    ------
    BackendUnavailableError
        The requested backend cannot run; the message says why and how to fall back.
    """
    blockers = onesided_blockers(f)
    if f.ipc_verified is False:
        blockers.append(f"the CUDA IPC check failed ({f.ipc_detail})")
    nccl_blockers = _nccl_blockers(f)
    torch_blockers = [] if f.has_torch_group else ["the group has no torch.distributed group"]

    if f.requested == "onesided":
        if blockers:
            raise BackendUnavailableError(
                "backend='onesided' cannot run: " + "; ".join(blockers) + ". Fall back with "
                "backend='auto' (or IPC_DPSAMPLE_BACKEND=auto), or 'nccl' for CUDA data"
            )
        if f.ipc_verified is None:
            raise BackendUnavailableError(
                "backend='onesided' cannot be chosen before the IPC check ran"
            )
        return "onesided", "requested explicitly; CUDA IPC verified on every rank"
    if f.requested == "nccl":
        if nccl_blockers:
            raise BackendUnavailableError(
                "backend='nccl' cannot run: " + "; ".join(nccl_blockers) + ". Fall back with "
                "backend='torch' (torch.distributed) or backend='auto'"
            )
        return "nccl", "requested explicitly"
    if f.requested == "torch":
        if torch_blockers:
            raise BackendUnavailableError(
                "backend='torch' cannot run: " + "; ".join(torch_blockers) + ". Initialise "
                "torch.distributed (ipc_dpsample.launch.init_distributed) or use backend='auto'"
            )
        return "torch", "requested explicitly"

    # auto
    if f.device_kind != "cuda":
        if torch_blockers:
            raise BackendUnavailableError("no backend for CPU data: " + "; ".join(torch_blockers))
        return "torch", "the data is on the CPU: torch.distributed (gloo) moves it"
    if not blockers and f.ipc_verified:
        where = "one GPU" if f.tp_size == 1 else f"{f.tp_size} ranks on one host"
        return "onesided", f"{where}, peer access and CUDA IPC verified on every rank"
    why = "; ".join(blockers) if blockers else "the CUDA IPC check did not run"
    if not nccl_blockers:
        return "nccl", f"one-sided is unavailable: {why}"
    if not torch_blockers:
        return "torch", (
            f"one-sided is unavailable: {why}; NCCL via CuPy is unavailable: "
            + "; ".join(nccl_blockers)
        )
    raise BackendUnavailableError(
        "no backend can run: one-sided: "
        + why
        + "; nccl: "
        + "; ".join(nccl_blockers)
        + "; torch: "
        + "; ".join(torch_blockers)
    )

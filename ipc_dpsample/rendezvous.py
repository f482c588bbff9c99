"""Construction as one rendezvous: every rank's configuration, identity, local facts
and (where the fast path may run) IPC record travel in ONE host all-gather; the
facts are combined by a pure function; the backend is built from them.

Host all-gathers per construction: one-sided 3 (records; open+probe status; read-
back verdict), NCCL 3 (records; unique id; init status), torch 1 (+ the process
group the torch backend creates on the store).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from . import envs
from ._version import __version__
from .backends.base import Backend
from .config import (
    BACKENDS,
    RECORD_SIZE,
    BackendName,
    CommConfig,
    PeerRecord,
    check_agreement,
    pack_record,
)
from .config import unpack_record as _unpack_config
from .errors import BackendUnavailableError, DpSampleError
from .group import HostGroup
from .identity import boot_id, cupy_device_count, gpu_uuid, host_id, nccl_available, p2p_digests
from .ipc import IPC_RECORD_SIZE, IpcRecord, pack_ipc_record, unpack_ipc_record
from .select import Facts, combine, onesided_blockers, select_backend

__all__ = ["Built", "build_backend", "setup_timeout"]

#: Set-up waits at least this long for a peer, whatever ``timeout_s`` the ops use:
#: ranks reach the constructor at different times (a spawned rank imports torch in
#: 2-5 s on a loaded 2-core box), and on a GPU a peer's first CUDA context, NVRTC
#: compile and arena allocation take up to ~20 s on a cold machine.
MIN_SETUP_TIMEOUT_S = {"cpu": 10.0, "cuda": 30.0}


def setup_timeout(timeout_s: float, device_kind: str) -> float:
    """How long set-up waits for a peer: ``timeout_s``, at least the floor of
    :data:`MIN_SETUP_TIMEOUT_S` for the device kind."""
    return max(MIN_SETUP_TIMEOUT_S[device_kind], timeout_s)


@dataclass
class Built:
    """What construction produced."""

    name: BackendName
    reason: str
    backend: Backend
    records: list[PeerRecord]


def _as_int(v: Any) -> int:
    ok = isinstance(v, int) and not isinstance(v, bool) and -(2**31) <= v < 2**31
    return int(v) if ok else -1


def local_record(
    raw: dict[str, Any], dtype: str | None, backend: str, device: int, error: str
) -> PeerRecord:
    """This rank's record: its arguments (``-1`` where invalid), identity and facts."""
    cuda = device >= 0
    visible, reach = p2p_digests(device) if cuda else ((), ())
    try:
        graph_swap = envs.get("IPC_DPSAMPLE_GRAPH_SWAP")
        p2p_disable = bool(envs.get("NCCL_P2P_DISABLE"))
    except ValueError as exc:
        graph_swap, p2p_disable = "barrier", False
        error = error or f"ValueError: {exc}"
    return PeerRecord(
        tp_size=_as_int(raw["tp_size"]),
        rank=_as_int(raw["rank"]),
        max_pad_bs=_as_int(raw["max_pad_bs"]),
        num_tokens_per_req=_as_int(raw["num_tokens_per_req"]),
        vocab_size=_as_int(raw["vocab_size"]),
        logits_dtype=dtype if dtype in ("bfloat16", "float16", "float32") else None,
        backend=backend if backend in BACKENDS else "auto",
        device_kind="cuda" if cuda else "cpu",
        version=__version__,
        pid=os.getpid(),
        host_id=host_id(),
        boot_id=boot_id(),
        gpu_uuid=gpu_uuid(device),
        error=error,
        graph_swap=graph_swap,
        cupy_gpu=cuda and cupy_device_count() > 0,
        nccl=cuda and nccl_available(),
        nccl_p2p_disable=p2p_disable,
        visible=visible,
        reach=reach,
    )


def exchange(
    group: HostGroup, mine: PeerRecord, ipc: IpcRecord | None, timeout_s: float
) -> tuple[list[PeerRecord], list[IpcRecord | None]]:
    """All-gather 1: every rank's config record followed by its IPC record (or
    nothing)."""
    payload = pack_record(mine) + (b"" if ipc is None else pack_ipc_record(ipc))
    gathered = group.all_gather_bytes(payload, timeout_s=timeout_s, what="rank records")
    n = RECORD_SIZE
    records = [_unpack_config(item[:n]) for item in gathered]
    ipcs: list[IpcRecord | None] = []
    for item in gathered:
        rest = item[n:]
        ipcs.append(unpack_ipc_record(rest) if len(rest) == IPC_RECORD_SIZE else None)
    return records, ipcs


def build_backend(
    cfg: CommConfig,
    group: HostGroup,
    device: int,
    raw: dict[str, Any],
    local_error: Exception | None,
    make_other: Callable[[BackendName, list[PeerRecord]], Backend],
) -> Built:
    """Run the rendezvous and build the backend (collective).

    ``local_error`` is this rank's argument error: it still takes part in the
    exchange, so every rank raises instead of leaving peers waiting.
    ``make_other(name, records)`` builds the NCCL or torch backend.
    """
    from .backends import onesided

    error = "" if local_error is None else f"{type(local_error).__name__}: {local_error}"
    valid = local_error is None
    dtype = cfg.logits_dtype if valid else None
    requested = cfg.backend if valid else "auto"
    mine = local_record(raw, dtype, requested, device if valid else -1, error)
    timeout = setup_timeout(cfg.timeout_s if valid else 30.0, mine.device_kind)
    has_torch = hasattr(group, "process_group")
    facts_local = combine(
        [mine], requested=requested, device_kind=mine.device_kind, has_torch_group=has_torch
    )
    arena, ipc, tuning = None, None, None
    if valid and device >= 0 and requested in ("auto", "onesided"):
        if not onesided_blockers(facts_local):
            try:
                tuning = envs.onesided_tuning()
            except ValueError as exc:
                local_error = exc
                mine = local_record(raw, dtype, requested, device, f"ValueError: {exc}")
            else:
                arena, ipc = onesided.prepare_arena(cfg, device, mine, tuning.compile_options)
    try:
        records, ipcs = exchange(group, mine, ipc, timeout)
    except BaseException:
        if arena is not None:
            arena.free()  # nobody opened it: the exchange is where peers would learn it
        raise
    if local_error is not None:  # this rank's own error; its peers raise a mismatch
        raise local_error
    try:
        check_agreement(records, mine.rank)
    except BaseException:
        if arena is not None:
            arena.free()
        raise
    facts = combine(
        records, requested=requested, device_kind=mine.device_kind, has_torch_group=has_torch
    )
    detail = ""
    if arena is not None:
        if all(p is not None for p in ipcs) and not onesided_blockers(facts):
            peer_ipc: Sequence[IpcRecord] = ipcs  # type: ignore[assignment]
            detail = onesided.failed_peer(peer_ipc)
            if not detail:
                assert tuning is not None
                conn, detail = onesided.connect(
                    cfg, group, device, arena, records, peer_ipc, timeout, tuning.compile_options
                )
                if conn is not None:
                    facts = _with_ipc(facts, True, "")
                    name, reason = select_backend(facts)
                    single = bool(envs.get("IPC_DPSAMPLE_TEST_SINGLE_BUFFER"))
                    backend = onesided.OnesidedBackend(cfg, group, device, conn, tuning, single)
                    return Built(name, reason, backend, records)
                arena = None  # connect tore it down
        else:
            detail = "a peer could not prepare the fast path"
        if arena is not None:
            arena.free()  # every rank decided the same from the same records: none opened
        facts = _with_ipc(facts, False, detail)
        if requested == "auto" and detail:
            warnings.warn(
                f"ipc_dpsample: one-sided backend unavailable, falling back: {detail}",
                RuntimeWarning,
                stacklevel=4,
            )
    name, reason = select_backend(facts)
    if name == "onesided":  # only reachable through a verified connection above
        raise DpSampleError("internal error: one-sided chosen without a verified connection")
    try:
        backend = make_other(name, records)
    except BackendUnavailableError as exc:
        if requested != "auto":
            raise
        raise BackendUnavailableError(
            f"backend='auto' chose {name} ({reason}), but it cannot run: {exc}"
        ) from exc
    return Built(name, reason, backend, records)


def _with_ipc(facts: Facts, verified: bool, detail: str) -> Facts:
    from dataclasses import replace

    return replace(facts, ipc_verified=verified, ipc_detail=detail)

"""Failure diagnosis of the torch backend: after a collective failed (timeout,
reset connection, other c10d error), find out why with a bounded exchange of
failure records through the c10d store, and build the one error that explains it
on every rank (see :mod:`ipc_dpsample.backends.torch.backend`)."""

from __future__ import annotations

import struct
from typing import Any

from ...errors import DpSampleError, PeerTimeoutError
from ...protocol import Call, Op, divergence_message

__all__ = ["REPORT_WAIT_S", "UNUSABLE", "diagnose_failure"]

#: Longest wait for the peers' failure records after a collective failed.
REPORT_WAIT_S = 1.5
_FAIL_RECORD = struct.Struct("<4i")
UNUSABLE = (
    "This communicator is now unusable: every later call raises this error; close it "
    "and build a new one"
)


def diagnose_failure(
    call: Call, exc: BaseException, pg: Any, group: Any, key: str, n: int, timeout_s: float
) -> DpSampleError:
    """The error that explains why ``call`` failed with ``exc`` on this rank.

    Aborts ``pg`` (peers blocked in it fail at once), posts this rank's header to
    the store under ``key`` and waits up to :data:`REPORT_WAIT_S` for the peers':
    a differing header is a divergence, a missing one a stalled or dead peer, a
    peer's verdict naming this rank means it was late.
    """
    try:
        pg.abort()  # peers blocked in this group fail now, not at their timeout
    except Exception:
        pass
    me = group.rank
    try:
        group.post(f"{key}/fail", _FAIL_RECORD.pack(*call.header()))
        records = group.collect(f"{key}/fail", REPORT_WAIT_S)
        missing = [p for p, rec in enumerate(records) if rec is None]
        if missing:
            group.post(f"{key}/gave_up", ",".join(map(str, missing)).encode())
        verdicts = [
            [int(w) for w in v.decode().split(",")] if v else []
            for v in group.collect(f"{key}/gave_up", 0.0)
        ]
    except Exception as store_exc:  # the store is gone: its host exited
        host = group.store_host
        err = PeerTimeoutError(
            f"rank {me}: {call.describe()} failed in torch.distributed "
            f"({type(exc).__name__}: {str(exc)[:200]}) and the c10d store is unreachable "
            f"({type(store_exc).__name__}: {str(store_exc)[:200]}): its host, "
            + (f"rank {host}, most likely exited" if host >= 0 else "global rank 0, exited")
            + f" (torch backend). {UNUSABLE}",
            rank=me,
            peer=host,
            op=Op.describe_code(call.op),
        )
        return err
    err: DpSampleError
    diverged = [
        (p, Call.from_header(_FAIL_RECORD.unpack(rec), n))
        for p, rec in enumerate(records)
        if rec is not None and _FAIL_RECORD.unpack(rec) != call.header()
    ]
    blamed = [p for p, v in enumerate(verdicts) if me in v and p != me]
    if diverged:
        err = DpSampleError(divergence_message(me, diverged[0][0], call, diverged[0][1], "torch"))
    elif missing:
        peer = missing[0]
        err = PeerTimeoutError(
            f"rank {me}: rank{'s' if len(missing) > 1 else ''} "
            f"{', '.join(map(str, missing))} did not take part in {call.describe()} "
            f"within timeout_s={timeout_s:g} s: stalled or exited before the op "
            f"(torch backend; the collective failed with {type(exc).__name__}: "
            f"{str(exc)[:200]}). {UNUSABLE}",
            rank=me,
            peer=peer,
            op=Op.describe_code(call.op),
        )
    elif blamed:
        err = DpSampleError(
            f"rank {me} reached {call.describe()} after rank {blamed[0]} had given up "
            f"waiting for it (timeout_s={timeout_s:g} s): this rank was late "
            f"(torch backend). {UNUSABLE}"
        )
    else:
        err = DpSampleError(
            f"rank {me}: {call.describe()} failed in torch.distributed "
            f"({type(exc).__name__}: {exc}) while every peer took part with the same "
            f"call (torch backend). {UNUSABLE}"
        )
    return err

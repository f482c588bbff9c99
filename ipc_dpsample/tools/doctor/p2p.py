"""Peer-to-peer facts for the doctor: what the driver says for every GPU pair, and
a real CUDA IPC write/read-back between two spawned processes per pair.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np

__all__ = ["collect_p2p", "driver_p2p_matrix", "verify_ipc_pairs"]

_IPC_BYTES = 4 << 20


def driver_p2p_matrix(n: int) -> list[list[bool | None]]:
    """What the driver says (:func:`ipc_dpsample.ipc.p2p_matrix_ok`, i.e.
    ``cudaDeviceCanAccessPeer``) for every ordered pair of the ``n`` GPUs; None on
    the diagonal and where the GPUs cannot be queried."""
    from ...identity import gpu_uuid
    from ...ipc import p2p_matrix_ok

    uuids = [gpu_uuid(d) for d in range(n)]
    return [[None if a == b else p2p_matrix_ok(a, [uuids[b]]) for b in range(n)] for a in range(n)]


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
    on ``a``, role 1 on ``b``. Each side exports its buffer as the library's
    :class:`~ipc_dpsample.ipc.IpcRecord`, opens the peer's with
    :func:`~ipc_dpsample.ipc.open_peer` (as a communicator does), writes a pattern
    into it, and checks what the peer wrote into its own."""
    t0 = time.perf_counter()
    dev = devices[role]
    step = "start"
    try:
        import cupy

        from ...identity import boot_id, gpu_uuid, host_id
        from ...ipc import IpcRecord, close_peer, open_peer, pack_ipc_record, unpack_ipc_record

        rt = cupy.cuda.runtime
        step = "cudaSetDevice"
        rt.setDevice(dev)
        step = "cudaMalloc"
        ptr = rt.malloc(nbytes)
        rt.memset(ptr, 0, nbytes)
        rt.deviceSynchronize()
        step = "cudaIpcGetMemHandle"
        mine = IpcRecord(
            ok=True,
            rank=role,
            handle=bytes(rt.ipcGetMemHandle(ptr)),
            offset=0,
            nbytes=nbytes,
            base_ptr=ptr,
            pid=os.getpid(),
            device=dev,
            host_id=host_id(),
            boot_id=boot_id(),
            gpu_uuid=gpu_uuid(dev),
        )
        conn.send(("record", pack_ipc_record(mine)))
        step = "record exchange"
        peer = unpack_ipc_record(_recv(conn, timeout_s, "record")[1])
        step = "cudaIpcOpenMemHandle"
        peer_ptr = open_peer(peer, role, dev)
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
        close_peer(peer_ptr, peer)
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

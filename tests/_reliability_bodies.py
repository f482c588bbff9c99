"""Rank bodies, child processes and the kill-trial launcher of ``test_reliability_gpu.py``.

Module level so that ``spawn`` children (``run_ranks``) and the plain subprocesses of
the kill trials import them by name (``tests/`` is on their ``sys.path``). Nothing
here touches a GPU at import time.

Kill trials (:func:`run_kill_trials`)
-------------------------------------
A dead peer can only be produced by killing a process, and a killed process cannot
take part in another trial, so every trial is a world of its own: ranks 0 and 1
(the survivors) and rank 2 (the victim), three processes sharing the GPU through
CUDA IPC. To keep device time down, the survivors are long-lived: a *pair* of
survivor processes runs its trials one after another, and every trial gets a fresh
victim process, started ahead of time so that its start-up (torch, CUDA context,
kernels) overlaps the previous trial. Several pairs run at once.

The processes meet in a ``torch.distributed.TCPStore`` hosted by the parent (the
pytest process), through :class:`StoreGroup`, a :class:`~ipc_dpsample.group.HostGroup`
over one key prefix per trial; no process group is created, so no rank hosts
anything the others need and the dead rank leaves nothing behind but its arena.

Every child has a hard deadline (``faulthandler.dump_traceback_later(exit=True)``
dumps its stacks and ends it); the parent also kills a pair that makes no progress
within ``trial_deadline_s`` and everything still running at the end.
"""

from __future__ import annotations

import os

# before CUDA initialises: every in-process rank's stream gets its own hardware queue
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")

import collections
import datetime
import faulthandler
import importlib
import json
import random
import signal
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from _gpu_common import all_inputs, all_verify, bits, swap_reference_torch

from ipc_dpsample import DpSampleError, DpSamplingComm, PeerTimeoutError
from ipc_dpsample.layout import reference_gather, reference_swap_batch_vocab

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
ENV_FAIL = "IPC_DPSAMPLE_TEST_FAIL_IPC"

#: op short names of the kill trials -> the name PeerTimeoutError.op carries
OP_NAMES = {"swap": "swap_batch_vocab", "gather": "gather_verify_outputs"}
KILL_WORLD, VICTIM = 3, 2
KILL_N, KILL_VS, KILL_DTYPE = 2, 64, "bfloat16"  # N, V/tp, logits dtype of the kill trials
KILL_PAD_BS = 2 * KILL_WORLD
RECOVERY_TIMEOUT_S = 10.0


# -- shared helpers --------------------------------------------------------------------
def sync_poison(comm: Any, group: Any) -> None:
    """Between ops: this rank's stream idle, every rank at the barrier, then every
    output region poisoned (one-sided backend), then every rank past the poison."""
    import torch

    torch.cuda.current_stream().synchronize()
    group.barrier(timeout_s=60, what="test poison")
    comm._backend.poison_for_testing()
    group.barrier(timeout_s=60, what="test poison done")


def prepare_op(op: str, rank: int, tp: int, pad_bs: int, seed: int) -> tuple[tuple, Any]:
    """This rank's CUDA inputs of ``op`` ("swap" or "gather") and a function that
    checks the op's output bit-exactly against the NumPy reference. Every rank
    derives every rank's inputs from ``seed``."""
    import torch

    if op == "swap":
        xs = all_inputs(seed, tp, pad_bs, KILL_N, KILL_VS, KILL_DTYPE)
        args: tuple = (xs[rank].cuda(),)
        ref = reference_swap_batch_vocab(
            [bits(x) for x in xs], tp=tp, num_tokens_per_req=KILL_N, pad_bs=pad_bs
        )[rank]

        def check(out: Any) -> None:
            assert tuple(out.shape) == ref.shape, (tuple(out.shape), ref.shape)
            np.testing.assert_array_equal(bits(out), ref)

    else:
        p, a, ln, _ = all_verify(seed, tp, pad_bs, KILL_N)
        args = (p[rank].cuda(), a[rank].cuda(), ln[rank].cuda())
        refs = [reference_gather(list(v.numpy())) for v in (p, a, ln)]

        def check(out: Any) -> None:
            for got, want in zip(out, refs, strict=True):
                np.testing.assert_array_equal(got.cpu().numpy(), want)

    torch.cuda.current_stream().synchronize()  # inputs in place before any timing
    return args, check


def call_op(comm: Any, op: str, args: tuple, pad_bs: int) -> Any:
    if op == "swap":
        return comm.swap_batch_vocab(*args, pad_bs=pad_bs)
    return comm.gather_verify_outputs(*args, pad_bs=pad_bs)


def run_op(comm: Any, op: str, args: tuple, pad_bs: int) -> Any:
    """Issue, wait for the stream, and raise what the op reported."""
    import torch

    out = call_op(comm, op, args, pad_bs)
    torch.cuda.current_stream().synchronize()
    comm.check()
    return out


def warm_rounds(comm: Any, group: Any, rank: int, tp: int, seed: int) -> None:
    """Swap, gather, swap, gather on every rank, outputs poisoned before and checked
    bit-exactly after each."""
    pad_bs = 2 * tp
    for i, op in enumerate(("swap", "gather", "swap", "gather")):
        sync_poison(comm, group)
        args, check = prepare_op(op, rank, tp, pad_bs, seed + i)
        check(run_op(comm, op, args, pad_bs))


def kill_comm(group: Any, tp: int, rank: int, timeout_s: float) -> DpSamplingComm:
    return DpSamplingComm(
        tp_size=tp,
        rank=rank,
        group=group,
        max_pad_bs=2 * tp,
        num_tokens_per_req=KILL_N,
        vocab_size=KILL_VS * tp,
        logits_dtype=KILL_DTYPE,
        backend="onesided",
        device=0,
        timeout_s=timeout_s,
    )


class StoreGroup:
    """A :class:`~ipc_dpsample.group.HostGroup` of processes over one key prefix of a
    c10d store (the same key scheme as ``TorchStoreGroup``, without a process group).

    Parameters
    ----------
    store : torch.distributed.Store
    prefix : str
        Unique per group instance; every member uses the same one.
    rank, size : int
    """

    def __init__(self, store: Any, prefix: str, rank: int, size: int):
        self._store = store
        self._prefix = prefix
        self._rank = rank
        self._size = size
        self._op = 0

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def same_process(self) -> bool:
        return self._size == 1

    def all_gather_bytes(self, data: bytes, *, timeout_s: float, what: str) -> list[bytes]:
        base = f"{self._prefix}/{self._op}"
        self._op += 1
        self._store.set(f"{base}/{self._rank}", data)
        keys = [f"{base}/{r}" for r in range(self._size)]
        try:
            self._store.wait(keys, datetime.timedelta(seconds=timeout_s))
        except Exception as exc:
            missing = [r for r, k in enumerate(keys) if not self._store.check([k])]
            raise DpSampleError(
                f"rank {self._rank}: ranks {missing} of {self._prefix} did not join "
                f"'{what}' within {timeout_s:.1f} s ({str(exc)[:120]})"
            ) from None
        return [bytes(self._store.get(k)) for k in keys]

    def barrier(self, *, timeout_s: float, what: str) -> None:
        self.all_gather_bytes(b"", timeout_s=timeout_s, what=what)


# -- kill trials: the child side -------------------------------------------------------
KILL_ARGS_ENV = "IPC_DPSAMPLE_KILL_TRIAL_ARGS"
_CHILD_CMD = "import _reliability_bodies as b; b.kill_trial_main()"


def _survivor_trial(store: Any, job: dict[str, Any], rank: int, timeout_s: float) -> dict:
    """One trial as rank 0 or 1: warm the communicator up with the victim, issue the
    op the victim dies in, expect PeerTimeoutError naming it within the bound, close
    the broken communicator, build a new one with the other survivor and check it."""
    t, op = job["trial"], job["op"]
    rec: dict[str, Any] = {}
    world = StoreGroup(store, f"kt/{t}/w", rank, KILL_WORLD)
    comm = kill_comm(world, KILL_WORLD, rank, timeout_s)
    assert comm.backend == "onesided", comm.explain()
    warm_rounds(comm, world, rank, KILL_WORLD, seed=1000 * t)
    sync_poison(comm, world)
    args, check = prepare_op(op, rank, KILL_WORLD, KILL_PAD_BS, 1000 * t + 50)
    args_next, _ = prepare_op(op, rank, KILL_WORLD, KILL_PAD_BS, 1000 * t + 51)
    world.barrier(timeout_s=60, what="before the kill")

    err: PeerTimeoutError | None = None
    t0 = time.monotonic()
    try:
        out = run_op(comm, op, args, KILL_PAD_BS)
    except PeerTimeoutError as exc:
        err, rec["elapsed_s"], rec["raised_at"] = exc, time.monotonic() - t0, "k"
    rec["op_k_completed"] = err is None
    if err is None:
        # the victim issued this op before it died and its kernel delivered: then the
        # data must be exact (a partial delivery must be an error, never wrong data)
        check(out)
    survivors = StoreGroup(store, f"kt/{t}/s", rank, KILL_WORLD - 1)
    flags = survivors.all_gather_bytes(
        b"0" if err is None else b"1", timeout_s=60, what="outcome of the op the victim died in"
    )
    # a survivor whose communicator broke no longer issues ops: it is as absent as the victim
    absent = [VICTIM] + [r for r, f in enumerate(flags) if f == b"1"]
    rec["acceptable_peers"] = absent
    if err is None:
        t0 = time.monotonic()
        try:
            run_op(comm, op, args_next, KILL_PAD_BS)
        except PeerTimeoutError as exc:
            err, rec["elapsed_s"], rec["raised_at"] = exc, time.monotonic() - t0, "k+1"
    rec["raised"] = err is not None
    if err is not None:
        rec.update(peer=err.peer, err_rank=err.rank, err_op=err.op, message=str(err))
        # sticky: every later call raises the same error
        try:
            comm.check()
            rec["sticky"] = False
        except PeerTimeoutError:
            rec["sticky"] = True

    # closing the broken communicator must return (its teardown barriers time out)
    t1 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm.close()
    rec["close_s"] = time.monotonic() - t1
    rec["close_warnings"] = [str(w.message)[:160] for w in caught]

    # recovery: a new communicator among the survivors, checked bit-exactly
    new = kill_comm(survivors, KILL_WORLD - 1, rank, RECOVERY_TIMEOUT_S)
    try:
        assert new.backend == "onesided", new.explain()
        warm_rounds(new, survivors, rank, KILL_WORLD - 1, seed=1000 * t + 70)
    finally:
        new.close()
    rec["recovered"] = True
    return rec


def _victim(store: Any, job: dict[str, Any], timeout_s: float) -> None:
    """Rank 2: take part in the warm-up, then die by SIGKILL in the op (``skip``: at
    the moment the others issue it; ``issue``: right after issuing it, before
    synchronising)."""
    t, op, mode = job["trial"], job["op"], job["mode"]
    world = StoreGroup(store, f"kt/{t}/w", VICTIM, KILL_WORLD)
    comm = kill_comm(world, KILL_WORLD, VICTIM, timeout_s)
    warm_rounds(comm, world, VICTIM, KILL_WORLD, seed=1000 * t)
    sync_poison(comm, world)
    args, _ = prepare_op(op, VICTIM, KILL_WORLD, KILL_PAD_BS, 1000 * t + 50)
    world.barrier(timeout_s=60, what="before the kill")
    if mode == "issue":
        call_op(comm, op, args, KILL_PAD_BS)
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # not reached


def kill_trial_main() -> None:
    """Entry point of a kill-trial child; its arguments are JSON in $KILL_ARGS_ENV."""
    args = json.loads(os.environ[KILL_ARGS_ENV])
    faulthandler.dump_traceback_later(args["deadline_s"], exit=True)
    impl = importlib.import_module(args.get("impl") or __name__)
    out = Path(args["out"])
    try:
        import torch
        import torch.distributed as dist

        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        store = dist.TCPStore(
            "127.0.0.1",
            int(args["port"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=60),
        )
    except BaseException:
        out.with_suffix(".startup-error").write_text(traceback.format_exc())
        os._exit(4)
    if args["role"] == "victim":
        try:
            impl._victim(store, args["job"], args["timeout_s"])
            out.write_text(json.dumps({"error": "the victim returned instead of dying"}))
        except BaseException:
            out.write_text(json.dumps({"error": traceback.format_exc()}))
        sys.stdout.flush()
        os._exit(3)  # a victim that gets here did not die as planned
    for job in args["jobs"]:
        faulthandler.dump_traceback_later(args["trial_deadline_s"], exit=True)
        rec: dict[str, Any] = {"trial": job["trial"], "rank": args["rank"], "pid": os.getpid()}
        try:
            rec.update(impl._survivor_trial(store, job, args["rank"], args["timeout_s"]))
        except BaseException:
            rec["error"] = traceback.format_exc()
        with out.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        if "error" in rec:
            break  # the partner times out in its next store wait and stops as well
    faulthandler.cancel_dump_traceback_later()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: nothing may hang after the results are out


# -- kill trials: the parent side ------------------------------------------------------
def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(TESTS_DIR), str(REPO_ROOT)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    env.pop(ENV_FAIL, None)
    env.pop("IPC_DPSAMPLE_BACKEND", None)
    return env


def _complete_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except FileNotFoundError:
        return "(no file)"


def run_kill_trials(
    jobs: list[tuple[str, str]],
    *,
    pairs: int,
    timeout_s: float,
    workdir: Path,
    trial_deadline_s: float = 60.0,
    total_deadline_s: float = 400.0,
    ahead: int = 2,
    impl: str | None = None,
) -> dict[str, Any]:
    """Run one kill trial per ``(op, mode)`` in ``jobs`` and collect what happened.

    Returns
    -------
    dict
        ``records[t][rank]``: the survivor's record of trial ``t`` (or absent);
        ``victim_rc[t]``: the victim's exit status (``-SIGKILL`` when it died as
        planned); ``victim_error[t]``; ``hung``: trials of pairs killed for making no
        progress; ``workdir``: where every child's log is.
    """
    import torch.distributed as dist

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=120),
    )
    env = _child_env()
    procs: list[subprocess.Popen] = []
    base = {"port": int(store.port), "timeout_s": timeout_s, "impl": impl}

    def spawn(args: dict[str, Any], log: Path) -> subprocess.Popen:
        with log.open("wb") as f:
            proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD_CMD],
                env={**env, KILL_ARGS_ENV: json.dumps({**base, **args})},
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=str(REPO_ROOT),
            )
        procs.append(proc)
        return proc

    pairs = max(1, min(pairs, len(jobs)))
    state = []
    for p in range(pairs):
        mine = [
            {"trial": t, "op": op, "mode": mode}
            for t, (op, mode) in enumerate(jobs)
            if t % pairs == p
        ]
        survivors = [
            spawn(
                {
                    "role": "survivor",
                    "rank": r,
                    "jobs": mine,
                    "out": str(workdir / f"pair{p}-rank{r}.jsonl"),
                    "trial_deadline_s": trial_deadline_s,
                    "deadline_s": total_deadline_s + 60,
                },
                workdir / f"pair{p}-rank{r}.log",
            )
            for r in (0, 1)
        ]
        state.append(
            {
                "jobs": mine,
                "survivors": survivors,
                "started": 0,
                "done": 0,
                "progress_at": time.monotonic(),
                "finished": False,
                "hung": False,
            }
        )
    victims: dict[int, subprocess.Popen] = {}
    start = time.monotonic()
    try:
        while True:
            now = time.monotonic()
            active = False
            for p, st in enumerate(state):
                if st["finished"]:
                    continue
                active = True
                done = min(_complete_lines(workdir / f"pair{p}-rank{r}.jsonl") for r in (0, 1))
                if done > st["done"]:
                    st["done"], st["progress_at"] = done, now
                # keep `ahead` victims started: the current trial's and the next ones
                while st["started"] < len(st["jobs"]) and st["started"] < st["done"] + ahead:
                    job = st["jobs"][st["started"]]
                    t = job["trial"]
                    victims[t] = spawn(
                        {
                            "role": "victim",
                            "rank": VICTIM,
                            "job": job,
                            "out": str(workdir / f"victim{t}.json"),
                            "deadline_s": 2 * trial_deadline_s + 60,
                        },
                        workdir / f"victim{t}.log",
                    )
                    st["started"] += 1
                if all(s.poll() is not None for s in st["survivors"]):
                    st["finished"] = True
                elif now - st["progress_at"] > trial_deadline_s or now - start > total_deadline_s:
                    st["finished"] = st["hung"] = True
                    for s in st["survivors"]:
                        s.kill()
            if not active:
                break
            time.sleep(0.05)
        for proc in victims.values():
            try:
                proc.wait(timeout=max(1.0, 15.0 - (time.monotonic() - now)))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        del store

    records: dict[int, dict[int, dict]] = collections.defaultdict(dict)
    hung: list[int] = []
    for p, st in enumerate(state):
        for r in (0, 1):
            path = workdir / f"pair{p}-rank{r}.jsonl"
            if path.exists():
                for line in path.read_text().splitlines():
                    if line.strip():
                        rec = json.loads(line)
                        records[rec["trial"]][r] = rec
        if st["hung"]:
            hung += [j["trial"] for j in st["jobs"] if len(records.get(j["trial"], {})) < 2]
    victim_error = {}
    for t in victims:
        path = workdir / f"victim{t}.json"
        if path.exists():
            victim_error[t] = json.loads(path.read_text()).get("error", "")
        start_err = path.with_suffix(".startup-error")
        if start_err.exists():  # exit status 4: torch, CUDA or the store failed first
            victim_error[t] = "start-up error:\n" + start_err.read_text()
    return {
        "jobs": jobs,
        "records": dict(records),
        "victim_rc": {t: proc.returncode for t, proc in victims.items()},
        "victim_error": victim_error,
        "survivor_rc": {
            (p, r): st["survivors"][r].returncode for p, st in enumerate(state) for r in (0, 1)
        },
        "hung": sorted(hung),
        "pairs": pairs,
        "workdir": str(workdir),
        "wall_s": time.monotonic() - start,
    }


# -- stall shorter than the timeout (threads) ------------------------------------------


def _make_inputs(kind: str, rank: int, tp: int, n: int, vs: int, dtype: str, seed: int):
    """This rank's inputs of op ``kind`` ("swap", "gather", "logprobs") made on the
    current stream, and the expected output on the device (torch)."""
    pad_bs = 2 * tp
    if kind == "swap":
        xs = all_inputs(seed, tp, pad_bs, n, vs, dtype, device="cuda")
        return (xs[rank].contiguous(),), swap_reference_torch(xs, rank, tp, pad_bs, n)
    p, a, ln, lp = all_verify(seed, tp, pad_bs, n, device="cuda")
    if kind == "gather":
        args = (p[rank].contiguous(), a[rank].contiguous(), ln[rank].contiguous())
        return args, (p.reshape(-1, n), a.reshape(-1, n), ln.reshape(-1))
    return (lp[rank].contiguous(),), lp.reshape(-1, n)


def _issue(comm: Any, kind: str, args: tuple, pad_bs: int) -> Any:
    if kind == "swap":
        return comm.swap_batch_vocab(*args, pad_bs=pad_bs)
    if kind == "gather":
        return comm.gather_verify_outputs(*args, pad_bs=pad_bs)
    return comm.gather_verify_logprobs(*args, pad_bs=pad_bs)


def _same(out: Any, ref: Any) -> bool:
    import torch

    if isinstance(out, tuple):
        return all(torch.equal(o, r) for o, r in zip(out, ref, strict=True))
    return torch.equal(out, ref)


# -- stall shorter than the timeout (threads) ------------------------------------------
STALL_PLAN = (("swap", 1), ("gather", 2), ("logprobs", 0), ("swap", 0))


def stall_body(rank: int, tp: int, group: Any, timeout_s: float) -> list[float]:
    """Before each op one rank (the staller) sleeps ``timeout_s / 2`` on the host;
    the others have issued already and their kernels wait for it. Every op must
    complete without an error and bit-exactly. Returns, per op, how long this rank
    waited from issuing to the end of its stream."""
    import torch

    torch.cuda.set_device(0)
    n, vs, pad_bs = 3, 48, 2 * tp
    stream = torch.cuda.Stream()
    waited = []
    with torch.cuda.stream(stream):
        # every input exists before the first op: nothing allocates between ops
        plan = [
            _make_inputs(kind, rank, tp, n, vs, "float16", 500 + i)
            for i, (kind, _) in enumerate(STALL_PLAN)
        ]
        stream.synchronize()
        comm = DpSamplingComm(
            tp_size=tp,
            rank=rank,
            group=group,
            max_pad_bs=2 * tp,
            num_tokens_per_req=n,
            vocab_size=vs * tp,
            logits_dtype="float16",
            backend="onesided",
            device=0,
            timeout_s=timeout_s,
        )
        try:
            assert comm.backend == "onesided", comm.explain()
            for i, ((kind, staller), (args, ref)) in enumerate(zip(STALL_PLAN, plan, strict=True)):
                sync_poison(comm, group)
                if rank == staller:
                    time.sleep(timeout_s / 2)
                t0 = time.monotonic()
                out = _issue(comm, kind, args, pad_bs)
                # every rank has issued before anyone blocks on the GPU (run_threads rule)
                group.barrier(timeout_s=60, what=f"stall op {i} issued")
                stream.synchronize()
                waited.append(time.monotonic() - t0)
                comm.check()
                assert _same(out, ref), f"op {i} ({kind}, rank {staller} stalled): wrong data"
        finally:
            stream.synchronize()
            group.barrier(timeout_s=60, what="before close")
            comm.close()
    return waited


# -- IPC failure injection (processes sharing the GPU, run_ranks) ----------------------
CAUSES = {
    "open": "injected IPC open failure on rank 1",
    "verify": "rank 1: write/read-back through CUDA IPC failed",
}
#: (injected stage, how the communicator is asked for)
INJECTION_CASES = (
    ("none", "auto"),  # control: without the injection auto picks one-sided
    ("open", "onesided"),
    ("verify", "onesided"),
    ("open", "auto-no-nccl"),
    ("verify", "auto-no-nccl"),
    ("open", "auto"),
    ("verify", "auto"),
)


def check_all_ops(comm: Any, rank: int, tp: int, seed: int, poison_group: Any = None) -> bool:
    """Two rounds of swap, gather_verify_outputs and gather_verify_logprobs with fresh
    data, each output compared bit-exactly with the reference (raises otherwise)."""
    import torch

    n, vs = 2, 40
    pad_bs = 2 * tp
    for it in range(2):
        if poison_group is not None:
            sync_poison(comm, poison_group)
        xs = all_inputs(seed + it, tp, pad_bs, n, vs, "bfloat16")
        y = comm.swap_batch_vocab(xs[rank].cuda(), pad_bs=pad_bs)
        torch.cuda.current_stream().synchronize()
        comm.check()
        ref = reference_swap_batch_vocab(
            [bits(x) for x in xs], tp=tp, num_tokens_per_req=n, pad_bs=pad_bs
        )[rank]
        np.testing.assert_array_equal(bits(y), ref)
        p, a, ln, lp = all_verify(seed + 10 + it, tp, pad_bs, n)
        outs = comm.gather_verify_outputs(
            p[rank].cuda(), a[rank].cuda(), ln[rank].cuda(), pad_bs=pad_bs
        )
        torch.cuda.current_stream().synchronize()
        comm.check()
        for got, want in zip(outs, (p, a, ln), strict=True):
            np.testing.assert_array_equal(got.cpu().numpy(), reference_gather(list(want.numpy())))
        olp = comm.gather_verify_logprobs(lp[rank].cuda(), pad_bs=pad_bs)
        torch.cuda.current_stream().synchronize()
        comm.check()
        np.testing.assert_array_equal(bits(olp), bits(lp.reshape(-1, n)))
    return True


def ipc_injection_body(rank: int, tp: int, group: Any) -> dict[str, dict[str, Any]]:
    """Every case of :data:`INJECTION_CASES` in turn: the outcome on this rank (the
    backend, ``explain()``, the library's warnings, whether every op was exact; or
    the error type and message)."""
    import torch

    import ipc_dpsample.rendezvous as comm_module  # where the facts are collected
    from ipc_dpsample.group import TorchStoreGroup

    torch.cuda.set_device(0)
    host = TorchStoreGroup(None)  # the test's own barriers and outcome exchange
    real_nccl_available = comm_module.nccl_available
    results: dict[str, dict[str, Any]] = {}
    for i, (stage, mode) in enumerate(INJECTION_CASES):
        key = f"{stage}/{mode}"
        rec: dict[str, Any] = {}
        if stage != "none":
            os.environ[ENV_FAIL] = f"{stage}:1"
        if mode == "auto-no-nccl":
            # a host without NCCL: NCCL refuses several ranks on one GPU anyway, so
            # here the only fallback that can run is torch.distributed (gloo)
            comm_module.nccl_available = lambda: False
        comm = None
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                t0 = time.monotonic()
                try:
                    comm = DpSamplingComm(
                        tp_size=tp,
                        rank=rank,
                        group=None,
                        max_pad_bs=2 * tp,
                        num_tokens_per_req=2,
                        vocab_size=40 * tp,
                        logits_dtype="bfloat16",
                        backend="onesided" if mode == "onesided" else "auto",
                        device=0,
                        timeout_s=20.0,
                    )
                except DpSampleError as exc:
                    rec["error_type"] = type(exc).__name__
                    rec["error"] = str(exc)
                rec["construct_s"] = time.monotonic() - t0
            rec["warnings"] = [
                f"{w.category.__name__}: {w.message}"
                for w in caught
                if "ipc_dpsample" in str(w.message)
            ]
        finally:
            os.environ.pop(ENV_FAIL, None)
            comm_module.nccl_available = real_nccl_available
        # the ranks must agree before any op: a split outcome would leave a peer waiting
        outcome = comm.backend if comm is not None else "error"
        rec["outcomes"] = [
            b.decode()
            for b in host.all_gather_bytes(outcome.encode(), timeout_s=60, what=f"{key} outcome")
        ]
        if comm is not None:
            try:
                rec["backend"] = comm.backend
                rec["explain"] = comm.explain()
                if len(set(rec["outcomes"])) == 1:
                    poison = host if comm.backend == "onesided" else None
                    rec["ops_exact"] = check_all_ops(comm, rank, tp, 100 * i, poison)
            finally:
                comm.close()
        results[key] = rec
        host.barrier(timeout_s=60, what=f"after {key}")
    return results


# -- create/use/close cycles across processes (run_ranks) ------------------------------
class CudaCallCounter:
    """Counts the CUDA runtime calls that own the one-sided backend's resources, by
    wrapping them on the ``cupy.cuda.runtime`` module the library calls them through
    (``ipc.py`` and ``backends/onesided/arena.py`` look them up at call time): IPC mappings
    (``ipcOpenMemHandle``/``ipcCloseMemHandle``), arenas (``malloc``/``free``: CuPy's
    and torch's allocators do not go through these module attributes) and the
    host-mapped error blocks (``hostAlloc``/``freeHost``). ``live`` holds what is
    open now, so a leak of any of them shows after ``close()``."""

    PAIRS = (
        ("ipcOpenMemHandle", "ipcCloseMemHandle", "ipc"),
        ("malloc", "free", "arena"),
        ("hostAlloc", "freeHost", "host"),
    )

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.live: dict[str, set[int]] = {kind: set() for _, _, kind in self.PAIRS}
        self._saved: dict[str, Any] = {}

    def install(self) -> None:
        from cupy.cuda import runtime

        for opener, closer, kind in self.PAIRS:
            self._saved[opener] = getattr(runtime, opener)
            self._saved[closer] = getattr(runtime, closer)
            setattr(runtime, opener, self._open(self._saved[opener], opener, kind))
            setattr(runtime, closer, self._close(self._saved[closer], closer, kind))

    def uninstall(self) -> None:
        from cupy.cuda import runtime

        for name, fn in self._saved.items():
            setattr(runtime, name, fn)

    def _open(self, fn: Any, name: str, kind: str) -> Any:
        def wrapper(*args: Any) -> Any:
            ptr = fn(*args)
            self.counts[name] += 1
            self.live[kind].add(int(ptr))
            return ptr

        return wrapper

    def _close(self, fn: Any, name: str, kind: str) -> Any:
        def wrapper(ptr: Any, *args: Any) -> Any:
            result = fn(ptr, *args)
            self.counts[name] += 1
            self.live[kind].discard(int(ptr))
            return result

        return wrapper


def lifecycle_body(rank: int, tp: int, group: Any, cycles: int) -> dict[str, Any]:
    """``cycles + 1`` create / swap (checked) / close cycles; cycle 0 is the warm-up
    baseline. Returns the device's free memory after cycle 0 and after the last
    cycle (both ranks closed and idle), the first cycle that left a resource open,
    and the call counts."""
    import cupy
    import torch

    from ipc_dpsample.group import TorchStoreGroup

    torch.cuda.set_device(0)
    n, vs, pad_bs = 2, 32, 2 * tp
    host = TorchStoreGroup(None)
    counter = CudaCallCounter()
    free: list[int] = []
    first_leak = None
    counter.install()
    try:
        for c in range(cycles + 1):
            comm = DpSamplingComm(
                tp_size=tp,
                rank=rank,
                group=None,
                max_pad_bs=2 * tp,
                num_tokens_per_req=n,
                vocab_size=vs * tp,
                logits_dtype="bfloat16",
                backend="onesided",
                device=0,
                timeout_s=20.0,
            )
            try:
                xs = all_inputs(c, tp, pad_bs, n, vs, "bfloat16")
                y = comm.swap_batch_vocab(xs[rank].cuda(), pad_bs=pad_bs)
                torch.cuda.current_stream().synchronize()
                comm.check()
                ref = reference_swap_batch_vocab(
                    [bits(x) for x in xs], tp=tp, num_tokens_per_req=n, pad_bs=pad_bs
                )[rank]
                np.testing.assert_array_equal(bits(y), ref)
                del y
            finally:
                comm.close()
            live = {kind: len(ptrs) for kind, ptrs in counter.live.items()}
            if first_leak is None and any(live.values()):
                first_leak = (c, live)
            if c in (0, cycles):
                cupy.cuda.runtime.deviceSynchronize()
                host.barrier(timeout_s=60, what=f"cycle {c} closed everywhere")
                free.append(int(cupy.cuda.runtime.memGetInfo()[0]))
                host.barrier(timeout_s=60, what=f"cycle {c} measured everywhere")
    finally:
        counter.uninstall()
    return {"free": free, "first_leak": first_leak, "counts": dict(counter.counts)}


# -- two communicators on one thread group (threads) ----------------------------------
# (dtype, N, V/tp) of the two communicators
COMM_A = ("bfloat16", 3, 40)
COMM_B = ("float32", 1, 24)
KINDS = ("swap", "gather", "logprobs")


def _two_comms(group: Any, rank: int, tp: int) -> tuple[DpSamplingComm, DpSamplingComm]:
    made = []
    for dtype, n, vs in (COMM_A, COMM_B):
        made.append(
            DpSamplingComm(
                tp_size=tp,
                rank=rank,
                group=group,
                max_pad_bs=2 * tp,
                num_tokens_per_req=n,
                vocab_size=vs * tp,
                logits_dtype=dtype,
                backend="onesided",
                device=0,
                timeout_s=10.0,
            )
        )
    return made[0], made[1]


def _inputs_for(which: str, i: int, rank: int, tp: int) -> tuple[str, tuple, Any]:
    """Round ``i``'s op kind, inputs and expected output of comm ``which``."""
    dtype, n, vs = COMM_A if which == "a" else COMM_B
    kind = KINDS[i % 3] if which == "a" else KINDS[(i + 1) % 3]
    args, ref = _make_inputs(kind, rank, tp, n, vs, dtype, i if which == "a" else 5000 + i)
    return kind, args, ref


def two_comms_one_stream_body(rank: int, tp: int, group: Any, rounds: int) -> int:
    """Comm A and comm B on one group and one stream per rank, ops interleaved (A, B,
    A, B...; the kinds rotate). A's output is compared after B's op ran, so B's op
    must not touch it. Returns the number of outputs checked."""
    import torch

    torch.cuda.set_device(0)
    stream = torch.cuda.Stream()
    checked = 0
    pad_bs = 2 * tp
    with torch.cuda.stream(stream):
        plan = [
            (_inputs_for("a", i, rank, tp), _inputs_for("b", i, rank, tp)) for i in range(rounds)
        ]
        stream.synchronize()
        a, b = _two_comms(group, rank, tp)
        try:
            for i, ((kind_a, args_a, ref_a), (kind_b, args_b, ref_b)) in enumerate(plan):
                out_a = _issue(a, kind_a, args_a, pad_bs)
                out_b = _issue(b, kind_b, args_b, pad_bs)
                group.barrier(timeout_s=60, what=f"round {i} issued")
                stream.synchronize()
                a.check()
                b.check()
                assert _same(out_a, ref_a), f"round {i}: comm A ({kind_a}) wrong data"
                assert _same(out_b, ref_b), f"round {i}: comm B ({kind_b}) wrong data"
                checked += 2
        finally:
            stream.synchronize()
            group.barrier(timeout_s=60, what="before close")
            a.close()
            b.close()
    return checked


def two_comms_two_streams_body(rank: int, tp: int, group: Any, rounds: int) -> int:
    """Comm A always on stream sA, comm B always on stream sB (per rank); each rank
    issues the two ops of a round in its own random order, so both communicators
    have ops in flight at once, in different orders on different ranks. Every
    output is checked. Returns the number of outputs checked."""
    import torch

    torch.cuda.set_device(0)
    streams = {"a": torch.cuda.Stream(), "b": torch.cuda.Stream()}
    rng = random.Random(77 + 13 * rank)
    pad_bs = 2 * tp
    plan: dict[str, list] = {}
    for which, stream in streams.items():
        with torch.cuda.stream(stream):  # each input made on the stream that reads it
            plan[which] = [_inputs_for(which, i, rank, tp) for i in range(rounds)]
        stream.synchronize()
    comms = dict(zip("ab", _two_comms(group, rank, tp), strict=True))
    checked = 0
    try:
        for i in range(rounds):
            outs = {}
            order = "ab" if rng.random() < 0.5 else "ba"
            for which in order:
                kind, args, _ = plan[which][i]
                with torch.cuda.stream(streams[which]):
                    outs[which] = _issue(comms[which], kind, args, pad_bs)
                if rng.random() < 0.3:
                    time.sleep(0.002)
            # the same step name on every rank: the orders differ on purpose
            group.barrier(timeout_s=60, what=f"round {i} issued")
            for which in "ab":
                streams[which].synchronize()
                comms[which].check()
            for which in "ab":
                kind, _, ref = plan[which][i]
                assert _same(outs[which], ref), f"round {i} ({order}): comm {which} ({kind}) wrong"
                checked += 1
    finally:
        for stream in streams.values():
            stream.synchronize()
        group.barrier(timeout_s=60, what="before close")
        for comm in comms.values():
            comm.close()
    return checked


# -- pad_bs that is not a multiple of tp (threads) -------------------------------------
def pad_multiple_body(rank: int, tp: int, group: Any) -> list[str]:
    """Every rank passes the same bad ``pad_bs`` (in range, not a multiple of tp):
    ValueError on every rank, nothing launched, and a valid op right after works."""
    import pytest
    import torch

    torch.cuda.set_device(0)
    stream = torch.cuda.Stream()
    messages = []
    with torch.cuda.stream(stream):
        comm = kill_comm(group, tp, rank, 10.0)
        try:
            x = torch.ones(3 * KILL_N, KILL_VS, dtype=torch.bfloat16, device="cuda")
            with pytest.raises(ValueError) as info:
                comm.swap_batch_vocab(x, pad_bs=3)
            messages.append(str(info.value))
            z = torch.ones(1, KILL_N, dtype=torch.int32, device="cuda")
            with pytest.raises(ValueError) as info:
                comm.gather_verify_outputs(z, z, z[:, 0].contiguous(), pad_bs=1)
            messages.append(str(info.value))
            with pytest.raises(ValueError) as info:
                comm.gather_verify_logprobs(z.float(), pad_bs=1)
            messages.append(str(info.value))
            group.barrier(timeout_s=60, what="bad pad_bs refused")
            for i, op in enumerate(("swap", "gather")):
                sync_poison(comm, group)
                args, check = prepare_op(op, rank, tp, 2 * tp, 900 + i)
                out = call_op(comm, op, args, 2 * tp)
                group.barrier(timeout_s=60, what="valid op issued")
                stream.synchronize()
                comm.check()
                check(out)
        finally:
            stream.synchronize()
            group.barrier(timeout_s=60, what="before close")
            comm.close()
    return messages

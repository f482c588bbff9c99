"""Backend choice as a pure function of gathered facts, over every combination, plus the
``IPC_DPSAMPLE_BACKEND`` override as a communicator sees it."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest

from ipc_dpsample import BackendUnavailableError, DpSamplingComm, ThreadGroup
from ipc_dpsample.select import Facts, onesided_blockers, select_backend

GOOD_CUDA = Facts(requested="auto", device_kind="cuda", tp_size=4, ipc_verified=True)


def _facts(**kw: Any) -> Facts:
    return dataclasses.replace(GOOD_CUDA, **kw)


def test_all_good_cuda_picks_onesided() -> None:
    assert onesided_blockers(GOOD_CUDA) == []
    name, reason = select_backend(GOOD_CUDA)
    assert name == "onesided"
    assert "4 ranks on one host" in reason
    name, reason = select_backend(_facts(tp_size=1))
    assert (name, "one GPU" in reason) == ("onesided", True)


def test_cpu_data_picks_torch() -> None:
    name, reason = select_backend(Facts(requested="auto", device_kind="cpu"))
    assert name == "torch"
    assert "CPU" in reason


def test_cpu_data_without_torch_group_has_no_backend() -> None:
    with pytest.raises(BackendUnavailableError, match="no backend for CPU data"):
        select_backend(Facts(requested="auto", device_kind="cpu", has_torch_group=False))


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"hosts": 2}, "span 2 hosts"),
        ({"boots": 2}, "different boot ids"),
        ({"nccl_p2p_disable": True}, "NCCL_P2P_DISABLE"),
        ({"p2p_ok": False, "p2p_detail": "GPU 0 <-> GPU 3"}, "GPU 0 <-> GPU 3"),
        ({"ipc_verified": False, "ipc_detail": "rank 2: open failed"}, "rank 2: open failed"),
        ({"ipc_verified": None}, "IPC check did not run"),
    ],
)
def test_onesided_blocker_falls_back_to_nccl_with_reason(kw: dict, why: str) -> None:
    name, reason = select_backend(_facts(**kw))
    assert name == "nccl"
    assert why in reason
    if kw.get("ipc_verified", True) is None:
        return  # an explicit request before the IPC check: test_explicit_requests
    with pytest.raises(BackendUnavailableError, match="onesided") as info:
        select_backend(_facts(requested="onesided", **kw))
    msg = str(info.value)
    assert "backend='auto'" in msg  # says how to fall back
    assert why in msg


def test_no_nccl_falls_back_to_torch_then_to_nothing() -> None:
    name, reason = select_backend(_facts(hosts=2, nccl_available=False))
    assert name == "torch"
    assert "NCCL via CuPy is unavailable" in reason
    with pytest.raises(BackendUnavailableError, match="no backend can run"):
        select_backend(_facts(hosts=2, nccl_available=False, has_torch_group=False))


def test_explicit_requests() -> None:
    assert select_backend(_facts(requested="onesided"))[0] == "onesided"
    assert select_backend(_facts(requested="nccl"))[0] == "nccl"
    assert select_backend(_facts(requested="torch"))[0] == "torch"
    cpu = Facts(requested="nccl", device_kind="cpu")
    with pytest.raises(BackendUnavailableError, match=r"NCCL needs CUDA arrays.*backend='torch'"):
        select_backend(cpu)
    with pytest.raises(BackendUnavailableError, match="nvidia-nccl"):
        select_backend(_facts(requested="nccl", nccl_available=False))
    with pytest.raises(BackendUnavailableError, match="init_distributed"):
        select_backend(_facts(requested="torch", has_torch_group=False))
    with pytest.raises(BackendUnavailableError, match="before the IPC check"):
        select_backend(_facts(requested="onesided", ipc_verified=None))


GRID = list(
    itertools.product(
        ("auto", "onesided", "nccl", "torch"),  # requested
        ("cpu", "cuda"),  # device_kind
        (1, 2),  # hosts
        (True, False),  # cupy_gpu
        (True, False),  # nccl_available
        (True, False, None),  # p2p_ok
        (True, False),  # nccl_p2p_disable
        (True, False),  # has_torch_group
        (True, False, None),  # ipc_verified
    )
)


@pytest.mark.parametrize("chunk", range(8))
def test_every_combination_is_consistent(chunk: int) -> None:
    for combo in GRID[chunk::8]:
        req, dev, hosts, cupy_gpu, nccl, p2p, p2p_off, torch_group, ipc = combo
        f = Facts(
            requested=req,
            device_kind=dev,
            hosts=hosts,
            boots=hosts,
            cupy_gpu=cupy_gpu,
            nccl_available=nccl,
            p2p_ok=p2p,
            nccl_p2p_disable=p2p_off,
            has_torch_group=torch_group,
            ipc_verified=ipc,
        )
        onesided_ok = (
            dev == "cuda"
            and cupy_gpu
            and hosts == 1
            and not p2p_off
            and p2p is not False
            and ipc is True
        )
        nccl_ok = dev == "cuda" and cupy_gpu and nccl
        try:
            name, reason = select_backend(f)
        except BackendUnavailableError as exc:
            assert str(exc), combo
            if req == "onesided":
                assert not onesided_ok, combo
            elif req == "nccl":
                assert not nccl_ok, combo
            elif req == "torch":
                assert not torch_group, combo
            else:
                assert not onesided_ok and not nccl_ok and not torch_group, combo
            continue
        assert reason, combo
        if req != "auto":
            assert name == req, combo
        if name == "onesided":
            assert onesided_ok, combo
        elif name == "nccl":
            assert nccl_ok, combo
            if req == "auto":
                assert not onesided_ok, combo
        else:
            assert name == "torch" and torch_group, combo
            if req == "auto":
                assert not onesided_ok and not nccl_ok, combo
        if req == "auto" and onesided_ok:
            assert name == "onesided", combo


def test_ranks_sharing_a_gpu_rule_out_nccl() -> None:
    # auto: one-sided failed its IPC check, NCCL cannot take two ranks on one GPU
    f = _facts(ipc_verified=False, ipc_detail="rank 1: injected", gpu_sharing_ranks=3)
    name, reason = select_backend(f)
    assert name == "torch"
    assert "injected" in reason and "3 rank(s) share a GPU" in reason
    with pytest.raises(BackendUnavailableError, match="NCCL refuses two ranks on one GPU"):
        select_backend(dataclasses.replace(f, requested="nccl"))
    # one-sided is unaffected: ranks sharing a GPU is what the IPC path supports
    assert select_backend(_facts(gpu_sharing_ranks=3))[0] == "onesided"
    # CPU data: not a fact about GPUs
    assert select_backend(Facts(requested="auto", device_kind="cpu", gpu_sharing_ranks=2))[0] == (
        "torch"
    )


def test_gpu_sharing_ranks_counts_repeated_gpus_only() -> None:
    from types import SimpleNamespace

    from ipc_dpsample.select import gpu_sharing_ranks as _gpu_sharing_ranks

    def rec(host: str, gpu: str) -> Any:
        return SimpleNamespace(host_id=host, boot_id="b", gpu_uuid=gpu)

    assert _gpu_sharing_ranks([rec("h", "GPU-a"), rec("h", "GPU-b")]) == 0
    assert _gpu_sharing_ranks([rec("h", "GPU-a")] * 4) == 3
    assert _gpu_sharing_ranks([rec("h1", "GPU-a"), rec("h2", "GPU-a")]) == 0  # two hosts
    assert _gpu_sharing_ranks([rec("h", ""), rec("h", "")]) == 0  # unknown: no evidence


def test_select_is_pure() -> None:
    f = _facts(hosts=2)
    assert select_backend(f) == select_backend(f)
    assert f == _facts(hosts=2)  # not mutated


# -- the override as the communicator sees it ---------------------------------------------
def _kw() -> dict[str, Any]:
    return {
        "tp_size": 1,
        "rank": 0,
        "max_pad_bs": 2,
        "num_tokens_per_req": 1,
        "vocab_size": 2,
        "logits_dtype": "float32",
        "device": "cpu",
    }


@pytest.mark.parametrize("value", ["mpi", "one-sided", "auto,torch", "1"])
def test_invalid_env_backend_raises_naming_the_variable(
    world1: None, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("IPC_DPSAMPLE_BACKEND", value)
    with pytest.raises(ValueError, match=r"IPC_DPSAMPLE_BACKEND=.*expected one of"):
        DpSamplingComm(**_kw())


@pytest.mark.parametrize("value", ["torch", " Torch ", "AUTO", "", "  "])
def test_env_backend_overrides_argument(
    world1: None, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("IPC_DPSAMPLE_BACKEND", value)
    backend = "auto" if value.strip() == "" else "nccl"  # the env wins over 'nccl'
    with DpSamplingComm(**_kw(), backend=backend) as comm:
        assert comm.backend == "torch"
        assert comm.explain().startswith("torch: ")


@pytest.mark.parametrize("value", ["nccl", "onesided"])
def test_env_backend_that_cannot_run_says_how_to_fall_back(
    world1: None, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("IPC_DPSAMPLE_BACKEND", value)
    with pytest.raises(BackendUnavailableError, match=rf"backend='{value}' cannot run.*Fall back"):
        DpSamplingComm(**_kw())
    monkeypatch.delenv("IPC_DPSAMPLE_BACKEND")
    with DpSamplingComm(**_kw()) as comm:  # a valid construction right after works
        assert comm.backend == "torch"


def test_cpu_thread_group_has_no_backend() -> None:
    (group,) = ThreadGroup.create(1)
    with pytest.raises(BackendUnavailableError, match=r"torch\.distributed"):
        DpSamplingComm(**_kw(), group=group)


def test_construction_is_one_host_all_gather_on_the_torch_path(
    world1: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Construction is one rendezvous: config, identity and facts in one record
    (the one-sided path adds two more rounds, the NCCL path two: counted on the
    H200 by scripts/profile_setup.py)."""
    from ipc_dpsample.group import TorchStoreGroup

    calls: list[str] = []
    real = TorchStoreGroup.all_gather_bytes

    def counting(self: Any, data: bytes, *, timeout_s: float, what: str) -> list[bytes]:
        calls.append(what)
        return real(self, data, timeout_s=timeout_s, what=what)

    monkeypatch.setattr(TorchStoreGroup, "all_gather_bytes", counting)
    with DpSamplingComm(**_kw()) as comm:
        assert comm.backend == "torch"
    assert calls == ["rank records"], calls

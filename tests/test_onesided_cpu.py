"""Pure parts of the one-sided backend: arena layout, signatures, IPC records."""

from __future__ import annotations

import ctypes
import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest

from ipc_dpsample.backends.onesided.contract import (
    ERROR_BLOCK_SIZE,
    MAX_SIG_PAD_BS,
    ArenaOffsets,
    DpDesc,
    DpErrorBlock,
    pack_signature,
    unpack_signature,
)
from ipc_dpsample.config import PeerRecord
from ipc_dpsample.errors import DpSampleError
from ipc_dpsample.ipc import (
    IPC_RECORD_SIZE,
    IpcRecord,
    injected_failure,
    pack_ipc_record,
    unpack_ipc_record,
    validate_peer_record,
)
from ipc_dpsample.protocol import Dtype, Op, divergence_message

KERNELS = Path(__file__).resolve().parent.parent / "kernels"


@pytest.mark.parametrize(
    "tp,max_pad_bs,n,v,itemsize",
    [
        (1, 1, 1, 1, 2),
        (2, 8, 4, 32, 2),
        (3, 12, 1, 39, 4),
        (8, 256, 4, 152064, 4),
        (7, 7, 5, 91, 2),
    ],
)
def test_arena_layout_regions_are_aligned_disjoint_and_large_enough(tp, max_pad_bs, n, v, itemsize):
    lay = ArenaOffsets(tp, max_pad_bs, n, v, itemsize)
    r = max_pad_bs // tp
    regions = [
        ("probe", lay.probe_off, 8 * tp),
        ("flags", lay.flags_off, 2 * tp * 8),
        ("ready", lay.ready_off, 2 * tp * 8),
        ("ll", lay.ll_off, 2 * lay.ll_region_bytes),
        ("swap", lay.swap_off, 2 * lay.swap_region_bytes),
        ("swap_fixed", lay.swap_fixed_off, lay.swap_region_bytes),
        ("predict", lay.out_off("predict"), max_pad_bs * n * 4),
        ("accept_index", lay.out_off("accept_index"), max_pad_bs * n * 4),
        ("accept_length", lay.out_off("accept_length"), max_pad_bs * 4),
        ("logprobs", lay.out_off("logprobs"), max_pad_bs * n * 4),
        ("argmax_ids", lay.out_off("argmax_ids"), r * n * 4),
        ("argmax_logprobs", lay.out_off("argmax_logprobs"), r * n * 4),
        ("verify", lay.verify_off, 2 * tp * r * n * (12 + 2 * 128) * 4),
    ]
    assert lay.probe_off >= 16  # after epoch, counter, broken, the value-error claim
    end = 0
    for name, off, size in regions:
        assert off % 16 == 0, name
        assert off >= end, f"{name} overlaps the previous region"
        end = off + size
    assert end <= lay.total_bytes
    assert lay.total_bytes % (2 << 20) == 0
    # verify outputs need 2N+1 packets per request, argmax partials 3 per row
    assert lay.ll_slots == r * max(2 * n + 1, 3 * n)
    assert lay.ll_region_bytes >= tp * lay.ll_slots * 8
    assert lay.swap_region_bytes >= r * n * v * itemsize
    assert lay.swap_off % 256 == 0 and lay.swap_region_bytes % 256 == 0


# -- the host/device contract: kernels/dp_common.cuh compiled by g++ ----------------------
_PROBE = r"""
#include <cstddef>
#include <cstdio>
#define DP_HOST_PROBE 1
#include "dp_common.cuh"
#define F(S, m) std::printf(#S "." #m " %zu %zu\n", offsetof(S, m), sizeof(((S*)0)->m));
int main() {
  std::printf("DpDesc %zu %zu\n", sizeof(DpDesc), alignof(DpDesc));
  std::printf("DpErrorBlock %zu %zu\n", sizeof(DpErrorBlock), alignof(DpErrorBlock));
  FIELDS
  std::printf("DP_SIG_OP_SHIFT %d\nDP_SIG_PAD_SHIFT %d\nDP_SIG_FIELD_MASK %u\n",
              DP_SIG_OP_SHIFT, DP_SIG_PAD_SHIFT, DP_SIG_FIELD_MASK);
  std::printf("DP_CTRL %d %d %d\nDP_ERR %u %u\n", DP_CTRL_EPOCH, DP_CTRL_COUNTER,
              DP_CTRL_BROKEN, DP_ERR_TIMEOUT, DP_ERR_MISMATCH);
  return 0;
}
"""


@pytest.fixture(scope="module")
def header_probe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """Every offsetof/sizeof of the header's structs and its constants, as g++ sees
    them (the header's plain structs are the same for host and device compilers)."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("needs g++ to compile the kernel header's host probe")
    fields = [
        f"F({cls.__name__}, {name})" for cls in (DpDesc, DpErrorBlock) for name, _ in cls._fields_
    ]
    work = tmp_path_factory.mktemp("dp_common_probe")
    (work / "probe.cpp").write_text(_PROBE.replace("FIELDS", "\n  ".join(fields)))
    exe = work / "probe"
    cmd = [gxx, "-std=c++17", "-Wall", "-Werror", "-I", str(KERNELS), str(work / "probe.cpp")]
    proc = subprocess.run([*cmd, "-o", str(exe)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    return {line.split()[0]: [int(v) for v in line.split()[1:]] for line in out.splitlines()}


@pytest.mark.parametrize("cls", [DpDesc, DpErrorBlock])
def test_header_structs_match_the_python_mirror(header_probe, cls):
    size, align = header_probe[cls.__name__]
    assert ctypes.sizeof(cls) == size
    assert ctypes.alignment(cls) == align
    for name, ctype in cls._fields_:
        off, fsize = header_probe[f"{cls.__name__}.{name}"]
        assert getattr(cls, name).offset == off, name
        assert ctypes.sizeof(ctype) == fsize, name


def test_header_constants_match_the_python_side(header_probe):
    from ipc_dpsample.backends.onesided import contract

    assert header_probe["DP_SIG_OP_SHIFT"] == [contract._OP_SHIFT]
    assert header_probe["DP_SIG_PAD_SHIFT"] == [contract._PAD_SHIFT]
    assert header_probe["DP_SIG_FIELD_MASK"] == [contract.MAX_SIG_PAD_BS]
    assert header_probe["DP_CTRL"] == [
        contract.CTRL_EPOCH,
        contract.CTRL_COUNTER,
        contract.CTRL_BROKEN,
    ]
    assert header_probe["DP_ERR"] == [contract.ERR_TIMEOUT, contract.ERR_MISMATCH]
    assert header_probe["DpErrorBlock"][0] == ERROR_BLOCK_SIZE


def test_descriptor_carries_the_layout():
    lay = ArenaOffsets(4, 64, 3, 4096, 2)
    d = lay.descriptor(peers=1, base=2, err=3, timeout_ns=4, rank=3, parity_mask=1)
    raw = bytes(d)
    assert len(raw) == ctypes.sizeof(DpDesc)
    back = DpDesc.from_buffer_copy(raw)
    assert (back.peers, back.base, back.err, back.timeout_ns) == (1, 2, 3, 4)
    assert back.ll_slots == lay.ll_slots and back.swap_fixed_off == lay.swap_fixed_off
    assert list(back.out_off) == list(lay.out_offsets)
    assert (back.rank, back.tp, back.n, back.parity_mask) == (3, 4, 3, 1)


@pytest.mark.parametrize("op", list(Op))
@pytest.mark.parametrize("dtype", list(Dtype))
@pytest.mark.parametrize("pad_bs", [1, 8, 256, MAX_SIG_PAD_BS])
@pytest.mark.parametrize("graph", [False, True])
def test_signature_round_trip(op, dtype, pad_bs, graph):
    sig = pack_signature(op, dtype, pad_bs, graph)
    assert 0 < sig < 2**32
    assert sig & MAX_SIG_PAD_BS == 0  # the kernel adds bs there
    for bs in (0, 1, pad_bs):
        call = unpack_signature(sig | bs)
        assert (call.op, call.dtype, call.pad_bs, call.bs, call.graph) == (
            op,
            dtype,
            pad_bs,
            bs,
            graph,
        )


def test_signatures_differ_for_every_field():
    base = pack_signature(Op.SWAP, Dtype.BFLOAT16, 64)
    assert pack_signature(Op.GATHER_OUTPUTS, Dtype.BFLOAT16, 64) != base
    assert pack_signature(Op.ARGMAX, Dtype.BFLOAT16, 64) != base
    assert pack_signature(Op.SWAP, Dtype.FLOAT32, 64) != base
    assert pack_signature(Op.SWAP, Dtype.BFLOAT16, 72) != base
    assert pack_signature(Op.SWAP, Dtype.BFLOAT16, 64, True) != base
    assert base | 5 != base | 6  # bs


def test_signature_rejects_out_of_range_pad_bs():
    with pytest.raises(ValueError, match="pad_bs=0"):
        pack_signature(Op.SWAP, Dtype.BFLOAT16, 0)
    with pytest.raises(ValueError, match="out of signature range"):
        pack_signature(Op.SWAP, Dtype.BFLOAT16, MAX_SIG_PAD_BS + 1)


def test_divergence_message_names_both_calls():
    mine = unpack_signature(pack_signature(Op.SWAP, Dtype.BFLOAT16, 8) | 8, 4)
    theirs = unpack_signature(pack_signature(Op.GATHER_OUTPUTS, Dtype.INT32, 16) | 16, 4)
    msg = divergence_message(0, 1, mine, theirs, "onesided")
    assert "rank 1 called gather_verify_outputs(pad_bs=16, bs=16, N=4)" in msg
    assert "rank 0 called swap_batch_vocab(pad_bs=8, bs=8, N=4, bfloat16)" in msg


def _peer(rank=1, pid=4242):
    return PeerRecord(
        2, rank, 8, 4, 32, "bfloat16", "auto", "cuda", "0.1.0", pid, "host-a", "boot-1", "GPU-1234"
    )


def _ipc(rank=1, pid=4242, nbytes=2 << 20, **kw):
    base = dict(
        ok=True,
        rank=rank,
        handle=bytes(range(64)),
        offset=0,
        nbytes=nbytes,
        base_ptr=0x7F0000000000,
        pid=pid,
        device=0,
        host_id="host-a",
        boot_id="boot-1",
        gpu_uuid="GPU-1234",
    )
    base.update(kw)
    return IpcRecord(**base)


def test_ipc_record_round_trip():
    rec = _ipc(reason="")
    raw = pack_ipc_record(rec)
    assert len(raw) == IPC_RECORD_SIZE
    assert unpack_ipc_record(raw) == rec
    failed = dataclasses.replace(rec, ok=False, handle=b"", reason="cudaMalloc failed")
    back = unpack_ipc_record(pack_ipc_record(failed))
    assert not back.ok and back.reason == "cudaMalloc failed"


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda raw: raw[:-1], "bytes, expected"),
        (lambda raw: b"XXXXXXXX" + raw[8:], "magic/version"),
        (lambda raw: raw[:8] + b"\x09\x00" + raw[10:], "magic/version"),
        (lambda raw: raw[:10] + b"\x07\x00" + raw[12:], "status 7"),
    ],
)
def test_malformed_ipc_records_raise(mutate, match):
    raw = pack_ipc_record(_ipc())
    with pytest.raises(DpSampleError, match=match):
        unpack_ipc_record(mutate(raw))


@pytest.mark.parametrize(
    "rec,match",
    [
        (_ipc(rank=0), "rank 0 != 1"),
        (_ipc(pid=1), "pid 1 != 4242"),
        (_ipc(host_id="host-b"), "host/boot"),
        (_ipc(boot_id="boot-2"), "host/boot"),
        (_ipc(gpu_uuid="GPU-9"), "GPU GPU-9"),
        (_ipc(nbytes=4 << 20), "arena offset/size"),
        (_ipc(offset=256), "arena offset/size"),
        (_ipc(base_ptr=0), "null base pointer"),
    ],
)
def test_inconsistent_ipc_records_are_refused_before_opening(rec, match):
    with pytest.raises(DpSampleError, match=match):
        validate_peer_record(rec, 1, _peer(), 2 << 20)


def test_consistent_ipc_record_is_accepted():
    validate_peer_record(_ipc(), 1, _peer(), 2 << 20)


def test_failure_injection_hook(monkeypatch):
    monkeypatch.setenv("IPC_DPSAMPLE_TEST_FAIL_IPC", "open:1, verify:2")
    assert injected_failure("open", 1)
    assert not injected_failure("open", 2)
    assert injected_failure("verify", 2)
    assert not injected_failure("verify", 1)
    monkeypatch.delenv("IPC_DPSAMPLE_TEST_FAIL_IPC")
    assert not injected_failure("open", 1)


def test_swap_block_fits_the_chunk_to_one_round_of_loads() -> None:
    from ipc_dpsample.backends.onesided import swap_block
    from ipc_dpsample.envs import OnesidedTuning

    tun = OnesidedTuning(512, 32768, 3, 4, True, False, "barrier")
    # V=152064 fp32 at tp=8: 76032-byte row shards in three 25344-byte chunks = 1584
    # 16-byte vectors; 13 warps x 32 lanes x 4 loads = 1664 slots (95 % busy), where
    # 512 threads would give 2048 (77 %)
    assert swap_block(25344, 8, tun) == 416
    assert swap_block(32016, 1, tun) == 512  # tp=1: 19 chunks of a 608256-byte row
    assert swap_block(1 << 20, 8, tun) == 512  # capped at IPC_DPSAMPLE_SWAP_BLOCK
    assert swap_block(16, 8, tun) == 32
    assert swap_block(16, 40, tun) == 64  # thread t signals peer t
    for chunk in (16, 100, 2048, 2049, 25344, 32768):
        b = swap_block(chunk, 2, tun)
        assert b % 32 == 0 and b * 4 * 16 >= min(chunk, 512 * 64)
        assert b == 32 or (b - 32) * 4 * 16 < chunk  # the fewest warps that suffice
    no_fit = OnesidedTuning(256, 32768, 3, 4, False, False, "barrier")
    assert swap_block(16, 8, no_fit) == 256


def test_swap_grid_follows_the_real_rows() -> None:
    from ipc_dpsample.backends.onesided import SwapPlan

    # tp=8, N=4, V=152064 fp32: 3 chunks a row, 12 tiles a request; a cap of 132 SMs x 3
    plan = SwapPlan((), (), (), tiles_per_req=12, max_grid=396)
    assert plan.grid(256) == 396  # the padded batch (also a device bs): the cap
    assert plan.grid(33) == 396
    assert plan.grid(8) == 96  # a CTA per tile, none idle
    assert plan.grid(1) == 12
    assert plan.grid(0) == 1  # CTA 0 still signals


def test_run_resizes_only_the_pushes() -> None:
    from ipc_dpsample.backends.onesided.backend import _run

    calls: list[tuple[str, int, tuple[int, ...], int]] = []

    class Launch:
        def __init__(self, name: str, n_var: int) -> None:
            self.name, self.n_var = name, n_var

        def __call__(self, stream: int, *var: int, grid: int = 0) -> None:
            calls.append((self.name, stream, var, grid))

    enter, push = Launch("enter", 2), Launch("push", 3)
    _run((enter, push), 7, (11, 22, 33), (push,), 96)  # type: ignore[arg-type]
    assert calls == [("enter", 7, (22, 33), 0), ("push", 7, (11, 22, 33), 96)]


def test_prepared_launch_takes_a_per_call_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    import contextlib
    import sys
    import types

    from ipc_dpsample.backends import common

    cuda = types.ModuleType("cupy.cuda")
    cuda.Device = lambda device=None: contextlib.nullcontext()  # type: ignore[attr-defined]
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    seen: list[tuple[int, int, int, int]] = []

    def launch(f: int, gx: int, gy: int, gz: int, bx: int, *rest: int) -> None:
        params = ctypes.cast(rest[4], ctypes.POINTER(ctypes.c_void_p))
        first = ctypes.c_uint64.from_address(params[0]).value
        seen.append((f, gx, bx, first))

    monkeypatch.setattr(common, "_launch_kernel", launch)
    kernel = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=5))
    pl = common.PreparedLaunch(kernel, 0, 396, 416, (0, 0, 9), 2)
    pl(1, 123, 0)
    pl(1, 124, 0, grid=96)
    pl(1, 125, 0, grid=0)  # 0: the default grid
    assert seen == [(5, 396, 416, 123), (5, 96, 416, 124), (5, 396, 416, 125)]

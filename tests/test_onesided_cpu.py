"""Pure parts of the one-sided backend: arena layout, signatures, IPC records."""

from __future__ import annotations

import dataclasses

import pytest

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
from ipc_dpsample.symmetric import (
    ERROR_BLOCK_SIZE,
    ArenaLayout,
    pack_signature,
    signature_mode,
    unpack_signature,
)


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
    lay = ArenaLayout(tp, max_pad_bs, n, v, itemsize)
    r = max_pad_bs // tp
    regions = [
        ("probe", lay.probe_off, 8 * tp),
        ("flags", lay.flags_off, 2 * tp * 8),
        ("ready", lay.ready_off, 2 * tp * 8),
        ("ll", lay.ll_off, 2 * lay.ll_region_bytes),
        ("swap", lay.swap_off, 2 * lay.swap_region_bytes),
        ("swap_fixed", lay.swap_fixed_off, lay.swap_region_bytes),
        ("predict", lay.out_predict_off, max_pad_bs * n * 4),
        ("accept_index", lay.out_accept_index_off, max_pad_bs * n * 4),
        ("accept_length", lay.out_accept_length_off, max_pad_bs * 4),
        ("logprobs", lay.out_logprobs_off, max_pad_bs * n * 4),
    ]
    assert lay.probe_off >= 12  # after epoch, counter, broken
    end = 0
    for name, off, size in regions:
        assert off % 16 == 0, name
        assert off >= end, f"{name} overlaps the previous region"
        end = off + size
    assert end <= lay.total_bytes
    assert lay.total_bytes % (2 << 20) == 0
    assert lay.ll_slots == r * (2 * n + 1)
    assert lay.ll_region_bytes >= tp * lay.ll_slots * 8
    assert lay.swap_region_bytes >= r * n * v * itemsize
    assert lay.swap_off % 256 == 0 and lay.swap_region_bytes % 256 == 0


def test_error_block_matches_the_kernel_struct():
    assert ERROR_BLOCK_SIZE == 32  # static_assert(sizeof(ErrorBlock) == 32) in onesided.cu


@pytest.mark.parametrize(
    "op", ["swap_batch_vocab", "gather_verify_outputs", "gather_verify_logprobs"]
)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "int32"])
@pytest.mark.parametrize("pad_bs", [1, 8, 256, (1 << 23) - 1])
@pytest.mark.parametrize("fixed", [False, True])
def test_signature_round_trip(op, dtype, pad_bs, fixed):
    sig = pack_signature(op, dtype, pad_bs, fixed_output=fixed)
    assert 0 < sig < 2**32
    assert unpack_signature(sig) == (op, dtype, pad_bs)
    assert signature_mode(sig) == ("graph" if fixed else "eager")


def test_signatures_differ_for_every_field():
    base = pack_signature("swap_batch_vocab", "bfloat16", 64)
    assert pack_signature("gather_verify_outputs", "bfloat16", 64) != base
    assert pack_signature("swap_batch_vocab", "float32", 64) != base
    assert pack_signature("swap_batch_vocab", "bfloat16", 72) != base
    assert pack_signature("swap_batch_vocab", "bfloat16", 64, fixed_output=True) != base


def test_signature_rejects_out_of_range_pad_bs():
    with pytest.raises(ValueError, match="pad_bs=0"):
        pack_signature("swap_batch_vocab", "bfloat16", 0)
    with pytest.raises(ValueError, match="out of signature range"):
        pack_signature("swap_batch_vocab", "bfloat16", 1 << 23)


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
    from ipc_dpsample.backends import onesided as ob

    if ob.SWAP_UNROLL != 4 or ob.SWAP_BLOCK != 512:
        pytest.skip("IPC_DPSAMPLE_SWAP_UNROLL/BLOCK are set: the figures below assume 4/512")
    # V=152064 fp32 at tp=8: 76032-byte row shards in three 25344-byte chunks = 1584
    # 16-byte vectors; 13 warps x 32 lanes x 4 loads = 1664 slots (95 % busy), where
    # 512 threads would give 2048 (77 %)
    assert ob.swap_block(25344, 8) == 416
    assert ob.swap_block(32016, 1) == 512  # tp=1: 19 chunks of a 608256-byte row
    assert ob.swap_block(1 << 20, 8) == 512  # capped at IPC_DPSAMPLE_SWAP_BLOCK
    assert ob.swap_block(16, 8) == 32
    assert ob.swap_block(16, 40) == 64  # thread t signals peer t
    for chunk in (16, 100, 2048, 2049, 25344, 32768):
        b = ob.swap_block(chunk, 2)
        assert b % 32 == 0 and b * 4 * 16 >= min(chunk, 512 * 64)
        assert b == 32 or (b - 32) * 4 * 16 < chunk  # the fewest warps that suffice

"""CommConfig validation, the binary config record (untrusted input from peers) and the
agreement check that turns differing configurations into ConfigMismatchError."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from ipc_dpsample import ConfigMismatchError, DpSampleError
from ipc_dpsample.config import (
    AGREED_FIELDS,
    RECORD_SIZE,
    CommConfig,
    PeerRecord,
    check_agreement,
    pack_record,
    unpack_record,
)

GOOD = {
    "tp_size": 4,
    "rank": 1,
    "max_pad_bs": 16,
    "num_tokens_per_req": 3,
    "vocab_size": 128,
    "logits_dtype": "bfloat16",
}


def _cfg(**kw: Any) -> CommConfig:
    return CommConfig(**{**GOOD, **kw})


# -- CommConfig ------------------------------------------------------------------------
def test_valid_config() -> None:
    cfg = _cfg()
    assert cfg.backend == "auto"
    assert cfg.timeout_s == 30.0
    for dtype in ("bfloat16", "float16", "float32", None):
        assert _cfg(logits_dtype=dtype).logits_dtype == dtype
    for backend in ("auto", "onesided", "nccl", "torch"):
        assert _cfg(backend=backend).backend == backend


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        ({"tp_size": 0}, r"tp_size=0 must be >= 1"),
        ({"tp_size": -2}, r"tp_size=-2 must be >= 1"),
        ({"rank": 4}, r"rank=4 out of range: expected 0 <= rank < 4"),
        ({"rank": -1}, r"rank=-1 out of range: expected 0 <= rank < 4"),
        ({"num_tokens_per_req": 0}, r"num_tokens_per_req=0 must be >= 1"),
        ({"num_tokens_per_req": -3}, r"num_tokens_per_req=-3 must be >= 1"),
        ({"max_pad_bs": 18}, r"max_pad_bs=18 must be a positive multiple of tp_size=4 \(e.g. 20\)"),
        ({"max_pad_bs": 2}, r"max_pad_bs=2 must be a positive multiple of tp_size=4 \(e.g. 4\)"),
        ({"max_pad_bs": 0}, r"max_pad_bs=0 must be a positive multiple of tp_size=4"),
        ({"max_pad_bs": -8}, r"max_pad_bs=-8 must be a positive multiple of tp_size=4"),
        ({"vocab_size": 130}, r"vocab_size=130 must be a positive multiple of tp_size=4.*132"),
        ({"vocab_size": 0}, r"vocab_size=0 must be a positive multiple of tp_size=4"),
        ({"vocab_size": 3}, r"vocab_size=3 must be a positive multiple of tp_size=4.* 4$"),
        ({"logits_dtype": "float64"}, r"logits_dtype='float64'; expected one of"),
        ({"logits_dtype": "int32"}, r"logits_dtype='int32'; expected one of"),
        ({"backend": "mpi"}, r"backend='mpi'; expected one of \('auto', 'onesided'"),
        ({"backend": "Torch"}, r"backend='Torch'; expected one of"),
        ({"timeout_s": 0.0}, r"timeout_s=0.0 must be > 0"),
        ({"timeout_s": -1.0}, r"timeout_s=-1.0 must be > 0"),
        ({"timeout_s": float("nan")}, r"timeout_s=nan must be > 0"),
        ({"max_pad_bs": 2**30, "num_tokens_per_req": 2}, r"must be < 2\*\*31"),
    ],
)
def test_invalid_config_raises_value_error_naming_expected(kw: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        _cfg(**kw)


@pytest.mark.parametrize("field", ["tp_size", "rank", "max_pad_bs", "num_tokens_per_req"])
@pytest.mark.parametrize("value", [4.0, "4", True, None])
def test_non_int_sizes_raise_type_error(field: str, value: object) -> None:
    with pytest.raises(TypeError, match=rf"{field} must be an int, got {type(value).__name__}"):
        _cfg(**{field: value})


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        _cfg().tp_size = 2  # type: ignore[misc]


def test_validate_pad_bs() -> None:
    cfg = _cfg()
    for pad_bs in (4, 8, 12, 16):
        cfg.validate_pad_bs(pad_bs)
    for pad_bs in (0, -4, 20, 17):
        with pytest.raises(ValueError, match=rf"pad_bs={pad_bs} out of range.*max_pad_bs=16"):
            cfg.validate_pad_bs(pad_bs)
    for pad_bs in (1, 6, 15):
        with pytest.raises(ValueError, match=rf"pad_bs={pad_bs} is not a multiple of tp_size=4"):
            cfg.validate_pad_bs(pad_bs)
    for pad_bs in (4.0, "4", True, None):
        with pytest.raises(TypeError, match="pad_bs must be an int"):
            cfg.validate_pad_bs(pad_bs)  # type: ignore[arg-type]


# -- records ---------------------------------------------------------------------------
def _rec(**kw: Any) -> PeerRecord:
    base = {
        "tp_size": 2,
        "rank": 0,
        "max_pad_bs": 8,
        "num_tokens_per_req": 4,
        "vocab_size": 1024,
        "logits_dtype": "float16",
        "backend": "auto",
        "device_kind": "cuda",
        "version": "0.1.0",
        "pid": 4242,
        "host_id": "node-7",
        "boot_id": "1f2e3d4c-0000-1111-2222-333344445555",
        "gpu_uuid": "GPU-01234567-89ab-cdef-0123-456789abcdef",
    }
    base.update(kw)
    return PeerRecord(**base)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"logits_dtype": None, "backend": "torch", "device_kind": "cpu", "gpu_uuid": ""},
        {"logits_dtype": "bfloat16", "backend": "onesided"},
        {"logits_dtype": "float32", "backend": "nccl", "rank": 1},
        {"host_id": "h" * 64, "boot_id": "b" * 40, "gpu_uuid": "g" * 40, "version": "v" * 16},
        {"max_pad_bs": 2**30, "vocab_size": 2**40, "pid": 2**40},
    ],
)
def test_record_round_trip(kw: dict) -> None:
    rec = _rec(**kw)
    raw = pack_record(rec)
    assert isinstance(raw, bytes)
    assert len(raw) == RECORD_SIZE
    assert unpack_record(raw) == rec


def test_record_size_is_fixed_whatever_the_strings() -> None:
    short = pack_record(_rec(host_id="", boot_id="", gpu_uuid="", version=""))
    long = pack_record(_rec(host_id="x" * 500, boot_id="y" * 500, gpu_uuid="z" * 500))
    assert len(short) == len(long) == RECORD_SIZE


def test_versions_that_differ_only_after_16_bytes_still_mismatch() -> None:
    # dev builds carry long local versions; truncating them would hide a mismatch
    a = _rec(version="0.1.0.dev12+g0123abc", rank=0)
    b = _rec(version="0.1.0.dev12+g0123abd", rank=1)
    try:
        records = [unpack_record(pack_record(a)), unpack_record(pack_record(b))]
    except ValueError:
        return  # refusing an unrepresentable version outright is fine too
    with pytest.raises(ConfigMismatchError, match="version"):
        check_agreement(records, 0)


def _corrupt(raw: bytes, field: str, value: Any) -> bytes:
    from ipc_dpsample import config

    rec = config._RECORD
    fields = list(rec._struct.unpack(raw))
    fields[1 if field == "record_version" else 2 + rec.names.index(field)] = value
    return rec._struct.pack(*fields)


MALFORMED = {
    "empty": lambda raw: b"",
    "short": lambda raw: raw[:-1],
    "long": lambda raw: raw + b"\0",
    "double": lambda raw: raw + raw,
    "magic": lambda raw: b"XXXXXXXX" + raw[8:],
    "record_version": lambda raw: _corrupt(raw, "record_version", config_record_version() + 1),
    "dtype_code": lambda raw: _corrupt(raw, "dtype", 9),
    "backend_code": lambda raw: _corrupt(raw, "backend", 4),
    "device_code": lambda raw: _corrupt(raw, "device_kind", 2),
    "tp_size_zero": lambda raw: _corrupt(raw, "tp_size", 0),
    "tp_size_negative": lambda raw: _corrupt(raw, "tp_size", -2),
    "rank_negative": lambda raw: _corrupt(raw, "rank", -1),
    "rank_beyond_tp": lambda raw: _corrupt(raw, "rank", 2),
    "max_pad_bs_zero": lambda raw: _corrupt(raw, "max_pad_bs", 0),
    "max_pad_bs_not_multiple_of_tp": lambda raw: _corrupt(raw, "max_pad_bs", 7),
    "n_zero": lambda raw: _corrupt(raw, "num_tokens_per_req", 0),
    "vocab_negative": lambda raw: _corrupt(raw, "vocab_size", -1024),
    "vocab_not_multiple_of_tp": lambda raw: _corrupt(raw, "vocab_size", 1023),
    "pid_negative": lambda raw: _corrupt(raw, "pid", -5),
    "graph_swap_code": lambda raw: _corrupt(raw, "graph_swap", 7),
    "too_many_gpus": lambda raw: _corrupt(raw, "n_visible", 17),
}


def config_record_version() -> int:
    from ipc_dpsample import config

    return config._RECORD.version


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_record_raises(name: str) -> None:
    raw = pack_record(_rec())
    with pytest.raises(DpSampleError, match="record"):
        unpack_record(MALFORMED[name](raw))


def test_record_strings_with_invalid_utf8_do_not_crash() -> None:
    raw = bytearray(pack_record(_rec()))
    from ipc_dpsample import config

    start = config._RECORD.offset_of("host_id")
    raw[start : start + 4] = b"\xff\xfe\xfd\xfc"
    rec = unpack_record(bytes(raw))
    assert isinstance(rec.host_id, str)


# -- agreement -------------------------------------------------------------------------
_OTHER = {
    "tp_size": 2,  # (both records claim the other tp; the rank-1 value differs)
    "max_pad_bs": 16,
    "num_tokens_per_req": 5,
    "vocab_size": 2048,
    "logits_dtype": "bfloat16",
    "backend": "torch",
    "device_kind": "cpu",
    "version": "0.2.0",
    "graph_swap": "copy",
}


def test_every_agreed_field_has_a_case() -> None:
    assert set(AGREED_FIELDS) <= set(_OTHER)


@pytest.mark.parametrize("field", AGREED_FIELDS)
@pytest.mark.parametrize("my_rank", [0, 1, 2])
def test_each_agreed_field_mismatch_raises(field: str, my_rank: int) -> None:
    recs = [_rec(rank=r, tp_size=3, max_pad_bs=9, vocab_size=3 * 1024) for r in range(3)]
    other = _OTHER[field] if field != "tp_size" else 4
    if getattr(recs[1], field) == other:
        other = None if field == "logits_dtype" else other
    recs[1] = dataclasses.replace(recs[1], **{field: other})
    with pytest.raises(ConfigMismatchError) as info:
        check_agreement(recs, my_rank)
    exc = info.value
    assert isinstance(exc, DpSampleError)
    assert exc.fields == {field: {0: getattr(recs[0], field), 1: other, 2: getattr(recs[2], field)}}
    msg = str(exc)
    assert f"rank {my_rank}" in msg
    assert field in msg
    assert f"rank 1={other!r}" in msg


def test_several_fields_reported_together() -> None:
    recs = [_rec(rank=0), _rec(rank=1, num_tokens_per_req=2, version="9.9.9")]
    with pytest.raises(ConfigMismatchError) as info:
        check_agreement(recs, 1)
    assert set(info.value.fields) == {"num_tokens_per_req", "version"}


def test_identity_fields_may_differ() -> None:
    recs = [
        _rec(rank=0),
        _rec(rank=1, pid=1, host_id="other", boot_id="x", gpu_uuid="GPU-other"),
    ]
    check_agreement(recs, 0)  # no error


def test_ranks_out_of_order_raise() -> None:
    recs = [_rec(rank=1), _rec(rank=0)]
    with pytest.raises(ConfigMismatchError) as info:
        check_agreement(recs, 0)
    assert info.value.fields == {"rank": {0: 1, 1: 0}}

"""NCCL backend, the pure parts of its wire: unique-id forms, set-up and init
records and their error messages, the error block the kernels fill, and the
kernel source's shared constants."""

from __future__ import annotations

import re
import struct
from typing import Any

import pytest
from fakes.emulator import KERNEL_DIR
from fakes.nccl import UID

from ipc_dpsample import BackendUnavailableError, DpSampleError
from ipc_dpsample.backends.nccl import (
    ERROR_BYTES,
    ERROR_WORDS,
    HDR_WORDS,
    KERNEL_NAMES,
    NCCL_UNIQUE_ID_BYTES,
    format_error_block,
    normalize_unique_id,
    pack_init_record,
    pack_setup_record,
    parse_init_records,
    parse_setup_records,
    unique_id_for_cupy,
    unique_id_form,
)
from ipc_dpsample.backends.nccl.geometry import NAME_EXPRESSIONS
from ipc_dpsample.backends.nccl.plan import tag_of
from ipc_dpsample.backends.nccl.records import (
    ERR_MISMATCH,
    ERR_PARAMS,
    ERR_VALUE,
    SEQ_DIVERGED,
    SETUP_RECORD,
)
from ipc_dpsample.protocol import Call, Dtype, Op

KERNEL_SOURCE = KERNEL_DIR / "nccl.cu"


# -- unique id ---------------------------------------------------------------------------
def test_uid_fixture_covers_both_halves_of_the_byte_range() -> None:
    assert len(UID) == NCCL_UNIQUE_ID_BYTES
    assert min(UID) < 128 <= max(UID)


@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview])
def test_normalize_unique_id_bytes_form(wrap: Any) -> None:
    """CuPy 14 returns bytes."""
    assert normalize_unique_id(wrap(UID)) == UID


def test_normalize_unique_id_tuple_of_signed_chars() -> None:
    """CuPy 13 returns a tuple of C chars, -128..127."""
    signed = tuple(b - 256 if b > 127 else b for b in UID)
    assert min(signed) < 0
    assert normalize_unique_id(signed) == UID
    assert normalize_unique_id(list(signed)) == UID


def test_normalize_unique_id_tuple_of_unsigned_values() -> None:
    assert normalize_unique_id(tuple(UID)) == UID


def test_normalize_unique_id_wrong_length() -> None:
    with pytest.raises(ValueError, match=r"NCCL unique id has 127 bytes; expected 128"):
        normalize_unique_id(UID[:-1])
    with pytest.raises(ValueError, match=r"has 129 bytes; expected 128"):
        normalize_unique_id((*UID, 0))


def test_normalize_unique_id_bad_values() -> None:
    with pytest.raises(ValueError, match=r"element 3 = 256; expected -128 <= value <= 255"):
        normalize_unique_id((0, 0, 0, 256) + (0,) * 124)
    with pytest.raises(ValueError, match=r"element 0 = -129"):
        normalize_unique_id((-129,) + (0,) * 127)
    with pytest.raises(TypeError, match=r"element 1 is True; expected an int"):
        normalize_unique_id((0, True) + (0,) * 126)
    with pytest.raises(TypeError, match=r"element 0 is 1.5"):
        normalize_unique_id((1.5,) + (0,) * 127)


def test_normalize_unique_id_bad_type() -> None:
    with pytest.raises(TypeError, match=r"of type str; expected bytes \(CuPy >= 14\) or a tuple"):
        normalize_unique_id("x" * 128)


def test_unique_id_for_cupy_bytes_form() -> None:
    out = unique_id_for_cupy(UID, "bytes")
    assert isinstance(out, bytes) and out == UID


def test_unique_id_for_cupy_tuple_form_is_signed_and_round_trips() -> None:
    out = unique_id_for_cupy(UID, "tuple")
    assert isinstance(out, tuple) and len(out) == NCCL_UNIQUE_ID_BYTES
    assert all(-128 <= v <= 127 for v in out)
    assert out[64] == UID[64] - 256  # a high byte travels as a negative char
    assert normalize_unique_id(out) == UID


def test_unique_id_for_cupy_validates() -> None:
    with pytest.raises(ValueError, match=r"has 3 bytes; expected 128"):
        unique_id_for_cupy(b"abc", "bytes")
    with pytest.raises(ValueError, match=r"form='list'; expected 'bytes', 'tuple' or None"):
        unique_id_for_cupy(UID, "list")  # type: ignore[arg-type]


def test_unique_id_for_cupy_installed_form() -> None:
    """Without an explicit form the installed CuPy decides; the result round-trips."""
    pytest.importorskip("cupy")
    assert normalize_unique_id(unique_id_for_cupy(UID)) == UID


@pytest.mark.parametrize(
    ("doc", "version", "form"),
    [
        (
            "NcclCommunicator(int ndev, bytes commId, int rank, NcclConfig config=None)",
            "14.2.0",
            "bytes",
        ),
        ("__init__(self, int ndev, tuple commId, int rank)", "13.6.0", "tuple"),
        ("__init__(self, int ndev, tuple commId, int rank)", "14.0.0", "tuple"),  # doc wins
        ("", "14.2.0", "bytes"),
        ("", "15.0.0a1", "bytes"),
        ("", "13.6.0", "tuple"),
        ("", "unknown", "tuple"),
    ],
)
def test_unique_id_form(doc: str, version: str, form: str) -> None:
    assert unique_id_form(doc, version) == form


# -- set-up records ----------------------------------------------------------------------
def _setup(ok: bool = True, uid: Any = None, uuid: str = "", error: str = "") -> bytes:
    return pack_setup_record(ok=ok, uid=uid, uuid=uuid, error=error)


def test_setup_records_return_rank0_uid() -> None:
    recs = [_setup(uid=UID, uuid="GPU-a"), _setup(uuid="GPU-b"), _setup(uuid="")]
    assert len({len(r) for r in recs}) == 1
    assert parse_setup_records(recs, rank=1) == UID


def test_setup_records_accept_tuple_uid() -> None:
    recs = [_setup(uid=tuple(UID)), _setup()]  # type: ignore[arg-type]
    assert parse_setup_records(recs, rank=0) == UID


def test_setup_records_report_every_failing_rank() -> None:
    recs = [
        _setup(uid=UID),
        _setup(ok=False, error="BackendUnavailableError: cupy.cuda.nccl could not load libnccl"),
        _setup(ok=False),
    ]
    with pytest.raises(BackendUnavailableError) as info:
        parse_setup_records(recs, rank=0)
    msg = str(info.value)
    assert msg.startswith("rank 0: the NCCL backend could not start (rank 1: BackendUnavailable")
    assert "rank 2: unknown error" in msg
    assert "backend='torch'" in msg


def test_setup_records_refuse_two_ranks_on_one_gpu() -> None:
    recs = [_setup(uid=UID, uuid="GPU-1234"), _setup(uuid="GPU-1234"), _setup(uuid="GPU-9")]
    with pytest.raises(BackendUnavailableError) as info:
        parse_setup_records(recs, rank=2)
    msg = str(info.value)
    assert "rank 2: NCCL needs one GPU per rank but ranks [0, 1] all use GPU-1234" in msg
    assert "Duplicate GPU detected" in msg
    assert "backend='onesided'" in msg


def test_setup_records_unknown_uuids_are_not_duplicates() -> None:
    recs = [_setup(uid=UID, uuid=""), _setup(uuid="")]
    assert parse_setup_records(recs, rank=0) == UID


def test_setup_records_malformed() -> None:
    good = _setup(uid=UID)
    with pytest.raises(
        DpSampleError,
        match=r"^rank 0: NCCL set-up record of rank 1 of 10 bytes, expected \d+: peers",
    ):
        parse_setup_records([good, b"x" * 10], rank=0)
    with pytest.raises(
        DpSampleError, match=r"magic/version b'XXXXXXXX'/1 != expected b'DPNCCLS2'/1"
    ):
        parse_setup_records([good, b"XXXXXXXX" + good[8:]], rank=0)
    with pytest.raises(DpSampleError, match=r"rank 0 sent an all-zero NCCL unique id \(expected"):
        parse_setup_records([_setup(uid=None)], rank=0)


def test_setup_record_truncates_long_errors() -> None:
    rec = _setup(ok=False, error="e" * 1000)
    assert len(rec) == SETUP_RECORD.size
    with pytest.raises(BackendUnavailableError, match=r"\(rank 0: e{239}#[0-9a-f]{16}\)"):
        parse_setup_records([rec], rank=0)


def test_init_records() -> None:
    parse_init_records([pack_init_record(ok=True)] * 3, rank=0)
    recs = [pack_init_record(ok=True), pack_init_record(ok=False, error="NcclError: boom")]
    with pytest.raises(BackendUnavailableError) as info:
        parse_init_records(recs, rank=0)
    assert str(info.value).startswith(
        "rank 0: creating the NCCL communicator failed (rank 1: NcclError: boom)"
    )
    with pytest.raises(DpSampleError, match=r"init record of rank 0 of 1 bytes, expected \d+"):
        parse_init_records([b"x"], rank=0)


# -- headers and the error block -----------------------------------------------------------
def test_tags_are_protocol_headers() -> None:
    assert tag_of(Op.SWAP, Dtype.BFLOAT16) == 1 | 1 << 8
    assert tag_of(Op.SWAP, Dtype.FLOAT16) == 1 | 2 << 8
    assert tag_of(Op.SWAP, Dtype.FLOAT32) == 1 | 3 << 8
    assert tag_of(Op.GATHER_OUTPUTS, Dtype.INT32) == 2
    assert tag_of(Op.ARGMAX, Dtype.BFLOAT16) == Call(Op.ARGMAX, Dtype.BFLOAT16, 8).header()[0]


def _hdr(op: Op, dtype: Dtype, pad_bs: int, bs: int, seq: int) -> list[int]:
    return list(Call(op, dtype, pad_bs, bs=bs, seq=seq).header())


def _error_words(mine: list[int], theirs: list[int], *, rank: int = 0, peer: int = 1) -> list[int]:
    return [ERR_MISMATCH, mine[0] & 0xFF, rank, peer, *mine, *theirs, 0, 0, 0, 0]


def test_error_block_swap_dtype() -> None:
    words = _error_words(
        _hdr(Op.SWAP, Dtype.BFLOAT16, 8, 8, 3), _hdr(Op.SWAP, Dtype.FLOAT16, 8, 8, 3)
    )
    assert len(words) == ERROR_WORDS
    msg = format_error_block(words, n=4)
    assert msg.startswith(
        "rank 1 called swap_batch_vocab(pad_bs=8, bs=8, N=4, float16) #3 while rank 0 called "
        "swap_batch_vocab(pad_bs=8, bs=8, N=4, bfloat16) #3 (nccl backend, seen by rank 0)"
    )
    assert "this communicator is now unusable" in msg


def test_error_block_bs() -> None:
    words = _error_words(
        _hdr(Op.GATHER_OUTPUTS, Dtype.INT32, 8, 5, 2),
        _hdr(Op.GATHER_OUTPUTS, Dtype.INT32, 8, 6, 2),
        rank=3,
        peer=0,
    )
    msg = format_error_block(words, n=2)
    assert msg.startswith(
        "rank 0 called gather_verify_outputs(pad_bs=8, bs=6, N=2) #2 while rank 3 called "
        "gather_verify_outputs(pad_bs=8, bs=5, N=2) #2 (nccl backend, seen by rank 3)"
    )


def test_error_block_gathers() -> None:
    words = _error_words(
        _hdr(Op.GATHER_OUTPUTS, Dtype.INT32, 8, 8, 5),
        _hdr(Op.GATHER_LOGPROBS, Dtype.INT32, 4, 4, 5),
        rank=2,
        peer=0,
    )
    msg = format_error_block(words, n=4)
    assert msg.startswith("rank 0 called gather_verify_logprobs(pad_bs=4, bs=4, N=4) #5 while")
    assert "rank 2 called gather_verify_outputs(pad_bs=8, bs=8, N=4) #5" in msg


def test_error_block_unknown_code() -> None:
    assert format_error_block([7, 2, 1, 0] + [0] * 12) == (
        "rank 1: NCCL backend error code 7 (expected 1, a header mismatch, 2, different "
        "verify_batch_vocab arguments, or 3, a refused verify_batch_vocab value; op 2, peer 0)"
    )


def test_error_block_refused_value() -> None:
    mine = _hdr(Op.VERIFY, Dtype.FLOAT32, 4, 4, 2)
    words = [ERR_VALUE, int(Op.VERIFY), 1, 3, *mine, *mine, 2, 0, 0, 0]  # DV_BAD_TOP_K
    assert format_error_block(words, n=2).startswith(
        "rank 1: the verify kernels refused top_k of request 3 in verify_batch_vocab(pad_bs=4, "
        "bs=4, N=2, float32) #2 (expected 0..128 or >= vocab_limit; the host had validated "
        "every value, so this is a bug of ipc_dpsample"
    )


def test_error_block_verify_arguments() -> None:
    """nccl_verify_finish: the combine of rank 2 saw rank 0's records carry another
    digest or candidate (the headers agreed)."""
    mine = _hdr(Op.VERIFY, Dtype.BFLOAT16, 8, 6, 4)
    words = [ERR_PARAMS, int(Op.VERIFY), 2, 0, *mine, *mine, 0, 0, 0, 0]
    msg = format_error_block(words, n=3)
    assert msg.startswith(
        "rank 0 called verify_batch_vocab(pad_bs=8, bs=6, N=3, bfloat16) #4 with different "
        "verify_batch_vocab arguments (candidates, temperature, top_k, top_p, min_p, seed, "
        "offset, vocab_limit or return_logprobs) than rank 2 passed to "
        "verify_batch_vocab(pad_bs=8, bs=6, N=3, bfloat16) #4 (nccl backend, seen by rank 2)"
    ), msg
    assert "this communicator is now unusable" in msg


def test_error_block_peer_marked_its_seq() -> None:
    """A peer whose verify saw other arguments flips SEQ_DIVERGED in its seq: the next
    header check names what it found; any other seq difference stays a plain mismatch."""
    mine = _hdr(Op.GATHER_OUTPUTS, Dtype.INT32, 8, 8, 5)
    marked = _hdr(Op.GATHER_OUTPUTS, Dtype.INT32, 8, 8, 5 ^ SEQ_DIVERGED)
    msg = format_error_block(_error_words(mine, marked, rank=1, peer=3), n=2)
    assert msg.startswith(
        "rank 3 found records with different verify_batch_vocab arguments (candidates, "
        "temperature, top_k, top_p, min_p, seed, offset, vocab_limit or return_logprobs) in "
        "its verify_batch_vocab call #4 (the op before gather_verify_outputs(pad_bs=8, bs=8, "
        "N=2) #5) and marked its headers (nccl backend, seen by rank 1): the ranks' call "
        "sequences diverged."
    ), msg
    other = format_error_block(_error_words(mine, _hdr(Op.GATHER_OUTPUTS, Dtype.INT32, 8, 8, 6)))
    assert other.startswith("rank 1 called gather_verify_outputs(pad_bs=8, bs=8) #6 while")


def test_error_block_words_unpack() -> None:
    """The host reads the block as little-endian int32 words."""
    raw = struct.pack(
        f"<{ERROR_WORDS}i",
        *_error_words(
            _hdr(Op.GATHER_OUTPUTS, Dtype.INT32, 8, 8, 1),
            _hdr(Op.GATHER_OUTPUTS, Dtype.INT32, 4, 4, 1),
        ),
    )
    words = struct.unpack(f"<{ERROR_WORDS}i", raw)
    assert "pad_bs=4" in format_error_block(words)


def test_error_block_layout_matches_kernel_source() -> None:
    src = KERNEL_SOURCE.read_text()
    m = re.search(r"sizeof\(ErrorBlock\) == (\d+)", src)
    assert m is not None and int(m.group(1)) == ERROR_BYTES == 4 * ERROR_WORDS
    assert re.search(r"#define HDR_WORDS (\d+)", src).group(1) == str(HDR_WORDS)  # type: ignore[union-attr]
    assert re.search(r"#define ERR_MISMATCH (\d+)", src).group(1) == str(ERR_MISMATCH)  # type: ignore[union-attr]
    defines = dict(re.findall(r"#define (\w+) (\w+)", src))
    assert int(defines["ERR_PARAMS"]) == ERR_PARAMS
    assert int(defines["ERR_VALUE"]) == ERR_VALUE
    assert int(defines["SEQ_DIVERGED"], 16) == SEQ_DIVERGED


def test_every_kernel_name_is_defined_in_the_source() -> None:
    src = KERNEL_SOURCE.read_text()
    defined = set(re.findall(r'extern "C" __global__ void (\w+)\(', src))
    instantiated = set(re.findall(r"template __global__ void (nccl_permute<\w+>)\(", src))
    assert set(KERNEL_NAMES) == defined | set(NAME_EXPRESSIONS)
    assert set(NAME_EXPRESSIONS) == instantiated  # nvcc builds what NVRTC will
    assert "#include" not in src

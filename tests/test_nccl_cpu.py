"""CPU tests of the NCCL backend: unique-id forms, set-up records and their error
messages, header/mismatch messages, launch geometry, backend selection, the
kernels' nvcc compile check, and the collective set-up error paths (run with
ranks as threads and the GPU-facing steps replaced)."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ipc_dpsample import BackendUnavailableError, DpSampleError, ThreadGroup
from ipc_dpsample.backends import nccl as nb
from ipc_dpsample.backends.nccl import (
    ERROR_BYTES,
    ERROR_WORDS,
    NCCL_UNIQUE_ID_BYTES,
    OP_GATHER_LOGPROBS,
    OP_GATHER_OUTPUTS,
    OP_SWAP,
    NcclBackend,
    describe_header,
    format_mismatch,
    normalize_unique_id,
    pack_init_record,
    pack_setup_record,
    packed_width,
    parse_init_records,
    parse_setup_records,
    permute_launch,
    swap_tag,
    unique_id_for_cupy,
    unique_id_form,
    vector_width,
)
from ipc_dpsample.config import CommConfig
from ipc_dpsample.select import Facts, select_backend
from ipc_dpsample.testing import RankFailure, run_threads

KERNEL_SOURCE = Path(__file__).resolve().parents[1] / "kernels" / "nccl.cu"
# low bytes (0..126) then high bytes (129..255): both halves of the C char range
UID = bytes((i * 2 + (i >= 64)) % 256 for i in range(NCCL_UNIQUE_ID_BYTES))


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
def _setup(ok: bool = True, uid: bytes | None = None, uuid: str = "", error: str = "") -> bytes:
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
    with pytest.raises(DpSampleError, match=r"rank 1 has 10 bytes, expected \d+: peers run"):
        parse_setup_records([good, b"x" * 10], rank=0)
    with pytest.raises(DpSampleError, match=r"magic b'XXXXXXXX'"):
        parse_setup_records([good, b"XXXXXXXX" + good[8:]], rank=0)
    with pytest.raises(DpSampleError, match=r"rank 0 sent an all-zero NCCL unique id"):
        parse_setup_records([_setup(uid=None)], rank=0)


def test_setup_record_truncates_long_errors() -> None:
    rec = _setup(ok=False, error="e" * 1000)
    assert len(rec) == nb.SETUP_RECORD_SIZE
    with pytest.raises(BackendUnavailableError, match=r"e{256}\)"):
        parse_setup_records([rec], rank=0)


def test_init_records() -> None:
    parse_init_records([pack_init_record(ok=True)] * 3, rank=0)
    recs = [pack_init_record(ok=True), pack_init_record(ok=False, error="NcclError: boom")]
    with pytest.raises(BackendUnavailableError) as info:
        parse_init_records(recs, rank=0)
    assert str(info.value).startswith(
        "rank 0: creating the NCCL communicator failed (rank 1: NcclError: boom)"
    )
    with pytest.raises(DpSampleError, match=r"init record of rank 0 has 1 bytes"):
        parse_init_records([b"x"], rank=0)


# -- headers and error messages ----------------------------------------------------------
def test_swap_tag() -> None:
    assert swap_tag("bfloat16") == OP_SWAP | 1 << 8
    assert swap_tag("float16") == OP_SWAP | 2 << 8
    assert swap_tag("float32") == OP_SWAP | 3 << 8
    with pytest.raises(ValueError, match=r"logits_dtype='int32'; expected one of"):
        swap_tag("int32")


def test_describe_header() -> None:
    assert describe_header([swap_tag("bfloat16"), 8, 4, 3]) == (
        "swap_batch_vocab(pad_bs=8, N=4, bfloat16) #3"
    )
    assert (
        describe_header([OP_GATHER_OUTPUTS, 16, 2, 0]) == "gather_verify_outputs(pad_bs=16, N=2) #0"
    )
    assert (
        describe_header([OP_GATHER_LOGPROBS, 4, 1, 7]) == "gather_verify_logprobs(pad_bs=4, N=1) #7"
    )
    assert describe_header([9, 1, 1, 1]) == "op 9(pad_bs=1, N=1) #1"


def _error_words(mine: list[int], theirs: list[int], *, rank: int = 0, peer: int = 1) -> list[int]:
    return [1, mine[0] & 0xFF, rank, peer, *mine, *theirs, 0, 0, 0, 0]


def test_format_mismatch_swap_dtype() -> None:
    words = _error_words([swap_tag("bfloat16"), 8, 4, 3], [swap_tag("float16"), 8, 4, 3])
    assert len(words) == ERROR_WORDS
    msg = format_mismatch(words)
    assert msg.startswith("rank 0: swap_batch_vocab found rank 1 in a different call: ")
    assert "this rank called swap_batch_vocab(pad_bs=8, N=4, bfloat16) #3" in msg
    assert "rank 1 called swap_batch_vocab(pad_bs=8, N=4, float16) #3" in msg
    assert "must be closed" in msg


def test_format_mismatch_gathers() -> None:
    words = _error_words(
        [OP_GATHER_OUTPUTS, 8, 4, 5], [OP_GATHER_LOGPROBS, 4, 4, 5], rank=2, peer=0
    )
    msg = format_mismatch(words)
    assert msg.startswith("rank 2: gather_verify_outputs found rank 0 in a different call")
    assert "rank 0 called gather_verify_logprobs(pad_bs=4, N=4) #5" in msg


def test_format_mismatch_unknown_code() -> None:
    assert format_mismatch([7, 2, 1, 0] + [0] * 12) == (
        "rank 1: NCCL backend error code 7 (op 2, peer 0)"
    )


def test_error_block_layout_matches_kernel_source() -> None:
    src = KERNEL_SOURCE.read_text()
    m = re.search(r"sizeof\(ErrorBlock\) == (\d+)", src)
    assert m is not None and int(m.group(1)) == ERROR_BYTES == 4 * ERROR_WORDS
    assert re.search(r"#define HDR_WORDS (\d+)", src).group(1) == str(nb.HDR_WORDS)  # type: ignore[union-attr]
    assert re.search(r"#define ERR_MISMATCH (\d+)", src).group(1) == str(nb.ERR_MISMATCH)  # type: ignore[union-attr]


def test_every_kernel_name_is_defined_in_the_source() -> None:
    src = KERNEL_SOURCE.read_text()
    defined = set(re.findall(r'extern "C" __global__ void (\w+)\(', src))
    defined |= set(re.findall(r"^DEFINE_PERMUTE\((\w+),", src, re.M))
    assert set(nb.KERNEL_NAMES) <= defined
    assert "#include" not in src


# -- launch geometry -----------------------------------------------------------------------
def test_packed_width() -> None:
    assert packed_width(64, 8, 4) == 4 + 8 * 9
    assert packed_width(1, 1, 1) == 4 + 3


@pytest.mark.parametrize(
    ("rowbytes", "addresses", "width"),
    [
        (38016, (0x7F0000000000, 0x7F0000100000), 16),  # V/tp=19008 bf16
        (26, (0x1000,), 2),  # V/tp=13 fp16: not a multiple of 4
        (52, (0x1000,), 4),  # V/tp=13 fp32
        (13, (0x1000,), 1),
        (128, (0x1008,), 8),  # misaligned base address
        (128, (0x1002,), 2),
        (128, (0x1001,), 1),
        (24, (), 8),
    ],
)
def test_vector_width(rowbytes: int, addresses: tuple[int, ...], width: int) -> None:
    assert vector_width(rowbytes, *addresses) == width


def test_permute_launch_short_rows_share_a_block() -> None:
    launch = permute_launch(rows=8, tp=2, rowbytes=26, width=2)  # 13 vectors per segment
    assert launch.block == 256 and launch.tps_log2 == 4
    assert launch.grid == 1  # 16 segments, 16 per block


def test_permute_launch_long_rows_take_a_block_each() -> None:
    launch = permute_launch(rows=128, tp=8, rowbytes=38016, width=16)
    assert launch.tps_log2 == 8 and launch.grid == 1024


def test_permute_launch_covers_every_segment() -> None:
    for rows, tp, rowbytes, width in [(1, 1, 1, 1), (3, 4, 64, 16), (1000, 8, 2, 2)]:
        launch = permute_launch(rows, tp, rowbytes, width)
        per_block = launch.block >> launch.tps_log2
        assert (1 << launch.tps_log2) >= min(rowbytes // width, launch.block)
        assert launch.grid * per_block >= min(rows * tp, 65535 * per_block)


def test_permute_launch_rejects_bad_width() -> None:
    with pytest.raises(ValueError, match=r"rowbytes=26 is not a multiple of width=4"):
        permute_launch(1, 1, 26, 4)


# -- selection -------------------------------------------------------------------------------
def test_auto_selects_nccl_across_hosts() -> None:
    facts = Facts(requested="auto", device_kind="cuda", tp_size=2, hosts=2, boots=2)
    name, reason = select_backend(facts)
    assert name == "nccl"
    assert "2 hosts" in reason


def test_auto_falls_back_to_torch_across_hosts_without_nccl() -> None:
    facts = Facts(
        requested="auto", device_kind="cuda", tp_size=2, hosts=2, boots=2, nccl_available=False
    )
    name, reason = select_backend(facts)
    assert name == "torch"
    assert "NCCL via CuPy is unavailable" in reason


def test_explicit_nccl_on_cpu_data_is_refused() -> None:
    with pytest.raises(BackendUnavailableError, match=r"backend='nccl' cannot run: the data is on"):
        select_backend(Facts(requested="nccl", device_kind="cpu"))


# -- construction error paths (ranks as threads, GPU steps replaced) ---------------------------
def _cfg(tp: int, rank: int) -> CommConfig:
    return CommConfig(
        tp_size=tp,
        rank=rank,
        max_pad_bs=4 * tp,
        num_tokens_per_req=2,
        vocab_size=8 * tp,
        logits_dtype="float16",
        backend="nccl",
    )


def test_cpu_device_is_refused() -> None:
    with pytest.raises(BackendUnavailableError, match=r"needs a CUDA device .* backend='torch'"):
        NcclBackend(_cfg(1, 0), ThreadGroup.create(1)[0], -1)


class _FakeNccl:
    def get_unique_id(self) -> bytes:
        return UID


class _FakeComm:
    def __init__(self, log: list[str], rank: int):
        self.log, self.rank = log, rank

    def abort(self) -> None:
        self.log.append(f"abort {self.rank}")

    def destroy(self) -> None:
        self.log.append(f"destroy {self.rank}")


def _expect_all_ranks_raise(world: int, pattern: str) -> None:
    def body(rank: int, world: int, group: Any) -> str:
        with pytest.raises(BackendUnavailableError) as info:
            NcclBackend(_cfg(world, rank), group, 0)
        assert re.search(pattern, str(info.value)), str(info.value)
        return str(info.value)

    msgs = run_threads(world, body, timeout_s=60)
    for rank, msg in enumerate(msgs):
        assert msg.startswith(f"rank {rank}: ")


def test_missing_nccl_fails_every_rank_together() -> None:
    """On this machine: whichever step fails first (no libnccl, no GPU), every rank
    raises naming every failing rank; on a GPU machine NCCL refuses two ranks on
    one GPU the same way."""
    _expect_all_ranks_raise(2, r"rank 0: .*rank 1: |Duplicate GPU detected")


def test_one_rank_failing_to_prepare_fails_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    def prepare(self: NcclBackend) -> None:
        if self.rank == 1:
            raise RuntimeError("injected failure on rank 1")
        self._nccl = _FakeNccl()

    monkeypatch.setattr(NcclBackend, "_prepare_local", prepare)
    monkeypatch.setattr(nb, "gpu_uuid", lambda device: "")
    _expect_all_ranks_raise(
        3, r"the NCCL backend could not start \(rank 1: RuntimeError: injected failure on rank 1\)"
    )


def test_two_ranks_on_one_gpu_fail_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        NcclBackend, "_prepare_local", lambda self: setattr(self, "_nccl", _FakeNccl())
    )
    monkeypatch.setattr(nb, "gpu_uuid", lambda device: "GPU-same")
    _expect_all_ranks_raise(2, r"ranks \[0, 1\] all use GPU-same .*Duplicate GPU detected")


def test_one_rank_failing_init_aborts_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []

    def create(self: NcclBackend, raw_uid: bytes) -> _FakeComm:
        assert raw_uid == UID
        if self.rank == 1:
            raise RuntimeError("NcclError: injected")
        return _FakeComm(log, self.rank)

    monkeypatch.setattr(
        NcclBackend, "_prepare_local", lambda self: setattr(self, "_nccl", _FakeNccl())
    )
    monkeypatch.setattr(NcclBackend, "_create_communicator", create)
    monkeypatch.setattr(nb, "gpu_uuid", lambda device: "")
    _expect_all_ranks_raise(
        2, r"creating the NCCL communicator failed \(rank 1: RuntimeError: NcclError: injected\)"
    )
    assert log == ["abort 0"]


def test_a_missing_rank_times_out_instead_of_hanging(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        NcclBackend, "_prepare_local", lambda self: setattr(self, "_nccl", _FakeNccl())
    )
    monkeypatch.setattr(nb, "gpu_uuid", lambda device: "")
    monkeypatch.setattr(nb, "_SETUP_TIMEOUT_S", 0.2)
    groups = ThreadGroup.create(2)
    cfg = CommConfig(
        tp_size=2, rank=0, max_pad_bs=2, num_tokens_per_req=1, vocab_size=2, timeout_s=0.2
    )
    with pytest.raises(
        DpSampleError, match=r"ranks \[1\] of the thread group did not join 'NCCL set-up'"
    ):
        NcclBackend(cfg, groups[0], 0)


def test_run_threads_reports_failures() -> None:
    """Sanity check of the harness the tests above rely on."""

    def body(rank: int, world: int, group: Any) -> None:
        raise ValueError(f"boom {rank}")

    with pytest.raises(RankFailure, match=r"boom 1"):
        run_threads(2, body, timeout_s=30)


# -- kernels compile under nvcc with warnings as errors ---------------------------------------
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernels_compile_with_nvcc(arch: str, tmp_path: Path) -> None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("needs nvcc on PATH")
    out = tmp_path / f"nccl_{arch}.o"
    proc = subprocess.run(
        [
            nvcc,
            f"-arch={arch}",
            "-Werror",
            "all-warnings",
            "-c",
            str(KERNEL_SOURCE),
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "", proc.stderr
    assert out.stat().st_size > 0


def test_error_block_words_unpack() -> None:
    """The host reads the block as little-endian int32 words."""
    raw = struct.pack(
        f"<{ERROR_WORDS}i",
        *_error_words([OP_GATHER_OUTPUTS, 8, 4, 1], [OP_GATHER_OUTPUTS, 4, 4, 1]),
    )
    words = struct.unpack(f"<{ERROR_WORDS}i", raw)
    assert "pad_bs=4" in format_mismatch(words)

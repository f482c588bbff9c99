"""CPU tests of the NCCL backend: unique-id forms, set-up records and their error
messages, header/mismatch messages, launch geometry, backend selection and the
collective set-up error paths (ranks as threads, the GPU-facing steps replaced).
The nvcc compile check of kernels/nccl.cu lives in test_kernels_compile.py."""

from __future__ import annotations

import ctypes
import re
import shutil
import struct
import subprocess
import threading
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
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
from ipc_dpsample.layout import reference_gather_verify_outputs, reference_swap_batch_vocab
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


def test_error_block_words_unpack() -> None:
    """The host reads the block as little-endian int32 words."""
    raw = struct.pack(
        f"<{ERROR_WORDS}i",
        *_error_words([OP_GATHER_OUTPUTS, 8, 4, 1], [OP_GATHER_OUTPUTS, 4, 4, 1]),
    )
    words = struct.unpack(f"<{ERROR_WORDS}i", raw)
    assert "pad_bs=4" in format_mismatch(words)


# -- the kernels themselves, emulated on the CPU --------------------------------------------
# kernels/nccl.cu includes no toolkit header, so g++ builds it with a few definitions:
# one std::thread per CUDA thread, std::barrier for __syncthreads, blocks in turn,
# one kernel at a time.
# This checks the index math, the header checks and the seq bookkeeping of every
# kernel against the NumPy reference where no GPU exists; test_nccl_gpu.py runs the
# same kernels for real.
_EMULATION = r"""
#include <barrier>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>
struct Dim { unsigned x = 0, y = 0, z = 0; };
thread_local Dim threadIdx, blockIdx;
Dim blockDim, gridDim;
std::barrier<>* g_barrier = nullptr;
#define __global__
#define __device__
#define __forceinline__ inline
inline void __syncthreads() { g_barrier->arrive_and_wait(); }
inline void __threadfence_system() {}
#include "nccl.cu"
static std::mutex g_launch;  // one kernel at a time (ranks may be threads of this process)
static void launch(int grid, int block, const std::function<void()>& body) {
  std::lock_guard<std::mutex> lock(g_launch);
  gridDim.x = grid;
  blockDim.x = block;
  for (int b = 0; b < grid; ++b) {
    std::barrier<> bar(block);
    g_barrier = &bar;
    std::vector<std::thread> threads;
    for (int t = 0; t < block; ++t)
      threads.emplace_back([&, b, t]() { blockIdx.x = b; threadIdx.x = t; body(); });
    for (auto& th : threads) th.join();
  }
}
#define PERMUTE_ARGS u64 out, u64 st, u64 self_src, i64 self_rank, i64 tp, i64 rows, \
  i64 rowbytes, i64 tps_log2, u64 hdr_recv, u64 my_hdr, u64 table, i64 entries, u64 counter, \
  u64 err, i64 rank
#define PERMUTE_CALL out, st, self_src, self_rank, tp, rows, rowbytes, tps_log2, hdr_recv, \
  my_hdr, table, entries, counter, err, rank
extern "C" void emu_permute(int width, int grid, int block, PERMUTE_ARGS) {
  launch(grid, block, [=]() {
    switch (width) {
      case 16: nccl_permute_w16(PERMUTE_CALL); break;
      case 8: nccl_permute_w8(PERMUTE_CALL); break;
      case 4: nccl_permute_w4(PERMUTE_CALL); break;
      case 2: nccl_permute_w2(PERMUTE_CALL); break;
      default: nccl_permute_w1(PERMUTE_CALL); break;
    }
  });
}
extern "C" void emu_pack(int grid, int block, u64 dst, u64 s0, i64 n0, u64 s1, i64 n1, u64 s2,
                         i64 n2, i64 tag, i64 pad_bs, i64 n, u64 counter) {
  launch(grid, block, [=]() { nccl_pack(dst, s0, n0, s1, n1, s2, n2, tag, pad_bs, n, counter); });
}
extern "C" void emu_unpack(int grid, int block, u64 recv, i64 width, i64 tp, i64 rank, u64 d0,
                           i64 n0, u64 d1, i64 n1, u64 d2, i64 n2, u64 table, i64 entries,
                           u64 counter, u64 err) {
  launch(grid, block, [=]() {
    nccl_unpack(recv, width, tp, rank, d0, n0, d1, n1, d2, n2, table, entries, counter, err);
  });
}
"""


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory) -> Any:
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("needs g++ (C++20) to emulate the kernels on the CPU")
    work = tmp_path_factory.mktemp("nccl_emulation")
    (work / "emulate.cpp").write_text(_EMULATION)
    lib_path = work / "libnccl_emulation.so"
    cmd = [gxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-I", str(KERNEL_SOURCE.parent)]
    cmd += [str(work / "emulate.cpp"), "-o", str(lib_path), "-lpthread"]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0 and "barrier" in proc.stderr:
        pytest.skip(f"g++ lacks C++20 <barrier>: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr
    lib = ctypes.CDLL(str(lib_path))
    u, i, c = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int
    lib.emu_permute.argtypes = [c, c, c, u, u, u, i, i, i, i, i, u, u, u, i, u, u, i]
    lib.emu_pack.argtypes = [c, c, u, u, i, u, i, u, i, i, i, i, u]
    lib.emu_unpack.argtypes = [c, c, u, i, i, i, u, i, u, i, u, i, u, i, u, u]
    return lib


def _addr(a: Any) -> int:
    return int(a.ctypes.data)


def _ctrl(rmax: int, tp: int, n: int, dtype: str, seq: int) -> Any:
    """Counter word (padded to 16 bytes), then the swap-header table [rmax][4]."""
    t = np.zeros((rmax + 1, nb.HDR_WORDS), dtype=np.int32)
    t[0, 0] = seq
    t[1:, 0] = swap_tag(dtype)
    t[1:, 1] = np.arange(1, rmax + 1) * tp
    t[1:, 2] = n
    t[1:, 3] = seq
    return t.reshape(-1).copy()


PERMUTE_CASES = [
    (2, 0, 13, "float16", False),  # 26-byte rows: 2-byte vectors
    (3, 1, 64, "bfloat16", False),  # 16-byte vectors
    (4, 3, 13, "float32", False),  # 4-byte vectors
    (3, 2, 1000, "float16", True),  # own block from staging
    (2, 1, 3, "bfloat16", False),  # 6-byte rows
    (1, 0, 8, "float16", True),
]
# a single rank cannot disagree with itself: no mismatch case at tp=1
PERMUTE_MISMATCH_CASES = [
    (*c, m) for c in PERMUTE_CASES for m in (False, True) if c[0] > 1 or not m
]


@pytest.mark.parametrize(
    ("tp", "me", "vs", "dtype", "route_self", "mismatch"), PERMUTE_MISMATCH_CASES
)
@pytest.mark.parametrize("force_bytes", [False, True])
def test_emulated_permute(
    emulated: Any,
    tp: int,
    me: int,
    vs: int,
    dtype: str,
    route_self: bool,
    mismatch: bool,
    force_bytes: bool,
) -> None:
    rng = np.random.default_rng(tp * 100 + vs)
    n, r, rmax, seq = 3, 2, 4, 41
    pad_bs, rows = r * tp, r * 3
    bits = np.uint16 if dtype != "float32" else np.uint32
    rowbytes = vs * np.dtype(bits).itemsize
    inputs = [
        rng.integers(1, np.iinfo(bits).max, size=(pad_bs * n, vs), dtype=bits, endpoint=True)
        for _ in range(tp)
    ]
    expected = reference_swap_batch_vocab(inputs, tp=tp, num_tokens_per_req=n, pad_bs=pad_bs)[me]
    staging = np.stack([x[me * rows : (me + 1) * rows] for x in inputs])
    if not route_self:
        staging[me] = 0x5A5A  # never read
    out = np.full((rows, tp * vs), 0x7E7E, dtype=bits)
    ctrl = _ctrl(rmax, tp, n, dtype, seq)
    mine = np.array([swap_tag(dtype), pad_bs, n, seq], dtype=np.int32)
    hdr_recv = np.tile(mine, (tp, 1))
    bad = (me + 1) % tp
    if mismatch:
        hdr_recv[bad, 0] = swap_tag("float16" if dtype == "bfloat16" else "bfloat16")
    err = np.zeros(ERROR_WORDS, dtype=np.int32)
    self_src = 0 if route_self else _addr(inputs[me]) + me * rows * rowbytes
    width = 1 if force_bytes else vector_width(rowbytes, _addr(out), _addr(staging), self_src)
    launch = permute_launch(rows, tp, rowbytes, width)
    table = _addr(ctrl) + 4 * nb.HDR_WORDS
    emulated.emu_permute(
        width, launch.grid, launch.block, _addr(out), _addr(staging), self_src,
        -1 if route_self else me, tp, rows, rowbytes, launch.tps_log2, _addr(hdr_recv),
        table + (r - 1) * 4 * nb.HDR_WORDS, table, rmax, _addr(ctrl), _addr(err), me,
    )  # fmt: skip
    np.testing.assert_array_equal(out, expected)
    ctrl2 = ctrl.reshape(rmax + 1, nb.HDR_WORDS)
    assert ctrl2[0, 0] == seq + 1 and (ctrl2[1:, 3] == seq + 1).all()
    if mismatch:
        assert err[:4].tolist() == [1, OP_SWAP, me, bad]
        assert err[4:8].tolist() == mine.tolist() and err[8:12].tolist() == hdr_recv[bad].tolist()
    else:
        assert (err == 0).all()


# a single rank cannot disagree with itself: mismatches from tp = 3, 4 only
GATHER_CASES = [(1, None)] + [(tp, m) for tp in (3, 4) for m in (None, "pad_bs", "op")]


@pytest.mark.parametrize(("tp", "mismatch"), GATHER_CASES)
def test_emulated_pack_allgather_unpack(emulated: Any, tp: int, mismatch: str | None) -> None:
    rng = np.random.default_rng(tp)
    n, seq, r = 4, 9, 2
    max_pad_bs, pad_bs, rmax = 4 * tp, r * tp, 4
    width = packed_width(max_pad_bs, tp, n)

    def ints(*shape: int) -> Any:
        return rng.integers(-(2**31), 2**31, size=shape, dtype=np.int64).astype(np.int32)

    p = [ints(r, n) for _ in range(tp)]
    a = [ints(r, n) for _ in range(tp)]
    ln = [ints(r) for _ in range(tp)]
    recv = np.full((tp, width), -7, dtype=np.int32)
    ctrls = [_ctrl(rmax, tp, n, "bfloat16", seq) for _ in range(tp)]
    for src in range(tp):
        odd = mismatch is not None and src == tp - 1
        op = OP_GATHER_LOGPROBS if odd and mismatch == "op" else OP_GATHER_OUTPUTS
        their_pad = pad_bs + tp if odd and mismatch == "pad_bs" else pad_bs
        emulated.emu_pack(
            1, 64, _addr(recv) + src * width * 4, _addr(p[src]), r * n, _addr(a[src]), r * n,
            _addr(ln[src]), r, op, their_pad, n, _addr(ctrls[src]),
        )  # fmt: skip
    assert recv[0, : nb.HDR_WORDS].tolist() == [OP_GATHER_OUTPUTS, pad_bs, n, seq]
    assert (recv[:, nb.HDR_WORDS + 2 * r * n + r :] == -7).all()  # fixed width, tail unwritten
    outs = [np.full((max_pad_bs, n), -1, np.int32) for _ in range(2)]
    outs.append(np.full((max_pad_bs,), -1, np.int32))
    err = np.zeros(ERROR_WORDS, dtype=np.int32)
    ctrl = ctrls[0]
    emulated.emu_unpack(
        2, 32, _addr(recv), width, tp, 0, _addr(outs[0]), r * n, _addr(outs[1]), r * n,
        _addr(outs[2]), r, _addr(ctrl) + 4 * nb.HDR_WORDS, rmax, _addr(ctrl), _addr(err),
    )  # fmt: skip
    for got, want in zip(outs, reference_gather_verify_outputs(p, a, ln), strict=True):
        np.testing.assert_array_equal(got[:pad_bs], want)
        assert (got[pad_bs:] == -1).all()
    ctrl2 = ctrl.reshape(rmax + 1, nb.HDR_WORDS)
    assert ctrl2[0, 0] == seq + 1 and (ctrl2[1:, 3] == seq + 1).all()
    if mismatch is None:
        assert (err == 0).all()
    else:
        assert err[:4].tolist() == [1, OP_GATHER_OUTPUTS, 0, tp - 1]
        assert f"rank {tp - 1} called " in format_mismatch(err.tolist())


def test_emulated_logprobs_gather_single_segment(emulated: Any) -> None:
    tp, n, r, rmax, seq = 3, 2, 3, 3, 0
    width = packed_width(rmax * tp, tp, n)
    rng = np.random.default_rng(0)
    lp = [rng.integers(1, 2**32, size=(r, n), dtype=np.uint32, endpoint=False) for _ in range(tp)]
    recv = np.zeros((tp, width), dtype=np.int32)
    for src in range(tp):
        ctrl = _ctrl(rmax, tp, n, "float32", seq)
        emulated.emu_pack(
            3, 8, _addr(recv) + src * width * 4, _addr(lp[src]), r * n, 0, 0, 0, 0,
            OP_GATHER_LOGPROBS, r * tp, n, _addr(ctrl),
        )  # fmt: skip
    out = np.full((rmax * tp, n), 0xFFFFFFFF, dtype=np.uint32)
    err = np.zeros(ERROR_WORDS, dtype=np.int32)
    ctrl = _ctrl(rmax, tp, n, "float32", seq)
    emulated.emu_unpack(
        1, 32, _addr(recv), width, tp, tp - 1, _addr(out), r * n, 0, 0, 0, 0,
        _addr(ctrl) + 4 * nb.HDR_WORDS, rmax, _addr(ctrl), _addr(err),
    )  # fmt: skip
    np.testing.assert_array_equal(out, np.concatenate(lp))
    assert (err == 0).all()


# -- the whole host path on the CPU: emulated kernels, an in-process NCCL stand-in ------------
# NcclBackend with only its device-facing leaves replaced: buffers are host arrays,
# kernels run in the emulator, and "NCCL" moves bytes between ranks that are threads
# of this process (send/recv matched per peer in order, recvs completed at
# groupEnd; allGather). Everything else is the production code: set-up records,
# plans, kernel arguments, pointer offsets, the NCCL call sequence, headers, the
# error block and close().
class _HostBuf(np.ndarray):
    """A host array with the two CuPy members the backend uses (``data.ptr``, get/set)."""

    @property
    def data(self) -> Any:  # type: ignore[override]
        return _Ptr(int(self.ctypes.data))

    def get(self) -> np.ndarray:
        return np.array(self)

    def set(self, value: np.ndarray) -> None:
        self[...] = value


class _Ptr:
    def __init__(self, ptr: int):
        self.ptr = ptr


class _Fabric:
    """What NCCL would move between ranks, for ranks that are threads."""

    SIZES: ClassVar[dict[int, int]] = {1: 1, 2: 4}  # NCCL_UINT8, NCCL_INT32

    def __init__(self, tp: int):
        self.tp = tp
        self.cond = threading.Condition()
        self.queues: dict[tuple[int, int], list[bytes]] = {}
        self.gathers: dict[int, dict[int, bytes]] = {}

    def post(self, src: int, dst: int, data: bytes) -> None:
        with self.cond:
            self.queues.setdefault((src, dst), []).append(data)
            self.cond.notify_all()

    def take(self, src: int, dst: int) -> bytes:
        with self.cond:
            q = self.queues.setdefault((src, dst), [])
            assert self.cond.wait_for(lambda: q, timeout=30), f"no message {src}->{dst}"
            return q.pop(0)

    def all_gather(self, rank: int, seq: int, data: bytes) -> list[bytes]:
        with self.cond:
            slot = self.gathers.setdefault(seq, {})
            slot[rank] = data
            self.cond.notify_all()
            assert self.cond.wait_for(lambda: len(slot) == self.tp, timeout=30), "allGather"
            return [slot[r] for r in range(self.tp)]


class _FabricComm:
    def __init__(self, fabric: _Fabric, rank: int):
        self.fabric, self.rank = fabric, rank
        self.pending: list[tuple[int, int, int]] | None = None
        self.gathers = 0
        self.log: list[tuple[str, int, int]] = []

    def group_start(self) -> None:
        assert self.pending is None, "nested groupStart"
        self.pending = []

    def group_end(self) -> None:
        assert self.pending is not None, "groupEnd without groupStart"
        for ptr, nbytes, peer in self.pending:
            data = self.fabric.take(peer, self.rank)
            # real NCCL would hang on a size mismatch; the stand-in fails loudly
            assert len(data) == nbytes, f"rank {self.rank}: {len(data)} bytes != {nbytes}"
            ctypes.memmove(ptr, data, nbytes)
        self.pending = None

    def send(self, ptr: int, count: int, dtype: int, peer: int, stream: int) -> None:
        assert self.pending is not None, "send outside a group"
        nbytes = count * _Fabric.SIZES[dtype]
        self.fabric.post(self.rank, peer, ctypes.string_at(ptr, nbytes))
        self.log.append(("send", peer, nbytes))

    def recv(self, ptr: int, count: int, dtype: int, peer: int, stream: int) -> None:
        assert self.pending is not None, "recv outside a group"
        self.pending.append((ptr, count * _Fabric.SIZES[dtype], peer))
        self.log.append(("recv", peer, count * _Fabric.SIZES[dtype]))

    def allGather(self, send: int, recv: int, count: int, dtype: int, stream: int) -> None:
        nbytes = count * _Fabric.SIZES[dtype]
        parts = self.fabric.all_gather(self.rank, self.gathers, ctypes.string_at(send, nbytes))
        self.gathers += 1
        for r, part in enumerate(parts):
            ctypes.memmove(recv + r * nbytes, part, nbytes)
        self.log.append(("allGather", -1, nbytes))

    def check_async_error(self) -> None:
        pass

    def destroy(self) -> None:
        self.log.append(("destroy", -1, 0))

    def abort(self) -> None:
        self.log.append(("abort", -1, 0))


class _FakeNccl:
    NCCL_UINT8, NCCL_INT32 = 1, 2

    class NcclError(RuntimeError):
        pass

    def __init__(self) -> None:
        self.comm: _FabricComm | None = None

    def get_unique_id(self) -> bytes:
        return UID

    def groupStart(self) -> None:
        assert self.comm is not None
        self.comm.group_start()

    def groupEnd(self) -> None:
        assert self.comm is not None
        self.comm.group_end()


class _FakeRuntime:
    def __init__(self, device: int):
        self.device = device
        self.capturing: set[int] = set()  # stream handles under capture
        self.capture_queries: list[int] = []

    def getDevice(self) -> int:
        return self.device

    def streamIsCapturing(self, handle: int) -> int:
        self.capture_queries.append(handle)
        return 1 if handle in self.capturing else 0  # cudaStreamCaptureStatusActive

    def setDevice(self, device: int) -> None:
        raise AssertionError("the stand-in runtime has one device")

    def deviceSynchronize(self) -> None:
        pass

    def freeHost(self, ptr: int) -> None:
        pass


class _FakeEvent:
    """A CuPy event: ``done`` is what the test sets; queries and records are counted."""

    def __init__(self) -> None:
        self.finished = True
        self.queries = 0
        self.records: list[int] = []  # stream handles

    @property
    def done(self) -> bool:
        self.queries += 1
        return self.finished

    def record(self, stream: Any = None) -> None:
        self.records.append(stream.handle)


class _FakeCupy:
    def __init__(self, runtime: _FakeRuntime):
        import contextlib

        self.cuda = type(
            "cuda",
            (),
            {"Device": staticmethod(lambda d: contextlib.nullcontext()), "runtime": runtime},
        )


def _emulated_kernels(lib: Any) -> dict[str, Any]:
    def permute(width: int) -> Any:
        return lambda grid, block, args, stream=None: lib.emu_permute(
            width, grid[0], block[0], *args
        )

    kernels = {name: permute(w) for w, name in nb.PERMUTE_KERNELS.items()}
    kernels["nccl_pack"] = lambda grid, block, args, stream=None: lib.emu_pack(
        grid[0], block[0], *args
    )
    kernels["nccl_unpack"] = lambda grid, block, args, stream=None: lib.emu_unpack(
        grid[0], block[0], *args
    )
    return kernels


@pytest.fixture
def host_backends(emulated: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Factory: ``make(world, body, **cfg)`` runs ``body(rank, backend, comm_log)`` on
    ``world`` thread ranks, each with a NcclBackend over the stand-ins."""

    def prepare_local(self: NcclBackend) -> None:
        self._runtime = _FakeRuntime(self.device)
        self._cupy = _FakeCupy(self._runtime)
        self._nccl = _FakeNccl()
        self._kernels = _emulated_kernels(emulated)
        self._host_error_block = np.zeros(ERROR_WORDS, dtype=np.int32)
        self._allocate()
        self._event = _FakeEvent()

    def alloc(self: NcclBackend, name: str, nbytes: int) -> None:
        self._bufs[name] = np.full(max(1, nbytes), 0xA5, dtype=np.uint8).view(_HostBuf)

    def alloc_error_block(self: NcclBackend) -> tuple[int, int]:
        ptr = int(self._host_error_block.ctypes.data)
        return ptr, ptr

    def view(
        self: NcclBackend, kind: Any, key: str, pad_bs: int, shape: tuple[int, ...], dtype: str
    ) -> np.ndarray:
        name = "out_swap" if key == "swap" else key
        np_dtype = {"bfloat16": np.uint16, "float16": np.uint16, "float32": np.uint32}.get(
            dtype, np.int32
        )
        return (
            self._bufs[name].view(np.ndarray).view(np_dtype)[: int(np.prod(shape))].reshape(shape)
        )

    monkeypatch.setattr(NcclBackend, "_prepare_local", prepare_local)
    monkeypatch.setattr(NcclBackend, "_alloc", alloc)
    monkeypatch.setattr(NcclBackend, "_alloc_error_block", alloc_error_block)
    monkeypatch.setattr(NcclBackend, "_view", view)
    monkeypatch.setattr(nb, "_cupy_stream", lambda handle, device: nb._StreamHandle(handle))
    monkeypatch.setattr(nb, "gpu_uuid", lambda device: "")

    def make(world: int, body: Any, *, route_self: bool = False, **cfg_kw: Any) -> list[Any]:
        fabric = _Fabric(world)

        def create(self: NcclBackend, raw_uid: bytes) -> _FabricComm:
            assert raw_uid == UID
            comm = _FabricComm(fabric, self.rank)
            self._nccl.comm = comm
            return comm

        monkeypatch.setattr(NcclBackend, "_create_communicator", create)

        def rank_body(rank: int, world: int, group: Any) -> Any:
            kw = {"max_pad_bs": 4 * world, "num_tokens_per_req": 3, "backend": "nccl"}
            kw.update(cfg_kw)
            cfg = CommConfig(tp_size=world, rank=rank, **kw)
            backend = NcclBackend(cfg, group, 0, route_self_through_nccl=route_self)
            try:
                return body(rank, backend, backend._comm.log)
            finally:
                backend.close()

        return run_threads(world, rank_body, timeout_s=120)

    return make


def _swap_and_check(
    backend: NcclBackend,
    rank: int,
    world: int,
    pad_bs: int,
    vs: int,
    dtype: str,
    seed: int,
    stream: Any = None,
) -> None:
    from ipc_dpsample.arrays import describe

    rng = np.random.default_rng(seed)
    n = backend.cfg.num_tokens_per_req
    bits = np.uint32 if dtype == "float32" else np.uint16
    inputs = [
        rng.integers(1, np.iinfo(bits).max, size=(pad_bs * n, vs), dtype=bits, endpoint=True)
        for _ in range(world)
    ]
    x = inputs[rank]
    out = backend.swap_batch_vocab(x, describe(x), pad_bs=pad_bs, stream=stream)
    expected = reference_swap_batch_vocab(inputs, tp=world, num_tokens_per_req=n, pad_bs=pad_bs)
    np.testing.assert_array_equal(out, expected[rank])
    out[...] = 0x7E7E  # poison for the next call


def _gathers_and_check(
    backend: NcclBackend, rank: int, world: int, pad_bs: int, seed: int, stream: Any = None
) -> None:
    from ipc_dpsample.arrays import describe

    rng = np.random.default_rng(seed)
    n, r = backend.cfg.num_tokens_per_req, pad_bs // world

    def ints(*shape: int) -> np.ndarray:
        return rng.integers(-(2**31), 2**31, size=shape, dtype=np.int64).astype(np.int32)

    p = [ints(r, n) for _ in range(world)]
    a = [ints(r, n) for _ in range(world)]
    ln = [ints(r) for _ in range(world)]
    lp = [ints(r, n).view(np.float32) for _ in range(world)]
    outs = backend.gather_verify_outputs(
        p[rank], a[rank], ln[rank], describe(p[rank]), pad_bs=pad_bs, stream=stream
    )
    for got, want in zip(outs, reference_gather_verify_outputs(p, a, ln), strict=True):
        np.testing.assert_array_equal(got, want)
        got[...] = -1
    olp = backend.gather_verify_logprobs(lp[rank], describe(lp[rank]), pad_bs=pad_bs, stream=stream)
    np.testing.assert_array_equal(olp.view(np.int32), np.concatenate(lp).view(np.int32))
    olp.view(np.int32)[...] = -1


@pytest.mark.parametrize(
    ("world", "vs", "dtype", "route_self"),
    [
        (2, 13, "float16", False),
        (3, 64, "bfloat16", False),
        (3, 7, "float32", False),
        (2, 13, "bfloat16", True),
        (1, 13, "float16", False),
        (1, 40, "float32", True),
    ],
)
def test_host_path_moves_every_byte(
    host_backends: Any, world: int, vs: int, dtype: str, route_self: bool
) -> None:
    def body(rank: int, backend: NcclBackend, log: list[tuple[str, int, int]]) -> None:
        n = backend.cfg.num_tokens_per_req
        itemsize = 4 if dtype == "float32" else 2
        for step, pad_bs in enumerate([4 * world, world, 2 * world, 4 * world]):
            log.clear()
            _swap_and_check(backend, rank, world, pad_bs, vs, dtype, seed=step)
            chunk = pad_bs // world * n * vs * itemsize
            peers = world if route_self else world - 1
            assert sorted(log) == sorted(
                [("send", p, 16) for p in range(world) if route_self or p != rank]
                + [("recv", p, 16) for p in range(world) if route_self or p != rank]
                + [("send", p, chunk) for p in range(world) if route_self or p != rank]
                + [("recv", p, chunk) for p in range(world) if route_self or p != rank]
            )
            assert len(log) == 4 * peers
            log.clear()
            _gathers_and_check(backend, rank, world, pad_bs, seed=100 + step)
            width = packed_width(4 * world, world, n)
            assert log == [("allGather", -1, 4 * width)] * 2  # fixed size: pad_bs-independent
        backend.check()

    host_backends(world, body, route_self=route_self, vocab_size=vs * world, logits_dtype=dtype)


def test_host_path_prepare_switches_dtype(host_backends: Any) -> None:
    def body(rank: int, backend: NcclBackend, log: Any) -> None:
        for step, dtype in enumerate(["float32", "bfloat16", "float16"]):
            backend.prepare(dtype)
            _swap_and_check(backend, rank, 2, 4, 5, dtype, seed=step)
        backend.check()

    host_backends(2, body, vocab_size=10)


def test_host_path_gather_mismatch_raises_on_every_rank(host_backends: Any) -> None:
    from ipc_dpsample.arrays import describe

    def body(rank: int, backend: NcclBackend, log: Any) -> str:
        _gathers_and_check(backend, rank, 3, 6, seed=1)  # one good op first: seq #2 next
        _swap_and_check(backend, rank, 3, 3, 2, "float32", seed=2)
        ints = np.arange(2 * 3, dtype=np.int32).reshape(2, 3)
        if rank == 1:
            backend.gather_verify_logprobs(
                ints.view(np.float32), describe(ints), pad_bs=6, stream=None
            )
        else:
            backend.gather_verify_outputs(
                ints, ints, ints[:, 0].copy(), describe(ints), pad_bs=6, stream=None
            )
        with pytest.raises(DpSampleError) as info:
            backend.check()
        with pytest.raises(DpSampleError, match="in a different call"):  # sticky, before NCCL
            backend.gather_verify_outputs(
                ints, ints, ints[:, 0].copy(), describe(ints), pad_bs=6, stream=None
            )
        return str(info.value)

    msgs = host_backends(3, body, vocab_size=6, logits_dtype="float32")
    assert msgs[0].startswith("rank 0: gather_verify_outputs found rank 1 in a different call")
    assert "rank 1 called gather_verify_logprobs(pad_bs=6, N=3) #3" in msgs[0]
    assert msgs[1].startswith("rank 1: gather_verify_logprobs found rank 0 in a different call")
    assert msgs[2].startswith("rank 2: gather_verify_outputs found rank 1 in a different call")


def test_host_path_swap_dtype_mismatch_raises_on_every_rank(host_backends: Any) -> None:
    from ipc_dpsample.arrays import describe

    def body(rank: int, backend: NcclBackend, log: Any) -> str:
        dtype = "bfloat16" if rank == 0 else "float16"
        backend.prepare(dtype)
        x = np.ones((2 * 3, 4), dtype=np.uint16)
        backend.swap_batch_vocab(x, describe(x), pad_bs=2, stream=None)
        with pytest.raises(DpSampleError) as info:
            backend.check()
        return str(info.value)

    msgs = host_backends(2, body, vocab_size=8)
    assert "this rank called swap_batch_vocab(pad_bs=2, N=3, bfloat16) #0" in msgs[0]
    assert "rank 1 called swap_batch_vocab(pad_bs=2, N=3, float16) #0" in msgs[0]
    assert msgs[1].startswith("rank 1: swap_batch_vocab found rank 0 in a different call")


def test_host_path_close_destroys_and_frees(host_backends: Any) -> None:
    logs: list[Any] = []

    def body(rank: int, backend: NcclBackend, log: Any) -> None:
        logs.append(log)

    host_backends(2, body, vocab_size=4, logits_dtype="float16")
    assert all(log[-1] == ("destroy", -1, 0) for log in logs)


# -- one op in flight per communicator (DESIGN.md point 9) ------------------------------------
A, B = 0x1000, 0x2000  # two stream handles


def _swap_op(backend: NcclBackend, stream: int) -> Any:
    from ipc_dpsample.arrays import describe

    x = np.ones((backend.cfg.max_pad_bs * backend.cfg.num_tokens_per_req, 4), dtype=np.uint16)
    return backend.swap_batch_vocab(x, describe(x), pad_bs=backend.cfg.max_pad_bs, stream=stream)


def _gather_op(backend: NcclBackend, stream: int) -> Any:
    from ipc_dpsample.arrays import describe

    lp = np.zeros((backend.cfg.max_pad_bs // backend.tp, 3), dtype=np.float32)
    return backend.gather_verify_logprobs(
        lp, describe(lp), pad_bs=backend.cfg.max_pad_bs, stream=stream
    )


@pytest.mark.parametrize("op", [_swap_op, _gather_op])
def test_second_stream_refused_while_previous_op_in_flight(host_backends: Any, op: Any) -> None:
    def body(rank: int, backend: NcclBackend, log: list[Any]) -> None:
        event = backend._event
        _swap_and_check(backend, rank, 2, 4, 5, "float16", seed=0, stream=A)
        assert event.records == [A] and event.queries == 0
        event.finished = False  # A's op still runs on the GPU
        log.clear()
        with pytest.raises(DpSampleError) as info:
            op(backend, B)
        msg = str(info.value)
        assert msg.startswith(f"rank {rank}: op issued on stream 0x2000 while this ")
        assert "previous op on stream 0x1000 is still in flight: one op at a time" in msg
        assert log == []  # refused before any NCCL call or kernel
        assert event.records == [A] and event.queries == 1
        event.finished = True  # the caller synchronised
        _swap_and_check(backend, rank, 2, 4, 5, "float16", seed=1, stream=B)
        _gathers_and_check(backend, rank, 2, 4, seed=2, stream=B)
        assert event.records == [A, B, B, B]
        assert event.queries == 2  # once more for the change A -> B, not per op on B
        backend.check()

    host_backends(2, body, vocab_size=10, logits_dtype="float16")


def test_same_stream_never_queries_the_event(host_backends: Any) -> None:
    def body(rank: int, backend: NcclBackend, log: Any) -> None:
        event = backend._event
        event.finished = False  # would refuse any stream change
        for step in range(3):
            _swap_and_check(backend, rank, 2, 4, 5, "bfloat16", seed=step, stream=A)
            _gathers_and_check(backend, rank, 2, 4, seed=10 + step, stream=A)
        assert event.queries == 0
        assert event.records == [A] * 9  # one record per op, nothing else
        backend.check()

    host_backends(2, body, vocab_size=10, logits_dtype="bfloat16")


def test_capture_neither_queries_nor_records(host_backends: Any) -> None:
    def body(rank: int, backend: NcclBackend, log: Any) -> None:
        event, runtime = backend._event, backend._runtime
        _swap_op(backend, A)
        event.finished = False
        runtime.capturing.add(B)
        log.clear()
        for op in (_swap_op, _gather_op, _gather_op):  # another stream, but being captured
            op(backend, B)
        assert log  # the NCCL calls were issued (captured)
        assert event.queries == 0 and event.records == [A]
        assert runtime.capture_queries == [A, B, B, B]
        runtime.capturing.clear()
        # the capture did not move the reference: an eager op on B is checked against A's
        with pytest.raises(DpSampleError, match=r"stream 0x2000 .* on stream 0x1000 is still"):
            _swap_op(backend, B)
        assert event.queries == 1
        event.finished = True
        _swap_op(backend, B)
        assert event.records == [A, B]

    host_backends(2, body, vocab_size=8, logits_dtype="float16")

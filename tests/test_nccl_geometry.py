"""NCCL backend, launch geometry and peer steps (pure functions), and the backend
selection facts that lead to it."""

from __future__ import annotations

import pytest

from ipc_dpsample import BackendUnavailableError
from ipc_dpsample.backends.nccl import packed_width, permute_launch, swap_moves, vector_width
from ipc_dpsample.backends.nccl.geometry import argmax_buffer_bytes, argmax_slots, verify_moves
from ipc_dpsample.layout import real_reqs
from ipc_dpsample.select import Facts, select_backend


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


@pytest.mark.parametrize("bs", [None, 0, 1, 5, 6, 7, 12])
def test_swap_moves_pair_up_and_send_only_real_rows(bs: int | None) -> None:
    """What rank s sends to p is exactly what p expects from s, for every pair;
    the bytes follow real_reqs; offsets address p's rows of the input."""
    tp, reqs, n, rowbytes = 3, 4, 2, 10
    moves = {r: swap_moves(tp, r, reqs, n, rowbytes, bs, route_self=False) for r in range(tp)}
    for s in range(tp):
        assert len(moves[s]) == tp - 1
        for dst, off, nbytes, _src, _rbytes in moves[s]:
            assert dst != s
            assert off == dst * reqs * n * rowbytes
            assert nbytes == real_reqs(reqs, bs, dst) * n * rowbytes
            expected_by_dst = [m[4] for m in moves[dst] if m[3] == s]
            assert expected_by_dst == [nbytes]
    if bs is None:
        assert all(m[2] == m[4] == reqs * n * rowbytes for ms in moves.values() for m in ms)


def test_swap_moves_route_self_includes_step_zero() -> None:
    moves = swap_moves(2, 1, 3, 2, 8, 4, route_self=True)
    assert moves[0] == (1, 1 * 3 * 2 * 8, 1 * 2 * 8, 1, 1 * 2 * 8)  # bs=4: rank 1 owns 1 real
    assert moves[1] == (0, 0, 3 * 2 * 8, 0, 1 * 2 * 8)
    assert swap_moves(1, 0, 3, 2, 8, 0, route_self=True) == ((0, 0, 0, 0, 0),)


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


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
def test_argmax_slots_alias_only_the_own_block(tp: int) -> None:
    """The own receive slot is the own send block; every other receive slot lies
    outside the send region and the other slots; all within the buffer."""
    chunk_max = 36
    for chunk in (12, chunk_max):
        for rank in range(tp):
            send, recv, stride = argmax_slots(tp, rank, chunk)
            assert recv + rank * stride == send + rank * chunk
            slots = [(recv + s * stride, recv + s * stride + chunk) for s in range(tp)]
            for s, (lo, hi) in enumerate(slots):
                assert 0 <= lo and hi <= argmax_buffer_bytes(tp, chunk_max)
                if s != rank:
                    assert hi <= send or lo >= send + tp * chunk
                for t, (lo2, hi2) in enumerate(slots):
                    assert t == s or hi <= lo2 or hi2 <= lo
            assert 0 <= send and send + tp * chunk <= argmax_buffer_bytes(tp, chunk_max)


@pytest.mark.parametrize("tp", [1, 2, 3, 8])
def test_verify_moves_pair_up_and_skip_the_own_block(tp: int) -> None:
    chunk = 7 * 4
    steps = {r: verify_moves(tp, r, chunk) for r in range(tp)}
    for rank, moves in steps.items():
        assert len(moves) == tp - 1
        assert {m[0] for m in moves} == {m[3] for m in moves} == set(range(tp)) - {rank}
        for dst, off, nbytes, _src, rbytes in moves:
            assert off == dst * chunk and nbytes == rbytes == chunk
            # the step that sends to dst is the step at which dst receives from rank
            k = (dst - rank) % tp
            assert steps[dst][k - 1][3] == rank

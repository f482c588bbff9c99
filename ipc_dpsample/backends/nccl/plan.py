"""Per-shape plans of the NCCL backend: every kernel launch of one op prepared once
(:class:`~ipc_dpsample.backends.common.PreparedLaunch`, one ``cuLaunchKernel`` per
kernel per call) and the peer steps of its NCCL group. Built on the first call of a
``pad_bs`` and reused by every later call of that shape.
"""

from __future__ import annotations

from ...arrays import ITEMSIZE
from ...protocol import Call, Dtype, Op
from ..base import RealRows
from ..common import PreparedLaunch
from ..verify_plan import param_offsets, record_words
from .geometry import (
    PARTIAL_BYTES,
    VERIFY_BLOCK,
    argmax_slots,
    linear_grid,
    permute_launch,
    permute_name,
    swap_moves,
    vector_width,
    verify_moves,
)
from .setup import NcclSetup

__all__ = ["ArgmaxPlan", "GatherPlan", "SwapPlan", "VerifyPlan", "tag_of"]

Moves = tuple[tuple[int, int, int, int, int], ...]


def tag_of(op: Op, dtype: Dtype) -> int:
    """Header word 0 (``protocol.Call.header()``) of ``op`` on ``dtype`` data."""
    return Call(op, dtype, 0).header()[0]


class SwapPlan:
    """Everything a swap of one ``pad_bs`` needs.

    Attributes
    ----------
    rows : int
        ``R*N``, rows of this rank's output.
    chunk : int
        Bytes of ``R*N`` input rows: one peer's block of the input and of staging.
    header : PreparedLaunch
        ``nccl_header``; per call ``(bs, bs_ptr)``.
    """

    def __init__(self, backend: NcclSetup, pad_bs: int):
        b, cfg = backend, backend.cfg
        assert b.logits_dtype is not None
        n, reqs = cfg.num_tokens_per_req, pad_bs // b.tp
        self.rows = reqs * n
        rowbytes = cfg.vocab_size // b.tp * ITEMSIZE[b.logits_dtype]
        self.chunk = self.rows * rowbytes
        p = b.ptr
        self.width = vector_width(rowbytes, p["out_swap"], p["staging"])
        self._static = (
            b.launcher,
            rowbytes,
            (
                p["out_swap"],
                p["staging"],
                -1 if b.route_self else b.rank,
                b.tp,
                self.rows,
                rowbytes,
                reqs,
                n,
                p["hdr_recv"],
                p["my_hdr"],
                p["counter"],
                b.err_dev,
                b.rank,
            ),
        )
        tag = tag_of(Op.SWAP, Dtype.of(b.logits_dtype))
        self.header = b.launcher.header(tag, pad_bs, p["my_hdr"], p["counter"])
        self._permutes: dict[int, PreparedLaunch] = {}
        self._moves: dict[int | None, Moves] = {}
        self._moves_args = (b.tp, b.rank, reqs, n, rowbytes, b.route_self)

    def moves_for(self, bs: RealRows) -> Moves:
        """Peer steps (:func:`~.geometry.swap_moves`): real rows for a host ``bs``,
        every row (fixed counts) for a device ``bs``."""
        key = None if bs.on_device else bs.bs
        m = self._moves.get(key)
        if m is None:
            tp, rank, reqs, n, rowbytes, route = self._moves_args
            if tp == 1 and not route:
                m = ()
            else:
                m = swap_moves(tp, rank, reqs, n, rowbytes, key, route)
            self._moves[key] = m
        return m

    def permute_for(self, self_src: int) -> PreparedLaunch:
        """The permute launch (per call ``self_src``) for the widest vector that also
        divides ``self_src`` (a caller's view may start at any element)."""
        launcher, rowbytes, tail = self._static
        width = self.width if self_src % self.width == 0 else vector_width(rowbytes, self_src)
        width = min(width, self.width)
        launch = self._permutes.get(width)
        if launch is None:
            geo = permute_launch(self.rows, tail[3], rowbytes, width)
            args = (0, *tail[:6], geo.tps_log2, *tail[6:])
            launch = launcher.prepare(permute_name(width), geo.grid, args, 1, geo.block)
            self._permutes[width] = launch
        return launch


class GatherPlan:
    """Both kernels of one verify gather of one ``pad_bs``.

    Attributes
    ----------
    slot : int
        Device address of this rank's ``[W]`` int32 slot of the gather buffer.
    pack : PreparedLaunch
        ``nccl_pack``; per call ``(src0, src1, src2, bs, bs_ptr)``.
    unpack : PreparedLaunch
        ``nccl_unpack``; nothing per call.
    """

    def __init__(self, backend: NcclSetup, op: Op, pad_bs: int):
        b, n = backend, backend.cfg.num_tokens_per_req
        reqs = pad_bs // b.tp
        rn = reqs * n
        p = b.ptr
        if op is Op.GATHER_OUTPUTS:
            sizes, dsts = (rn, rn, reqs), (p["predict"], p["accept_index"], p["accept_length"])
        else:
            sizes, dsts = (rn, 0, 0), (p["logprobs"], 0, 0)
        per = sum(sizes)
        self.slot = p["grecv"] + b.rank * b.width * 4
        tag = tag_of(op, Dtype.INT32)
        self.pack = b.launcher.prepare(
            "nccl_pack",
            linear_grid(per),
            (0, 0, 0, 0, 0, self.slot, *sizes, tag, pad_bs, p["counter"]),
            5,
        )
        unpack_args = (
            p["grecv"],
            b.width,
            b.tp,
            b.rank,
            dsts[0],
            sizes[0],
            dsts[1],
            sizes[1],
            dsts[2],
            sizes[2],
            p["counter"],
            b.err_dev,
        )
        self.unpack = b.launcher.prepare("nccl_unpack", linear_grid(b.tp * per), unpack_args, 0)


class ArgmaxPlan:
    """Every launch and peer step of ``argmax_batch_vocab`` for one ``pad_bs`` and
    ``vocab_limit``.

    The real-row count every kernel uses is the header's ``bs`` word (``my_hdr[2]``,
    written by ``nccl_header`` from the host value or the device scalar), so the
    partials and combine launches take nothing per call but the input pointer.

    Attributes
    ----------
    header : PreparedLaunch
        ``nccl_header``; per call ``(bs, bs_ptr)``.
    partials : PreparedLaunch
        ``dp_argmax_partials`` over the whole ``[pad_bs*N, V/tp]`` input (phantom
        rows skipped); per call the input pointer.
    combine, finish : PreparedLaunch
        ``dp_argmax_combine`` into the persistent outputs; ``nccl_finish`` (header
        check, seq). Nothing per call.
    moves : tuple
        Peer steps ``(dst, send_offset, nbytes, src, nbytes)``: ``R*N*12`` bytes per
        pair whatever ``bs`` is; this rank's own block never travels.
    send_base, recv_base, recv_stride : int
        Device addresses / stride of :func:`~.geometry.argmax_slots`.

    Raises
    ------
    ValueError
        ``vocab_limit`` outside ``1..V``.
    """

    def __init__(self, backend: NcclSetup, pad_bs: int, vocab_limit: int):
        b, cfg = backend, backend.cfg
        if not 1 <= vocab_limit <= cfg.vocab_size:
            raise ValueError(
                f"vocab_limit={vocab_limit}; expected 1 <= vocab_limit <= V={cfg.vocab_size}"
            )
        assert b.logits_dtype is not None
        dtype = Dtype.of(b.logits_dtype)
        n, tp, rank, reqs = cfg.num_tokens_per_req, b.tp, b.rank, pad_bs // b.tp
        rn, vs = reqs * n, cfg.vocab_size // tp
        chunk = rn * PARTIAL_BYTES
        send, recv, stride = argmax_slots(tp, rank, chunk)
        p, launcher = b.ptr, b.launcher
        bs_word = p["my_hdr"] + 8
        self.send_base, self.recv_base, self.recv_stride = (
            p["abuf"] + send,
            p["abuf"] + recv,
            stride,
        )
        self.header = launcher.header(tag_of(Op.ARGMAX, dtype), pad_bs, p["my_hdr"], p["counter"])
        rows = pad_bs * n
        self.partials = launcher.prepare(
            "dp_argmax_partials",
            max(1, min(65535, rows)),
            (0, rows, vs, rank * vs, vocab_limit, int(dtype), n, 0, bs_word, 0, self.send_base),
            1,
        )
        self.combine = launcher.prepare(
            "dp_argmax_combine",
            linear_grid(rn),
            (
                self.recv_base,
                tp,
                rn,
                stride // 4,
                p["token_ids"],
                p["alogprobs"],
                n,
                rank * reqs,
                bs_word,
                0,
            ),
            0,
        )
        self.finish = launcher.prepare(
            "nccl_finish",
            1,
            (p["hdr_recv"], tp, rank, p["my_hdr"], p["counter"], b.err_dev, rank),
            0,
            block=1,
        )
        self.moves = tuple(
            ((rank + k) % tp, (rank + k) % tp * chunk, chunk, (rank - k) % tp, chunk)
            for k in range(1, tp)
        )


#: Most CTAs of a grid-stride launch over rows.
_MAX_GRID = 65535


class VerifyPlan:
    """Every launch and peer step of ``verify_batch_vocab``'s kernel path for one
    ``pad_bs`` and ``vocab_limit`` (kernels/verify.cu; the host half of the records is
    :mod:`ipc_dpsample.backends.verify_plan`).

    Per call the host passes what depends on the call: the input and candidates
    pointers, the six parameter arrays (:attr:`param_ptrs`), the list capacity ``cap``,
    ``return_logprobs``, the call digest and ``bs`` (host value, or the device scalar
    the kernels read).

    Attributes
    ----------
    reqs : int
        ``R = pad_bs / tp``, this rank's requests ``[rank*R, (rank+1)*R)``.
    param_ptrs : tuple of 6 int
        Device addresses of temperature, top_k, top_p, min_p, seed, offset ``[pad_bs]``
        in the parameter buffer (:func:`~ipc_dpsample.backends.verify_plan.pack_params`'
        layout for this ``pad_bs``).
    header : PreparedLaunch
        ``nccl_header``; per call ``(bs, bs_ptr)``.
    records : PreparedLaunch
        ``dp_verify_records`` over the whole ``[pad_bs*N, V/tp]`` input into the send
        buffer ``[pad_bs*N][record_words(cap)]`` u32 (rows of requests ``>= bs``
        skipped); per call ``(src, cand, *param_ptrs, cap, want_lp, digest, bs_ptr,
        bs)`` and the grid.
    combine : PreparedLaunch
        ``dp_verify_combine`` of the receive buffer ``[tp][R*N][record_words(cap)]``
        into this rank's results (int32 predict/accept_index ``[R, N]``, accept_length
        ``[R]``, float32 logprobs ``[R, N]``); per call ``(cand, *param_ptrs, cap,
        want_lp, digest, bs_ptr, bs)`` and the grid.
    finish : PreparedLaunch
        ``nccl_verify_finish``: the header check, the kernels' error words into the
        error block, seq. Nothing per call.
    send_base, recv_base : int
        Device addresses of the send and receive buffers (the same buffer at tp = 1
        without ``route_self``: slot 0 is block 0).
    """

    def __init__(self, backend: NcclSetup, pad_bs: int, vocab_limit: int):
        b, cfg = backend, backend.cfg
        assert b.logits_dtype is not None
        dtype = Dtype.of(b.logits_dtype)
        n, tp, rank = cfg.num_tokens_per_req, b.tp, b.rank
        self.reqs = reqs = pad_bs // tp
        self._tp, self._rank, self._n, self._route_self = tp, rank, n, b.route_self
        vs = cfg.vocab_size // tp
        p, launcher = b.ptr, b.launcher
        self.send_base, self.recv_base = p["vsend"], p["vrecv"]
        self.param_ptrs = tuple(p["vparams"] + off for off in param_offsets(pad_bs))
        rows = pad_bs * n
        self.header = launcher.header(tag_of(Op.VERIFY, dtype), pad_bs, p["my_hdr"], p["counter"])
        err_words = p["verr"]  # [0] the combine's argument check, [1] the refused value
        rec_args = (rows, vs, rank * vs, vocab_limit, int(dtype), n, self.send_base, err_words + 4)
        grid = max(1, min(_MAX_GRID, rows))
        self.records = launcher.prepare(
            "dp_verify_records", grid, (0,) * 13 + rec_args, 13, block=VERIFY_BLOCK
        )
        #: the same records when no row has top-k (list capacity 0): less shared memory
        self.records_nolist = launcher.prepare(
            "dp_verify_records_nolist", grid, (0,) * 13 + rec_args, 13, block=VERIFY_BLOCK
        )
        outs = (p["vpredict"], p["vaccept_index"], p["vaccept_length"], p["vlogprobs"])
        self.combine = launcher.prepare(
            "dp_verify_combine",
            max(1, reqs),
            (0,) * 12 + (self.recv_base, tp, reqs, n, rank * reqs, vocab_limit, *outs, err_words),
            12,
            block=VERIFY_BLOCK,
        )
        self.finish = launcher.prepare(
            "nccl_verify_finish",
            1,
            (p["hdr_recv"], tp, rank, p["my_hdr"], p["counter"], b.err_dev, rank, err_words),
            0,
            block=1,
        )
        self._moves: dict[int, tuple[Moves, int]] = {}

    def moves_for(self, cap: int) -> tuple[Moves, int]:
        """``(moves, chunk)`` for list capacity ``cap``: the peer steps
        (:func:`~.geometry.verify_moves`; with ``route_self`` also step 0, this rank's
        own block through NCCL) and the bytes of one block, ``R*N*record_words(cap)*4``,
        which is also the stride of the receive buffer's slots."""
        got = self._moves.get(cap)
        if got is None:
            tp, rank = self._tp, self._rank
            chunk = self.reqs * self._n * record_words(cap) * 4
            moves = verify_moves(tp, rank, chunk)
            if self._route_self:
                moves = ((rank, rank * chunk, chunk, rank, chunk), *moves)
            got = self._moves[cap] = (moves, chunk)
        return got

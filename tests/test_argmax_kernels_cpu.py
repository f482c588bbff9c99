"""CPU proof of the argmax kernels (kernels/argmax.cu + argmax.cuh, issue 14).

The kernels include no toolkit header, so g++ builds them with a small emulation of
the CUDA launch: one ``std::thread`` per CUDA thread, every thread walks the blocks
in turn, ``std::barrier`` stands for ``__syncthreads`` (and after each block, so that
``__shared__`` arrays, plain statics here, are free before the next block starts).
Every rank's shard goes through ``dp_argmax_partials``; each owner's rows of the
partials are gathered as the NCCL all-to-all would deliver them and go through
``dp_argmax_combine``; the token ids must equal
``ipc_dpsample.layout.reference_argmax_batch_vocab`` exactly and the logprobs must be
within 1e-5 (NaN where it is NaN). The nvcc compile check lives in
test_kernels_compile.py; the device-only paths (inline PTX loads and cvt, ``__expf``)
run on a GPU only.
"""

from __future__ import annotations

import ctypes
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _cuda_emulation import HEADER, LAUNCH, build

from ipc_dpsample.layout import reference_argmax_batch_vocab
from ipc_dpsample.protocol import Dtype

KERNEL_DIR = Path(__file__).resolve().parents[1] / "kernels"
DTYPES = ["bfloat16", "float16", "float32"]
TPS = [1, 2, 3, 4, 8]
NO_IDX = 0xFFFFFFFF
POISON_WORD = 0xA5A5A5A5
POISON_ID = -7
POISON_LOGPROB = np.float32(1234.5)
ATOL = 1e-5

_EMULATION = (
    HEADER
    + r"""
// every load of the logits: bytes read (each counted element exactly once) and alignment
static std::atomic<unsigned long long> g_bytes{0}, g_vectors{0}, g_misaligned{0};
static inline void emu_load(unsigned long long addr, unsigned long long bytes) {
  g_bytes += bytes;
  if (bytes == 16) ++g_vectors;
  if (addr % bytes != 0) ++g_misaligned;
}
#define DP_ARGMAX_EMU_LOAD(ptr, bytes) emu_load(reinterpret_cast<unsigned long long>(ptr), bytes)
#include "argmax.cu"

extern "C" void emu_load_stats(unsigned long long* out) {  // read and reset
  out[0] = g_bytes.exchange(0);
  out[1] = g_vectors.exchange(0);
  out[2] = g_misaligned.exchange(0);
}
"""
    + LAUNCH
    + r"""
extern "C" void emu_partials(unsigned grid, unsigned block, u64 src, i64 rows, i64 ncols,
                             i64 col0, i64 vocab_limit, i64 dtype_code, i64 n, i64 req0,
                             u64 bs_ptr, i64 bs_host, u64 out_words) {
  launch(grid, block, [=]() {
    dp_argmax_partials(src, rows, ncols, col0, vocab_limit, dtype_code, n, req0, bs_ptr,
                       bs_host, out_words);
  });
}
extern "C" void emu_combine(unsigned grid, unsigned block, u64 words, i64 tp, i64 rows,
                            i64 stride_words, u64 ids, u64 logprobs, i64 n, i64 req0,
                            u64 bs_ptr, i64 bs_host) {
  launch(grid, block, [=]() {
    dp_argmax_combine(words, tp, rows, stride_words, ids, logprobs, n, req0, bs_ptr, bs_host);
  });
}
extern "C" void emu_f16_table(float* out) {
  for (unsigned h = 0; h < 65536u; ++h) out[h] = ArgmaxF16::to_float((unsigned short)h);
}
extern "C" void emu_combine_pair(const unsigned* a, const unsigned* b, unsigned* out) {
  argmax_pack(argmax_combine(argmax_unpack(a[0], a[1], a[2]), argmax_unpack(b[0], b[1], b[2])),
              out);
}
"""
)


@pytest.fixture(scope="module")
def emulated(tmp_path_factory: pytest.TempPathFactory) -> Any:
    lib = build(tmp_path_factory.mktemp("argmax_emulation"), _EMULATION, "argmax_emulation")
    u, i, c = ctypes.c_uint64, ctypes.c_int64, ctypes.c_uint
    lib.emu_partials.argtypes = [c, c, u, i, i, i, i, i, i, i, u, i, u]
    lib.emu_combine.argtypes = [c, c, u, i, i, i, u, u, i, i, u, i]
    lib.emu_f16_table.argtypes = [u]
    lib.emu_combine_pair.argtypes = [u, u, u]
    lib.emu_load_stats.argtypes = [u]
    return lib


def _addr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


# -- data ---------------------------------------------------------------------------------
def _encode(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> the array a rank holds (bfloat16: truncated uint16 bits)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if dtype == "bfloat16":
        return (values.view(np.uint32) >> 16).astype(np.uint16)
    return values.astype(np.float16 if dtype == "float16" else np.float32)


def _huge(dtype: str) -> float:
    """A magnitude whose exp overflows float32 by far, still finite in ``dtype``."""
    return 6.0e4 if dtype == "float16" else 3.0e38


def _special_rows(rng: np.random.Generator, v: int, vs: int, tp: int, dtype: str) -> list:
    """Full-vocab float32 rows with the values that break naive argmax/softmax code."""
    base = lambda: rng.normal(0.0, 3.0, size=v).astype(np.float32)  # noqa: E731
    rows = []
    # the same max in rank 0's last and rank 1's first column (a bf16 tie survives rounding)
    r = base()
    r[min(vs, v - 1)] = r[vs - 1] = 64.0
    rows.append(r)
    # the same max in the middle of two ranks' shards, and an earlier lower near-tie
    r = base()
    r[vs // 2] = r[(tp - 1) * vs + vs // 2 + (tp == 1)] = 48.0
    r[0] = 47.0
    rows.append(r)
    # one NaN in the last shard
    r = base()
    r[(tp - 1) * vs + vs // 3] = np.nan
    rows.append(r)
    # NaNs in several shards, the first one late in its shard, plus +inf before it
    r = base()
    for s in range(tp - 1, -1, -1):
        r[s * vs + (vs - 1 if s == tp // 2 else vs // 4)] = np.nan
    r[0] = np.inf
    rows.append(r)
    # several NaNs in one shard: neighbours (one thread's vector) and a later one
    r = base()
    shard = (tp > 1) * vs
    first = shard + vs // 2
    r[[shard + vs - 1, first, first + 1, first + 2]] = np.nan
    rows.append(r)
    # all -inf
    rows.append(np.full(v, -np.inf, dtype=np.float32))
    # -inf everywhere but a few finite columns in the last shard
    r = np.full(v, -np.inf, dtype=np.float32)
    r[(tp - 1) * vs + rng.integers(0, vs, size=3)] = rng.normal(0.0, 3.0, size=3)
    rows.append(r)
    # two +inf (the first wins, logprob NaN)
    r = base()
    r[v // 3] = r[v - 1] = np.inf
    rows.append(r)
    # huge magnitudes of both signs: exp(x) and x - max overflow. The max is unique:
    # the reference's float64 m + log(sum) absorbs log(sum) at 3e38 (ties there are
    # checked against torch's value in test_huge_ties_follow_torch), also when
    # vocab_limit trims it: then column 0 is
    r = rng.uniform(-1.0, 0.9, size=v).astype(np.float32) * np.float32(_huge(dtype))
    r[0] = 0.95 * _huge(dtype)
    r[rng.integers(1, v)] = _huge(dtype)
    rows.append(r)
    # 1e4 + noise: a meaningful softmax that a naive exp(x) turns into inf/inf
    rows.append((1.0e4 + rng.normal(0.0, 16.0, size=v)).astype(np.float32))
    # fp16 subnormals (and bf16/fp32 tiny values): every term close to 1
    rows.append(rng.integers(-1000, 1000, size=v).astype(np.float32) * np.float32(2.0**-24))
    return rows


def _make_inputs(
    rng: np.random.Generator, *, tp: int, n: int, pad_bs: int, vs: int, dtype: str
) -> list[np.ndarray]:
    """tp shards ``[pad_bs * n, vs]``: random rows, the special ones at random rows."""
    v = tp * vs
    full = rng.normal(0.0, 3.0, size=(pad_bs * n, v)).astype(np.float32)
    specials = _special_rows(rng, v, vs, tp, dtype)
    if len(specials) > pad_bs * n:
        raise ValueError(f"{pad_bs * n} rows cannot hold the {len(specials)} special rows")
    where = rng.permutation(pad_bs * n)[: len(specials)]
    for row, values in zip(where, specials, strict=True):
        full[row] = values
    return [_encode(full[:, s * vs : (s + 1) * vs], dtype) for s in range(tp)]


# -- running the kernels -------------------------------------------------------------------
def _load_stats(lib: Any) -> tuple[int, int, int]:
    """(bytes, 16-byte vector loads, misaligned loads) since the last call."""
    out = np.zeros(3, dtype=np.uint64)
    lib.emu_load_stats(_addr(out))
    return int(out[0]), int(out[1]), int(out[2])


LOADS: dict[str, int] = {}  # vector loads of the last _run, for the tests to inspect


def _run(
    lib: Any,
    inputs: list[np.ndarray],
    *,
    tp: int,
    n: int,
    pad_bs: int,
    dtype: str,
    vocab_limit: int | None = None,
    bs: int | None = None,
    bs_on_device: bool = False,
    block: int = 8,
    grid: int | None = None,
    pad_stride: int = 0,
) -> tuple[list[np.ndarray], list[tuple[np.ndarray, np.ndarray]]]:
    """Partials of every rank ([pad_bs*n, 3] u32) and every owner's (ids, logprobs)."""
    rows, vs = inputs[0].shape
    limit = tp * vs if vocab_limit is None else vocab_limit
    bs_word = np.array([pad_bs if bs is None else bs], dtype=np.int32)
    # a device bs must win over bs_host: pass a wrong host value with it
    bs_ptr, bs_host = (_addr(bs_word), pad_bs) if bs_on_device else (0, int(bs_word[0]))
    code = Dtype[dtype.upper()]
    real_rows = min(rows, max(0, int(bs_word[0])) * n)
    partials = []
    LOADS["vectors"] = 0
    _load_stats(lib)
    for s, x in enumerate(inputs):
        words = np.full((rows, 3), POISON_WORD, dtype=np.uint32)
        lib.emu_partials(
            grid or rows, block, _addr(x), rows, vs, s * vs, limit, int(code), n, 0, bs_ptr,
            bs_host, _addr(words),
        )  # fmt: skip
        partials.append(words)
        # each counted element of each real row is read exactly once, every load aligned
        nbytes, vectors, misaligned = _load_stats(lib)
        counted = min(vs, max(0, limit - s * vs))
        assert nbytes == real_rows * counted * code.itemsize, (
            f"rank {s} read {nbytes} bytes; expected {real_rows} rows x {counted} columns"
        )
        assert misaligned == 0, f"rank {s}: {misaligned} misaligned loads"
        LOADS["vectors"] += vectors
    own = rows // tp
    results = []
    for r in range(tp):
        # what the NCCL all-to-all delivers to rank r: block s = rank s's rows of r
        recv = np.full((tp, own + pad_stride, 3), POISON_WORD, dtype=np.uint32)
        for s in range(tp):
            recv[s, :own] = partials[s][r * own : (r + 1) * own]
        ids = np.full(own, POISON_ID, dtype=np.int32)
        logprobs = np.full(own, POISON_LOGPROB, dtype=np.float32)
        lib.emu_combine(
            grid or 2, block, _addr(recv), tp, own, 3 * (own + pad_stride), _addr(ids),
            _addr(logprobs), n, r * (pad_bs // tp), bs_ptr, bs_host,
        )  # fmt: skip
        results.append((ids, logprobs))
    return partials, results


def _real_rows(pad_bs: int, tp: int, n: int, bs: int | None, rank: int) -> int:
    r = pad_bs // tp
    reqs = r if bs is None else max(0, min(r, bs - rank * r))
    return reqs * n


def _check(
    inputs: list[np.ndarray],
    partials: list[np.ndarray],
    results: list[tuple[np.ndarray, np.ndarray]],
    *,
    tp: int,
    n: int,
    pad_bs: int,
    dtype: str,
    vocab_limit: int | None = None,
    bs: int | None = None,
) -> None:
    expected = reference_argmax_batch_vocab(
        inputs, tp=tp, num_tokens_per_req=n, pad_bs=pad_bs, dtype=dtype, vocab_limit=vocab_limit
    )
    real_total = pad_bs * n if bs is None else max(0, min(pad_bs, bs)) * n
    for s, words in enumerate(partials):
        assert (words[real_total:] == POISON_WORD).all(), f"rank {s} wrote phantom partials"
        assert (words[:real_total] != POISON_WORD).any(axis=1).all(), f"rank {s} missed rows"
    for r, ((ids, logprobs), (want_ids, want_lp)) in enumerate(zip(results, expected, strict=True)):
        real = _real_rows(pad_bs, tp, n, bs, r)
        bad = np.flatnonzero(ids[:real] != want_ids[:real])
        assert bad.size == 0, (
            f"rank {r} rows {bad[:8].tolist()}: ids {ids[bad[:8]].tolist()} "
            f"!= expected {want_ids[bad[:8]].tolist()}"
        )
        got, want = logprobs[:real], want_lp[:real]
        assert (np.isnan(got) == np.isnan(want)).all(), (
            f"rank {r}: NaN logprobs at rows {np.flatnonzero(np.isnan(got)).tolist()}, "
            f"expected at {np.flatnonzero(np.isnan(want)).tolist()}"
        )
        ok = np.isnan(want) | (np.abs(got - want) <= ATOL)
        assert ok.all(), (
            f"rank {r} rows {np.flatnonzero(~ok)[:8].tolist()}: logprobs "
            f"{got[~ok][:8].tolist()} != expected {want[~ok][:8].tolist()} (atol {ATOL})"
        )
        assert (ids[real:] == POISON_ID).all(), f"rank {r} wrote phantom ids"
        assert (logprobs[real:].view(np.uint32) == POISON_LOGPROB.view(np.uint32)).all(), (
            f"rank {r} wrote phantom logprobs"
        )


def _rng(*parts: object) -> np.random.Generator:
    """A seeded generator per test case (fresh data per case, reproducible)."""
    return np.random.default_rng(zlib.crc32(repr(parts).encode()))


# -- the tests -----------------------------------------------------------------------------
@pytest.mark.parametrize("vs", [13, 203, 256])
@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(emulated: Any, dtype: str, tp: int, vs: int) -> None:
    """Every special row, odd shard widths (unaligned rows: scalar head, vectors, tail)
    and 16-byte-multiple ones (aligned rows, the unrolled vector loop)."""
    n, pad_bs = 3, 4 * tp
    inputs = _make_inputs(_rng(dtype, tp, vs), tp=tp, n=n, pad_bs=pad_bs, vs=vs, dtype=dtype)
    partials, results = _run(emulated, inputs, tp=tp, n=n, pad_bs=pad_bs, dtype=dtype)
    _check(inputs, partials, results, tp=tp, n=n, pad_bs=pad_bs, dtype=dtype)
    if vs > 16:
        assert LOADS["vectors"] > 0, "no 16-byte loads: the vector body never ran"


def _limits(tp: int, vs: int) -> dict[str, int]:
    v = tp * vs
    cases = {"inside_last_shard": v - vs // 2, "one_column": 1, "inside_first_shard": vs // 2}
    if tp > 1:
        cases["shard_boundary"] = (tp - 1) * vs
        cases["boundary_plus_one"] = (tp - 1) * vs + 1
        cases["first_shard_only"] = vs  # every other shard is empty
    return cases


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_vocab_limit(emulated: Any, dtype: str, tp: int) -> None:
    """Columns >= vocab_limit never count: the limit inside a shard, on a shard
    boundary, and with whole shards left empty (their partials never win)."""
    n, pad_bs, vs = 3, 4 * tp, 45
    for name, limit in _limits(tp, vs).items():
        rng = _rng(dtype, tp, name)
        inputs = _make_inputs(rng, tp=tp, n=n, pad_bs=pad_bs, vs=vs, dtype=dtype)
        # the row's true max past the limit must not win
        for x in inputs:
            x[:, -1] = _encode(np.full(len(x), 1.0e3, dtype=np.float32), dtype)
        kw = {"tp": tp, "n": n, "pad_bs": pad_bs, "dtype": dtype, "vocab_limit": limit}
        partials, results = _run(emulated, inputs, **kw)
        _check(inputs, partials, results, **kw)
        for s, words in enumerate(partials):
            if s * vs >= limit:  # an empty shard: -inf, no column, nothing to add
                assert (words[:, 0] == 0xFF800000).all() and (words[:, 1] == NO_IDX).all()
                assert (words[:, 2] == 0).all()


@pytest.mark.parametrize("bs_on_device", [False, True], ids=["bs_host", "bs_device"])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_phantom_rows_untouched(emulated: Any, dtype: str, tp: int, bs_on_device: bool) -> None:
    """Requests >= bs are phantom: no partial, id or logprob is written for them
    (the outputs were poisoned first); bs from the host or from device memory."""
    n, vs = 3, 29
    pad_bs = 4 * tp
    for bs in sorted({0, 1, pad_bs // 2 + 1, pad_bs - 1, pad_bs}):
        rng = _rng(dtype, tp, bs, bs_on_device)
        inputs = _make_inputs(rng, tp=tp, n=n, pad_bs=pad_bs, vs=vs, dtype=dtype)
        partials, results = _run(
            emulated, inputs, tp=tp, n=n, pad_bs=pad_bs, dtype=dtype, bs=bs,
            bs_on_device=bs_on_device,
        )  # fmt: skip
        _check(inputs, partials, results, tp=tp, n=n, pad_bs=pad_bs, dtype=dtype, bs=bs)


@pytest.mark.parametrize(("block", "grid"), [(1, 1), (5, 3), (32, None), (48, 4), (64, 1)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_launch_geometry(emulated: Any, dtype: str, block: int, grid: int | None) -> None:
    """Any block size (the tree reduction folds odd halves) and grids smaller than the
    row count (grid-stride); partials padded apart in the receive buffer (stride)."""
    tp, n, pad_bs, vs = 3, 2, 6, 611
    inputs = _make_inputs(_rng(dtype, block), tp=tp, n=n, pad_bs=pad_bs, vs=vs, dtype=dtype)
    kw = {"tp": tp, "n": n, "pad_bs": pad_bs, "dtype": dtype}
    partials, results = _run(emulated, inputs, block=block, grid=grid, pad_stride=5, **kw)
    _check(inputs, partials, results, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_and_nans_pick_the_lowest_global_column(emulated: Any, dtype: str) -> None:
    """The cases the reference decides by index, checked against literal columns."""
    tp, n, pad_bs, vs = 4, 1, 4, 37
    rng = _rng(dtype, "literal")
    full = rng.normal(0.0, 1.0, size=(pad_bs * n, tp * vs)).astype(np.float32)
    full[0, vs - 1] = full[0, vs] = 9.0  # rank 0's last, rank 1's first
    full[1, vs + 5] = full[1, 3 * vs + 5] = 9.0  # ranks 1 and 3, mid-shard
    full[2, 3 * vs] = full[2, 2 * vs + 30] = full[2, vs + 36] = np.nan  # first NaN: rank 1
    full[2, 0] = np.inf
    full[3] = -np.inf  # all -inf: column 0
    inputs = [_encode(full[:, s * vs : (s + 1) * vs], dtype) for s in range(tp)]
    kw = {"tp": tp, "n": n, "pad_bs": pad_bs, "dtype": dtype}
    partials, results = _run(emulated, inputs, **kw)
    _check(inputs, partials, results, **kw)
    ids = np.concatenate([ids for ids, _ in results])
    logprobs = np.concatenate([lp for _, lp in results])
    assert ids.tolist() == [vs - 1, vs + 5, vs + 36, 0]
    assert np.isnan(logprobs[2:]).all() and np.isfinite(logprobs[:2]).all()


def test_f16_decode_matches_numpy_for_every_bit_pattern(emulated: Any) -> None:
    """The portable half -> float used by the emulation (the device uses cvt.f32.f16):
    normals, subnormals, signed zeros, infinities, NaNs."""
    out = np.empty(65536, dtype=np.float32)
    emulated.emu_f16_table(_addr(out))
    want = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert (np.isnan(out) == nan).all()
    assert (out[~nan].view(np.uint32) == want[~nan].view(np.uint32)).all()


def _words(m: float, idx: int, s: float) -> np.ndarray:
    w = np.empty(3, dtype=np.uint32)
    w[0] = np.float32(m).view(np.uint32)
    w[1] = idx
    w[2] = np.float32(s).view(np.uint32)
    return w


def _combine(lib: Any, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out = np.empty(3, dtype=np.uint32)
    lib.emu_combine_pair(_addr(a), _addr(b), _addr(out))
    return out


def test_combine_is_commutative_and_associative(emulated: Any) -> None:
    """Partials may be combined in any order (the tree, the owner's rank order): the
    winner (max bits, idx) never depends on it, sumexp only up to rounding."""
    rng = _rng("combine")
    pool = [
        _words(np.nan, 7, 0.0),
        _words(np.nan, 3, 0.0),
        _words(np.inf, 11, 1.0),
        _words(np.inf, 2, 2.0),
        _words(-np.inf, 5, 0.0),
        _words(-np.inf, NO_IDX, 0.0),
        _words(3.0e38, 9, 1.0),
        _words(-3.0e38, 1, 4.0),
        _words(2.5, 4, 3.0),
        _words(2.5, 40, 1.5),
        _words(-1.0, 0, 17.0),
    ]
    pool += [_words(rng.normal(), int(rng.integers(0, 1000)), rng.uniform(1, 50)) for _ in range(8)]
    for a in pool:
        for b in pool:
            ab, ba = _combine(emulated, a, b), _combine(emulated, b, a)
            assert (ab[:2] == ba[:2]).all(), (a, b, ab, ba)
            for c in pool[::3]:
                left = _combine(emulated, _combine(emulated, a, b), c)
                right = _combine(emulated, a, _combine(emulated, b, c))
                assert (left[:2] == right[:2]).all(), (a, b, c, left, right)
                if np.isfinite(left[:1].view(np.float32)).all():
                    sl, sr = left[2:].view(np.float32), right[2:].view(np.float32)
                    np.testing.assert_allclose(sl, sr, rtol=1e-6)
    # empty partials never win and add nothing
    empty = _words(-np.inf, NO_IDX, 0.0)
    x = _words(-2.0, 12, 3.0)
    assert (_combine(emulated, empty, x) == x).all() and (_combine(emulated, x, empty) == x).all()
    # an all -inf shard keeps its first column against an empty one
    neg = _words(-np.inf, 5, 0.0)
    assert (_combine(emulated, empty, neg) == neg).all()
    # sums rescale to the larger max: 1 * e^0 + 2 * e^-1
    got = _combine(emulated, _words(1.0, 8, 1.0), _words(0.0, 3, 2.0))
    assert got[1] == 8
    np.testing.assert_allclose(got[2:].view(np.float32), [1.0 + 2.0 * np.exp(-1.0)], rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_huge_ties_follow_torch(emulated: Any, dtype: str) -> None:
    """Tied maxima at 3e38 (6e4 in float16): torch.log_softmax gives -log(ties) (it
    subtracts the max before the log-sum). The NumPy reference computes
    ``x - (m + log(sum))`` in float64, where ``m + log(3)`` rounds back to ``m`` at
    3e38, so the literal value is checked here and the ids against the reference."""
    tp, n, pad_bs, vs = 2, 1, 2, 40
    rng = _rng(dtype, "huge ties")
    huge = np.float32(_huge(dtype))
    full = rng.uniform(-1.0, 0.9, size=(pad_bs * n, tp * vs)).astype(np.float32) * huge
    full[0, [3, vs - 1, vs]] = huge  # three ties, across the shard boundary
    full[1, [vs + 7, 2 * vs - 1]] = -huge / 2  # a lower tie stays out of the sum
    full[1, 5] = huge
    inputs = [_encode(full[:, s * vs : (s + 1) * vs], dtype) for s in range(tp)]
    _, results = _run(emulated, inputs, tp=tp, n=n, pad_bs=pad_bs, dtype=dtype)
    ids = np.concatenate([ids for ids, _ in results])
    logprobs = np.concatenate([lp for _, lp in results])
    assert ids.tolist() == [3, 5]
    np.testing.assert_allclose(logprobs, [-np.log(3.0), 0.0], atol=ATOL)
    expected = reference_argmax_batch_vocab(
        inputs, tp=tp, num_tokens_per_req=n, pad_bs=pad_bs, dtype=dtype
    )
    assert np.concatenate([i for i, _ in expected]).tolist() == [3, 5]

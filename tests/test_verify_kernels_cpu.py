"""CPU proof of the verify kernels (kernels/verify.cu + verify.cuh, issue 24).

The kernels include no toolkit header, so g++ builds them with a small emulation of the
CUDA launch (as tests/test_argmax_kernels_cpu.py does for argmax): one ``std::thread`` per
CUDA thread walking the blocks in turn, ``std::barrier`` for ``__syncthreads``, GCC
atomics for ``atomicAdd``/``atomicMax``/``atomicCAS``, and ``-ffp-contract=off`` (the
device code uses the ``__*_rn`` intrinsics, which never contract). Every rank's shard goes
through ``dp_verify_records``; each owner's rows of the records are stacked as the all-to-all
would deliver them and go through ``dp_verify_combine``; ``predict``, ``accept_index``
and ``accept_length`` must equal ``ipc_dpsample.layout.reference_verify_batch_vocab``
bit for bit and the logprobs must be within 1 float32 ulp. The same device functions run
inside the one-sided kernels on the GPU (tests/test_verify_onesided_gpu.py).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _cuda_emulation import HEADER, LAUNCH, build
from _verify_bodies import params

from ipc_dpsample.backends.verify_plan import (
    DV_MAX_SOURCES,
    DV_MERGE_MAX,
    SPLIT_MIN_COLUMNS,
    SPLIT_TARGET_UNITS,
    VERIFY_BLOCK_FEW_ROWS,
    VERIFY_BLOCK_MANY_ROWS,
    call_digest,
    kernel_path_refusal,
    list_cap,
    pack_params,
    param_bytes,
    param_offsets,
    record_words,
    verify_block,
    verify_splits,
)
from ipc_dpsample.layout import reference_verify_batch_vocab, verify_params
from ipc_dpsample.protocol import Dtype

KERNEL_DIR = Path(__file__).resolve().parents[1] / "kernels"
POISON = 0x5A5A5A5A

_EMULATION = (
    HEADER
    + '#include "verify.cu"\n'
    + LAUNCH
    + r"""
extern "C" void emu_records(unsigned grid, unsigned block, const u64* v) {
  launch(grid, block, [=]() {
    dp_verify_records(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], (i64)v[8], (i64)v[9],
                      (i64)v[10], v[11], (i64)v[12], (i64)v[13], (i64)v[14], (i64)v[15],
                      (i64)v[16], (i64)v[17], (i64)v[18], v[19], v[20]);
  });
}
extern "C" void emu_records_nolist(unsigned grid, unsigned block, const u64* v) {
  launch(grid, block, [=]() {
    dp_verify_records_nolist(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], (i64)v[8],
                             (i64)v[9], (i64)v[10], v[11], (i64)v[12], (i64)v[13], (i64)v[14],
                             (i64)v[15], (i64)v[16], (i64)v[17], (i64)v[18], v[19], v[20]);
  });
}
extern "C" void emu_combine(unsigned grid, unsigned block, const u64* v) {
  launch(grid, block, [=]() {
    dp_verify_combine(v[0], v[1], v[2], v[3], v[4], v[5], v[6], (i64)v[7], (i64)v[8],
                      (i64)v[9], v[10], (i64)v[11], v[12], (i64)v[13], (i64)v[14], (i64)v[15],
                      (i64)v[16], (i64)v[17], v[18], v[19], v[20], v[21], v[22]);
  });
}
extern "C" void emu_noise(u64 key, const unsigned* ids, i64 count, float* out) {
  for (i64 i = 0; i < count; ++i) out[i] = dv_noise(key, ids[i]);
}
extern "C" void emu_stream_key(i64 seed, i64 offset, unsigned d, u64* out) {
  DvParams p{};
  p.seed = seed;
  p.offset = offset;
  *out = dv_stream_key(p, d);
}
extern "C" void emu_raw_bound_fast(const float* s, const float* T, i64 count, float* out) {
  for (i64 i = 0; i < count; ++i) out[i] = dv_raw_bound_fast(s[i], T[i]);
}
extern "C" void emu_mass(const float* z, i64 count, double* grp, i64* a) {
  for (i64 i = 0; i < count; ++i) dv_mass_term(z[i], grp + i, a + i);
}
extern "C" void emu_threshold(const float* p, const i64* w, i64 count, i64* out) {
  for (i64 i = 0; i < count; ++i) out[i] = dv_top_p_threshold(p[i], w[i]);
}
extern "C" void emu_vector_keys(const float* x, i64 count, unsigned* kept, unsigned* read) {
  for (i64 i = 0; i < count; ++i) {
    kept[i] = dv_vector_key(x[i]);
    read[i] = dv_vector_order_key(kept[i]);
  }
}
extern "C" i64 emu_key_range_mismatches(unsigned t16_first, unsigned t16_count) {
  i64 bad = 0;
  for (unsigned t16 = t16_first; t16 < t16_first + t16_count; ++t16) {
    unsigned lo, span;
    dv_vector_key_range(t16 << 16, &lo, &span);
    for (unsigned h = 0; h < 0x10000u; ++h)
      bad += (dv_vector_order_key(h) >= t16) != (h - lo <= span);
  }
  return bad;
}
"""
)


#: The top-k selection's shared-memory candidate capacity: the default; one so small that
#: every row takes the path that reads the row once per radix digit; and one between, that
#: the tests' wide shards overflow only when the threshold is loose (partial warps, small
#: blocks), which only the top-k tests below ask for (:data:`WITH_EVERY_CAP`: every test
#: twice more would slow CI). The two small ones also build the first pass with one and
#: with four vectors per round (``DV_MAX_UNROLL`` and the top-k kernel's
#: ``DV_LIST_UNROLL``; the defaults are two and four), and keep the
#: vector keys of only the first few vectors of a top-k row (``DV_VKEY_CAP``: the
#: candidates of the rest come from a full second read, as on shards wider than the
#: default 6144 vectors)
CAND_CAPS = {"candidates": None, "small": 320, "row-passes": 16}
VKEY_CAPS = {"small": 200, "row-passes": 8}
#: ... and a warp's list of the vectors to read again so short that wide shards overflow
#: it (then the row is read again in full)
VLISTS = {"small": 2, "row-passes": 1}
#: ... and which temperature rows of batches without top-k rows are read once, their
#: maximum and sampled column from one read (``DV_TEMP_ONEPASS``; a second read only for
#: rows with a NaN or a non-finite maximum): float32 rows on the default build (its
#: default, 1), every row on "row-passes" (2), none on "small" (0)
ONEPASS = {"row-passes": 2, "small": 0}
WITH_EVERY_CAP = pytest.mark.parametrize("lib", sorted(CAND_CAPS), indirect=True)
#: the default build only: tests of paths that the other builds do not change or whose
#: top-k and first-pass variants other tests already run on every build (column blocks:
#: the shard tests run the same selection at other offsets)
DEFAULT_CAP_ONLY = pytest.mark.parametrize("lib", ["candidates"], indirect=True)


#: each build once per session: tests that pair a build with other parameters interleave
#: the builds, and pytest would set the module-scoped fixture up again at every switch
_BUILT: dict[str, Any] = {}


@pytest.fixture(scope="module", params=["candidates", "row-passes"])
def lib(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    name = request.param
    if name not in _BUILT:
        _BUILT[name] = _build_lib(name, tmp_path_factory)
    return _BUILT[name]


def _build_lib(name: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    cap = CAND_CAPS[name]
    unroll = 4 if cap is not None and cap < 64 else 1
    flags: tuple[str, ...] = ()
    if cap is not None:
        flags = (
            f"-DDV_CAND_CAP={cap}",
            f"-DDV_MAX_UNROLL={unroll}",
            f"-DDV_LIST_UNROLL={unroll}",
            f"-DDV_VKEY_CAP={VKEY_CAPS[name]}",
            f"-DDV_VLIST={VLISTS[name]}",
            f"-DDV_TEMP_ONEPASS={ONEPASS[name]}",
        )
    work = tmp_path_factory.mktemp("verify_emulation")
    lib = build(work, _EMULATION, "verify_emulation", flags)
    u, i, c = ctypes.c_uint64, ctypes.c_int64, ctypes.c_uint
    lib.emu_records.argtypes = [c, c, u]
    lib.emu_records_nolist.argtypes = [c, c, u]
    lib.emu_combine.argtypes = [c, c, u]
    lib.emu_noise.argtypes = [u, u, i, u]
    lib.emu_stream_key.argtypes = [i, i, c, u]
    lib.emu_mass.argtypes = [u, i, u, u]
    lib.emu_raw_bound_fast.argtypes = [u, u, i, u]
    lib.emu_threshold.argtypes = [u, u, i, u]
    lib.emu_vector_keys.argtypes = [u, i, u, u]
    return lib


def _addr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


def _encode(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 -> what a rank holds (bfloat16: round-to-nearest-even uint16 bits)."""
    x = np.ascontiguousarray(x, np.float32)
    if dtype == "bfloat16":
        import torch

        return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return x.astype(np.float16 if dtype == "float16" else np.float32)


def run_kernels(
    lib: Any,
    shards: list[np.ndarray],
    cand: np.ndarray,
    prm: dict[str, Any],
    *,
    dtype: str,
    vocab_limit: int | None = None,
    bs: int | None = None,
    bs_on_device: bool = False,
    want_lp: bool = True,
    block: int = 32,
    grid: int = 3,
    raw_params: bool = False,
    digests: list[int] | None = None,
    prms: list[dict[str, Any]] | None = None,
    splits: int = 1,
) -> tuple[tuple[np.ndarray, ...], list[int], list[int]]:
    """Records on every rank, the all-to-all, the combine on every owner; returns
    (predict, accept_index, accept_length, logprobs) of the whole batch, every owner's
    combine error word and every rank's refused-value word.

    ``raw_params``: the kernels read the caller's arrays as given (what a call with
    device parameters does: no host validation, list capacity 128 with top-k); else the
    host-normalised copy (:func:`pack_params`). ``digests`` / ``prms``: a call digest /
    parameters per rank (ranks that disagree). ``splits``: each rank's shard in that many
    column blocks, one record each (what the one-sided push does for small batches), the
    owners combining ``tp * splits`` records per row."""
    tp = len(shards)
    pad_bs, n = cand.shape
    rows, vs = shards[0].shape
    limit = vs * tp if vocab_limit is None else vocab_limit
    real = pad_bs if bs is None else bs
    keep: list[Any] = []

    def pointers(p: dict[str, Any]) -> list[int]:
        if raw_params:
            arrays = [
                None if p[name] is None else np.ascontiguousarray(p[name]) for name in _FIELDS
            ]
            keep.append(arrays)
            return [0 if a is None else _addr(a) for a in arrays]
        params = verify_params(
            pad_bs=pad_bs, num_tokens_per_req=n, vocab_size=vs * tp, vocab_limit=vocab_limit,
            bs=bs, **p,
        )  # fmt: skip
        assert kernel_path_refusal(params, tp) is None
        packed = pack_params(params)
        assert packed.nbytes == param_bytes(pad_bs)  # the device buffers' size
        keep.append(packed)
        return [_addr(packed) + off for off in param_offsets(pad_bs)]

    if raw_params:
        cap = 128 if prm["top_k"] is not None else 0
    else:
        cap = list_cap(
            verify_params(
                pad_bs=pad_bs, num_tokens_per_req=n, vocab_size=vs * tp,
                vocab_limit=vocab_limit, bs=bs, **prm,
            )
        )  # fmt: skip
    ptrs = [pointers(prm if prms is None else prms[s]) for s in range(tp)]
    words = record_words(cap)
    digest = call_digest(limit, cap, want_lp, n)
    bs_word = np.array([real], np.int32)
    bs_ptr, bs_host = (_addr(bs_word), -5) if bs_on_device else (0, real)
    code = int(Dtype[dtype.upper()])
    records, values = [], []
    cs = ((vs + splits - 1) // splits + 7) & ~7  # columns per block, as onesided.cu
    for s in range(tp):
        ev = np.zeros(1, np.uint32)
        for b in range(splits):
            block_cols = np.ascontiguousarray(shards[s][:, b * cs : (b + 1) * cs])
            keep.append(block_cols)
            out = np.full((rows, words), POISON, np.uint32)
            dg = digest if digests is None else digests[s]
            args = [_addr(block_cols), _addr(cand), *ptrs[s], cap, int(want_lp), dg]
            args += [bs_ptr, bs_host, rows, block_cols.shape[1], s * vs + b * cs, limit, code, n]
            args += [_addr(out), _addr(ev)]
            # the kernel the backends launch: without top-k lists, less shared memory
            records_kernel = lib.emu_records if cap else lib.emu_records_nolist
            records_kernel(grid, block, _addr(_words(args)))
            records.append(out)
        values.append(int(ev[0]))
    r = pad_bs // tp
    predict = np.full((pad_bs, n), POISON, np.int32)
    accept_index = np.full((pad_bs, n), POISON, np.int32)
    accept_length = np.full(pad_bs, POISON, np.int32)
    logprobs = np.full((pad_bs, n), np.nan, np.float32)
    errors = []
    for o in range(tp):
        recs = np.ascontiguousarray(np.stack([rec[o * r * n : (o + 1) * r * n] for rec in records]))
        outs = [predict[o * r :], accept_index[o * r :], accept_length[o * r :], logprobs[o * r :]]
        err = np.zeros(1, np.uint32)
        dg = digest if digests is None else digests[o]
        args = [_addr(cand), *ptrs[o], cap, int(want_lp), dg, bs_ptr, bs_host, _addr(recs)]
        args += [tp * splits, r, n, o * r, limit, *(_addr(a) for a in outs), _addr(err)]
        lib.emu_combine(grid, block, _addr(_words(args)))
        errors.append(int(err[0]))
    return (predict, accept_index, accept_length, logprobs), errors, values


def _words(args: list[int]) -> np.ndarray:
    """Kernel arguments as the 64-bit words of a parameter block (negatives two's
    complement)."""
    return np.array([a & 0xFFFFFFFFFFFFFFFF for a in args], np.uint64)


_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "offset")


def _stream_params(
    g: np.random.Generator,
    temperature: np.ndarray,
    top_k: np.ndarray | None = None,
    top_p: np.ndarray | None = None,
) -> dict[str, Any]:
    """Per-request parameters: ``temperature`` (float32 ``[pad_bs]``), ``top_k`` and
    ``top_p`` as given (None: off), no min-p, and fresh noise streams (``seed`` then
    ``offset``, drawn from ``g``)."""
    pad_bs = len(temperature)
    return {
        "temperature": temperature,
        "seed": g.integers(0, 2**40, pad_bs),
        "offset": g.integers(0, 2**40, pad_bs),
        "top_k": top_k,
        "top_p": top_p,
        "min_p": None,
    }


def _params(g: np.random.Generator, pad_bs: int, mode: str) -> dict[str, Any]:
    """``tests/_verify_bodies.params`` of ``mode`` (keyed by a draw of ``g``), plus the
    kernels' own mixes: ``top_k_min_p``, and ``mixed`` with top-p / min-p only where
    top-k is on (the kernels' domain)."""
    key = (int(g.integers(2**31)),)
    if mode == "top_k_min_p":
        out = params(key, pad_bs, "top_k_top_p")
        out["top_k"] = np.asarray(g.choice([3, 40, 128], pad_bs), np.int32)
        out["top_p"] = np.asarray(g.choice([1.0, 0.8], pad_bs), np.float32)
        out["min_p"] = np.asarray(g.choice([0.05, 0.3], pad_bs), np.float32)
        return out
    out = params(key, pad_bs, mode)
    if mode == "mixed":
        on = (out["top_k"] >= 2) & (out["top_k"] <= 128)
        out["top_p"] = np.where(on, out["top_p"], 1).astype(np.float32)
        out["min_p"] = np.where(on, out["min_p"], 0).astype(np.float32)
    return out


def _logits(g: np.random.Generator, rows: int, v: int, scale: float, specials: bool) -> np.ndarray:
    x = (g.standard_normal((rows, v)) * scale).astype(np.float32)
    x[np.abs(x) < 1e-3] = 0.75
    if specials and rows >= 8:
        x[0] = -np.inf
        x[1, int(g.integers(v))] = np.nan
        x[2, int(g.integers(v))] = np.inf
        x[3, : v // 2] = -np.inf
        x[4, int(g.integers(v))] = 6.0e4
        x[5] = 1.5  # every column ties
        x[6, ::3] = 2.0  # many ties at the top
        x[7, 5] = -0.0
        x[7, 6] = 0.0
    return x


def _check(got: tuple[np.ndarray, ...], want: tuple[np.ndarray, ...], real: int, what: str) -> None:
    for name, gv, wv in zip(("predict", "accept_index", "accept_length"), got, want, strict=False):
        bad = np.argwhere(gv[:real] != wv[:real])
        assert not len(bad), (
            f"{what}: {name} differs at {bad[:4].tolist()}: {gv[:real]} vs {wv[:real]}"
        )
    if len(want) == 4:
        lw, lg = want[3][:real], got[3][:real]
        assert np.array_equal(np.isnan(lw), np.isnan(lg)), f"{what}: NaN pattern of logprobs"
        ok = ~np.isnan(lw)
        ulps = np.abs(lg[ok].view(np.int32).astype(np.int64) - lw[ok].view(np.int32))
        assert not ulps.size or ulps.max() <= 1, f"{what}: logprobs off by {ulps.max()} ulp"


def _case(
    lib: Any,
    seed: int,
    *,
    tp: int,
    vs: int,
    n: int,
    pad_bs: int,
    dtype: str,
    mode: str,
    vocab_limit: int | None = None,
    bs: int | None = None,
    bs_on_device: bool = False,
    want_lp: bool = True,
    scale: float = 2.0,
    specials: bool = False,
    block: int = 32,
    raw_params: bool = False,
    splits: int = 1,
) -> None:
    g = np.random.default_rng([seed, tp, vs, n, pad_bs])
    v = vs * tp
    full = _encode(_logits(g, pad_bs * n, v, scale, specials), dtype)
    shards = [np.ascontiguousarray(full[:, s * vs : (s + 1) * vs]) for s in range(tp)]
    prm = _params(g, pad_bs, mode)
    kw = dict(tp=tp, pad_bs=pad_bs, dtype=dtype, vocab_limit=vocab_limit, bs=bs)
    first = reference_verify_batch_vocab(shards, np.zeros((pad_bs, n), np.int32), **kw, **prm)
    # candidates that follow the sampled tokens for a random number of drafts
    cand = g.integers(0, v, (pad_bs, n)).astype(np.int32)
    for req in range(pad_bs):
        keep = int(g.integers(0, n))
        cand[req, 1 : keep + 1] = first[0][req, :keep]
    want = reference_verify_batch_vocab(shards, cand, **kw, **prm, return_logprobs=want_lp)
    got, errors, values = run_kernels(
        lib,
        shards,
        cand,
        prm,
        dtype=dtype,
        vocab_limit=vocab_limit,
        bs=bs,
        bs_on_device=bs_on_device,
        want_lp=want_lp,
        block=block,
        raw_params=raw_params,
        splits=splits,
    )
    assert errors == [0] * tp and values == [0] * tp
    real = pad_bs if bs is None else bs
    _check(got if want_lp else got[:3], want, real, f"{mode} {dtype} tp={tp} vs={vs} n={n}")
    # requests >= bs are not written
    assert (got[2][real:] == POISON).all()


# -- the pieces against the reference ------------------------------------------------------
def test_noise_and_stream_key_match_layout(lib: Any) -> None:
    from ipc_dpsample.layout import gumbel_noise, noise_stream_key

    g = np.random.default_rng(5)
    for _ in range(20):
        seed, off = int(g.integers(-(2**62), 2**62)), int(g.integers(-(2**62), 2**62))
        d = int(g.integers(0, 8))
        out = np.zeros(1, np.uint64)
        lib.emu_stream_key(seed, off, d, _addr(out))
        with np.errstate(over="ignore"):
            want = noise_stream_key(np.array([seed]), np.array([off]) + d)[0]
        assert out[0] == want
        ids = g.integers(0, 2**21, 4096).astype(np.uint32)
        noise = np.zeros(len(ids), np.float32)
        lib.emu_noise(int(out[0]), _addr(ids), len(ids), _addr(noise))
        assert np.array_equal(noise.view(np.int32), gumbel_noise(out[0], ids).view(np.int32))


@DEFAULT_CAP_ONLY
def test_vector_key_range_is_the_order_key_test(lib: Any) -> None:
    # the second pass tests a kept key h as one unsigned range (dv_vector_key_range):
    # for every threshold key and every h, the same answer as dv_vector_order_key(h) >=
    # thr >> 16 (all 2**32 pairs)
    lib.emu_key_range_mismatches.restype = ctypes.c_int64
    assert lib.emu_key_range_mismatches(0, 0x10000) == 0


def test_vector_keys_never_fall_below_the_order_key(lib: Any) -> None:
    # the top-k pass reads a vector again when its kept key (the upper 16 bits of its
    # maximum) reads at or above the threshold's upper 16 bits: the read key must be at
    # least dv_order_key(max) >> 16 (-0 as +0), and equal to it but for the negative
    # values whose upper bits are -0's (tiny negatives read as -0: only more reads)
    g = np.random.default_rng(29)
    bits = np.concatenate(
        [
            g.integers(0, 2**32, 20000, dtype=np.uint64),
            [0, 0x80000000, 0x80000001, 0x8000FFFF, 0x00000001, 0x7F7FFFFF, 0xFF7FFFFF],
            [0x7F800000, 0xFF800000, 0x3F800000, 0xBF800000, 0x80010000, 0x0000FFFF],
        ]
    ).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[~np.isnan(x)]
    kept = np.zeros(len(x), np.uint32)
    read = np.zeros(len(x), np.uint32)
    lib.emu_vector_keys(_addr(x), len(x), _addr(kept), _addr(read))
    u = x.view(np.uint32).astype(np.uint64)
    u = np.where(u == 0x80000000, 0, u)  # -0 as +0
    want = (np.where(u & 0x80000000, ~u & 0xFFFFFFFF, u | 0x80000000) >> 16).astype(np.uint32)
    assert np.array_equal(kept, (x.view(np.uint32) >> 16).astype(np.uint32))
    assert (read >= want).all()
    loose = read != want
    assert np.array_equal(loose, (kept == 0x8000) & (x < 0))
    assert loose.any()  # the case is in the data


@DEFAULT_CAP_ONLY
def test_fast_raw_bound_is_at_or_below_the_exact_one(lib: Any) -> None:
    # dv_raw_bound_fast (the one-read temperature pass's bound, DV_TEMP_ONEPASS): no raw
    # logit below it reaches the score s, i.e. float32(float32(x / T) + G) < s for the
    # float just below it, and it sits within 2**-16 of the exact bound (relative to the
    # bound, plus (|s| + G) * T: a score's own rounding, in raw units, plus 1e-30): scores of
    # every size and sign, subnormal ones, temperatures far apart
    g = np.random.default_rng(9)
    big = g.standard_normal(20000) * np.exp(g.uniform(-20, 20, 20000))
    s = np.concatenate([big, g.uniform(-40, 40, 20000), [0, -0.0, 1e-45, -1e-45, 16.6375, 3e38]])
    s = s.astype(np.float32)
    t = np.exp(g.uniform(np.log(1e-6), np.log(1e3), len(s))).astype(np.float32)
    t[:6] = [1e-38, 1e-45, 1.0, 0.5, 7.0, 1e30]
    fast = np.zeros(len(s), np.float32)
    lib.emu_raw_bound_fast(_addr(s), _addr(t), len(s), _addr(fast))
    gb = np.float32(16.6375)  # DV_G_BOUND

    def reaches(x: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore", invalid="ignore"):
            return (x / t).astype(np.float32) + gb >= s

    below = np.nextafter(fast, np.float32(-np.inf))
    assert not reaches(below)[np.isfinite(below)].any()
    slack = (np.abs(fast) + (np.abs(s) + gb) * t) * np.float32(2**-16) + np.float32(1e-30)
    with np.errstate(over="ignore"):
        above = (fast + slack).astype(np.float32)
    ok = np.isfinite(above) & np.isfinite(s)
    assert reaches(above)[ok].all(), "the fast bound is far below the exact one"
    assert (fast[~np.isfinite(s)] == -np.inf).all()


def test_mass_terms_and_threshold_match_layout(lib: Any) -> None:
    from ipc_dpsample.layout import mass_terms, top_p_threshold

    g = np.random.default_rng(6)
    z = np.concatenate([g.normal(0, 30, 5000), [0.0, -0.0, 1e-30, 80.0, -80.0, 3e38]])
    z = z.astype(np.float32)
    grp, a = np.zeros(len(z)), np.zeros(len(z), np.int64)
    lib.emu_mass(_addr(z), len(z), _addr(grp), _addr(a))
    wg, wa = mass_terms(z)
    assert np.array_equal(grp, wg) and np.array_equal(a, wa)
    p = np.concatenate([g.uniform(0, 1, 3000), [1e-45, 1e-40, 2**-24, 0.5, 0.99999994]])
    p = p.astype(np.float32)
    w = g.integers(0, 2**53, len(p), dtype=np.int64)
    w[:5] = [0, 1, 2**53 - 1, 3, 2**40]
    out = np.zeros(len(p), np.int64)
    lib.emu_threshold(_addr(p), _addr(w), len(p), _addr(out))
    assert np.array_equal(out, top_p_threshold(p, w))


# -- whole calls ------------------------------------------------------------------------------
#: float16 on the default build only: it shares bfloat16's 8-column vectors, and the
#: builds differ in the top-k capacity and the unroll, not in how a dtype is unpacked
@pytest.mark.parametrize(
    ("lib", "dtype"),
    [
        ("candidates", "float32"),
        ("candidates", "bfloat16"),
        ("candidates", "float16"),
        ("row-passes", "float32"),
        ("row-passes", "bfloat16"),
    ],
    indirect=["lib"],
)
@pytest.mark.parametrize(
    "mode", ["greedy", "temperature", "top_k", "top_k_top_p", "top_k_min_p", "mixed"]
)
def test_kernels_match_reference(lib: Any, mode: str, dtype: str) -> None:
    for tp in (1, 2, 3):
        _case(
            lib,
            11,
            tp=tp,
            vs=203,
            n=3,
            pad_bs=2 * tp,
            dtype=dtype,
            mode=mode,
            specials=mode in ("mixed", "greedy", "top_k"),
        )


@pytest.mark.parametrize("tp", [4, 8])
def test_kernels_wide_tp(lib: Any, tp: int) -> None:
    _case(lib, 12, tp=tp, vs=150, n=2, pad_bs=tp, dtype="float32", mode="mixed", specials=True)
    _case(lib, 13, tp=tp, vs=150, n=2, pad_bs=tp, dtype="bfloat16", mode="top_k_top_p")


def test_kernels_real_rows_and_vocab_limit(lib: Any) -> None:
    # bs < pad_bs (host and device scalar), vocab_limit cutting a shard and whole shards
    _case(
        lib,
        14,
        tp=3,
        vs=101,
        n=2,
        pad_bs=6,
        dtype="float32",
        mode="mixed",
        bs=4,
        vocab_limit=250,
        specials=True,
    )
    _case(
        lib,
        15,
        tp=4,
        vs=64,
        n=3,
        pad_bs=8,
        dtype="float16",
        mode="top_k",
        bs=5,
        bs_on_device=True,
        vocab_limit=70,
    )
    _case(lib, 16, tp=2, vs=80, n=2, pad_bs=4, dtype="float32", mode="temperature", bs=0)


@WITH_EVERY_CAP
def test_kernels_flat_and_peaked_rows(lib: Any) -> None:
    # flat rows (small scale): nuclei of many tokens, ties of scores far apart; peaked
    # rows (large scale): pruning of the temperature pass
    for scale in (0.05, 8.0):
        for mode in ("temperature", "top_k_top_p"):
            _case(
                lib,
                17,
                tp=2,
                vs=301,
                n=2,
                pad_bs=4,
                dtype="float32",
                mode=mode,
                scale=scale,
                want_lp=False,
            )


@pytest.mark.parametrize("block", [8, 256])
def test_temperature_queues_on_wide_shards(lib: Any, block: int) -> None:
    # the temperature pass queues the columns that pass its bound per warp and scores a
    # warp's worth at a time: wide shards (many full queues, a misaligned vector head
    # from vs % 8 != 0), flat rows (every column passes) and peaked ones (few do), full
    # warps and a partial one (block 8)
    for k, (dtype, scale) in enumerate(
        [("float32", 0.05), ("bfloat16", 4.0), ("float16", 1.0), ("float32", 8.0)]
    ):
        _case(
            lib,
            40 + k,
            tp=2,
            vs=1501,
            n=2,
            pad_bs=2,
            dtype=dtype,
            mode="temperature",
            scale=scale,
            block=block,
        )


#: block 32 on every build; block 256 on all but "small" (whose case is block 32's overflow)
@pytest.mark.parametrize(
    ("lib", "block"),
    [("candidates", 32), ("candidates", 256), ("row-passes", 32), ("row-passes", 256),
     ("small", 32)],
    indirect=["lib"],
)  # fmt: skip
def test_top_k_on_wide_shards(lib: Any, block: int) -> None:
    # the top-k pass gathers the columns at or above a threshold from the lanes' own
    # maxima: wide shards, full warps (a tight threshold) and one warp (block 32: the
    # k-th largest of 32 lane maxima, or every column for k > 32, which the "small"
    # capacity overflows back to the row passes, as it does on the tie rows), every
    # dtype, with and without top-p / min-p
    for k, (dtype, mode, specials) in enumerate(
        [
            ("float32", "top_k", True),
            ("bfloat16", "top_k_top_p", False),
            ("float16", "top_k_min_p", False),
        ]
    ):
        _case(
            lib,
            50 + k,
            tp=2,
            vs=1501,
            n=2,
            pad_bs=4 if specials else 2,
            dtype=dtype,
            mode=mode,
            specials=specials,
            block=block,
        )


@WITH_EVERY_CAP
def test_top_k_threshold_sits_at_the_kth_digit(lib: Any) -> None:
    # top-k 3 on one warp: three 1.0, one 1.1 and two 1.2 among -100; the threshold (the
    # third largest of the lanes' maxima) sits at or below the third largest column, and
    # the row's first three, 1.2, 1.2 and 1.1, must all be gathered (the name is from the
    # radix-digit threshold this case was written for)
    tp, vs, n, pad_bs = 1, 1000, 1, 8
    g = np.random.default_rng(24)
    full = np.full((pad_bs, vs), -100.0, np.float32)
    full[:, [5, 70, 200]] = 1.0
    full[:, 600] = 1.1
    full[:, [800, 990]] = 1.2
    prm = _stream_params(g, np.ones(pad_bs, np.float32), top_k=np.full(pad_bs, 3, np.int32))
    cand = np.zeros((pad_bs, n), np.int32)
    got, _, _ = run_kernels(lib, [full], cand, prm, dtype="float32", block=32)
    want = reference_verify_batch_vocab([full], cand, tp=tp, pad_bs=pad_bs, dtype="float32", **prm)
    assert np.isin(want[0], [600, 800, 990]).all()
    assert np.array_equal(got[0], want[0])


@pytest.mark.parametrize("block", [8, 32, 256])
@DEFAULT_CAP_ONLY
def test_first_maximum_among_equal_maxima(lib: Any, block: int) -> None:
    # the first column of a row's maximum wins: equal maxima in later vectors of the same
    # thread (block 8: several vectors a thread) and of other threads, in other places of
    # their vectors, and maxima that are zeros of both signs (-0 == +0: the first one
    # wins, whatever its sign), on greedy, temperature and top-k rows alike
    tp, vs, n, pad_bs = 2, 4096, 1, 12
    g = np.random.default_rng(43)
    full = -(g.random((pad_bs, vs * tp)) + 1.0).astype(np.float32)
    for r in range(pad_bs):
        cols = np.sort(g.choice(vs * tp, 40, replace=False))
        if r % 3 == 0:
            full[r, cols] = 3.0  # equal maxima everywhere
        elif r % 3 == 1:
            full[r, cols] = np.where(g.random(40) < 0.5, -0.0, 0.0)  # signed zeros
        else:
            full[r, cols[::2]] = -0.0
            full[r, cols[1::2]] = 0.0
            full[r, cols[-1]] = 1e-45  # the one positive maximum, last
    shards = [np.ascontiguousarray(full[:, s * vs : (s + 1) * vs]) for s in range(tp)]
    prm = _stream_params(
        g,
        np.where(np.arange(pad_bs) % 4 < 2, 0.0, 0.7).astype(np.float32),
        top_k=np.where(np.arange(pad_bs) % 4 == 3, 5, 0).astype(np.int32),
    )
    cand = np.zeros((pad_bs, n), np.int32)
    got, errors, values = run_kernels(lib, shards, cand, prm, dtype="float32", block=block)
    want = reference_verify_batch_vocab(
        shards, cand, tp=tp, pad_bs=pad_bs, dtype="float32", return_logprobs=True, **prm
    )
    assert errors == [0] * tp and values == [0] * tp
    _check(got, want, pad_bs, f"equal maxima block={block}")
    greedy = prm["temperature"] == 0
    assert np.array_equal(got[0][greedy, 0], np.argmax(full[greedy], axis=1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@DEFAULT_CAP_ONLY
def test_top_k_rows_whose_threshold_is_negative_or_zero(lib: Any, dtype: str) -> None:
    # the second pass keeps the vectors whose raw key lies in one range, which differs
    # for a threshold above zero, at zero (-0 counts as +0) and below zero: rows of
    # negative logits only, rows of exact zeros of both signs among tiny values of both
    # signs, and rows of zeros and negatives, at top-k 2 and 50 (block 256: the
    # threshold from the warps' lanes is tight, so most vectors are skipped)
    tp, vs, n, pad_bs = 2, 1536, 1, 12
    g = np.random.default_rng(41)
    full = (g.standard_normal((pad_bs, vs * tp)) - 60).astype(np.float32)
    full[4:8] = g.standard_normal((4, vs * tp)).astype(np.float32) * 1e-38
    full[4:8][g.random((4, vs * tp)) < 0.3] = 0.0
    full[4:8][g.random((4, vs * tp)) < 0.3] = -0.0
    full[8:] = np.where(g.random((4, vs * tp)) < 0.05, 0.0, -(g.random((4, vs * tp)) + 1))
    full[10, ::7] = -0.0
    full = _encode(full, dtype)
    shards = [np.ascontiguousarray(full[:, s * vs : (s + 1) * vs]) for s in range(tp)]
    prm = _stream_params(
        g,
        np.ones(pad_bs, np.float32),
        top_k=np.where(np.arange(pad_bs) % 2 == 0, 2, 50).astype(np.int32),
    )
    cand = np.zeros((pad_bs, n), np.int32)
    got, errors, values = run_kernels(lib, shards, cand, prm, dtype=dtype, block=256, want_lp=False)
    want = reference_verify_batch_vocab(shards, cand, tp=tp, pad_bs=pad_bs, dtype=dtype, **prm)
    assert errors == [0] * tp and values == [0] * tp
    _check(got[:3], want, pad_bs, f"top-k rows at or below zero {dtype}")


@pytest.mark.parametrize("block", [8, 32, 256])
def test_temperature_contender_left_in_a_queue(lib: Any, block: int) -> None:
    # two equal maxima per shard row, every other column far below: the pass's only
    # contenders are the first (the initial best) and the last column of the shard, which
    # wins on about half the rows, and which no full queue ever scores (the queues'
    # leftovers must be)
    tp, vs, n, pad_bs = 2, 997, 1, 64
    g = np.random.default_rng(23)
    full = (g.standard_normal((pad_bs, vs * tp)) - 60).astype(np.float32)
    for s in range(tp):
        full[:, s * vs] = full[:, (s + 1) * vs - 1] = 5.0
    shards = [np.ascontiguousarray(full[:, s * vs : (s + 1) * vs]) for s in range(tp)]
    prm = _stream_params(g, np.ones(pad_bs, np.float32))
    cand = np.zeros((pad_bs, n), np.int32)
    got, _, _ = run_kernels(lib, shards, cand, prm, dtype="float32", block=block)
    want = reference_verify_batch_vocab(shards, cand, tp=tp, pad_bs=pad_bs, dtype="float32", **prm)
    assert np.array_equal(got[0], want[0])
    last = np.isin(want[0][:, 0], [(s + 1) * vs - 1 for s in range(tp)])
    assert 10 < last.sum() < pad_bs - 10, "the last columns should win about half the rows"


@WITH_EVERY_CAP
@pytest.mark.parametrize("block", [32, 256])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_temperature_rows_that_test_a_rising_bound(lib: Any, block: int, dtype: str) -> None:
    # a temperature row read once (every row on "row-passes", float32 rows on the default
    # build; "small" reads each row twice) bounds the columns it scores by the best score
    # found so far, which rises as it goes: rows rising to the end (each vector a
    # new maximum, so every bound is soon passed), falling rows, rows whose first vectors
    # are all -inf (no seed), rows with a lone winner at the end, rows whose scores x / T
    # overflow to +inf at a tiny temperature (every column then passes), rows of one
    # value, and after each a row of far lower values, whose CTA must not keep the
    # previous row's bound
    tp, vs, n = 2, 1501, 1
    g = np.random.default_rng(31)
    ramp = np.linspace(-30.0, 30.0, vs * tp, dtype=np.float32)
    rows = [
        ramp,
        ramp[::-1].copy(),
        np.where(np.arange(vs * tp) % vs < 700, -np.inf, g.standard_normal(vs * tp) * 3),
        np.concatenate([g.standard_normal(vs * tp - 1) - 12, [3.0]]),
        g.standard_normal(vs * tp) * 5 + 1e3,
        np.full(vs * tp, 2.5),
    ]
    full = []
    for r in rows:
        full += [r, g.standard_normal(vs * tp) * 2 - 200]
    full = _encode(np.asarray(full, np.float32), dtype)
    pad_bs = len(full)
    temp = np.where(np.arange(pad_bs) // 2 == 4, 1e-37, 0.8).astype(np.float32)
    shards = [np.ascontiguousarray(full[:, s * vs : (s + 1) * vs]) for s in range(tp)]
    prm = _stream_params(g, temp)
    cand = np.zeros((pad_bs, n), np.int32)
    got, errors, values = run_kernels(lib, shards, cand, prm, dtype=dtype, block=block)
    want = reference_verify_batch_vocab(
        shards, cand, tp=tp, pad_bs=pad_bs, dtype=dtype, return_logprobs=True, **prm
    )
    assert errors == [0] * tp and values == [0] * tp
    _check(got, want, pad_bs, f"rising bound {dtype} block={block}")
    assert want[0][6, 0] == vs * tp - 1  # the lone winner at the end


@DEFAULT_CAP_ONLY
@pytest.mark.parametrize("splits", [2, 3, 5])
def test_column_blocks_combine_like_shards(lib: Any, splits: int) -> None:
    # small batches: the one-sided push splits each shard row into column blocks, one
    # record each (the last ones may be empty), and the owners combine tp * splits
    # records per row; every mode, the three dtypes, vocab_limit cutting blocks
    for k, (dtype, mode) in enumerate(
        [
            ("float32", "mixed"),
            ("bfloat16", "temperature"),
            ("float16", "top_k_top_p"),
            ("float32", "top_k_min_p"),
        ]
    ):
        _case(
            lib,
            60 + k,
            tp=2,
            vs=203,
            n=2,
            pad_bs=4,
            dtype=dtype,
            mode=mode,
            specials=mode == "mixed",
            vocab_limit=350 if k % 2 else None,
            splits=splits,
        )


def test_verify_block_widens_the_ctas_of_small_batches_only() -> None:
    # 8 ranks on one H100 or H200 (132 SMs, 3 CTAs of 256 threads each): pad_bs=8, N=4
    # fits in one wave of 256-thread CTAs, pad_bs=256 does not
    assert verify_block(rows=32, gpu_sharing=8, resident_ctas=396) == VERIFY_BLOCK_FEW_ROWS
    assert verify_block(rows=1024, gpu_sharing=8, resident_ctas=396) == VERIFY_BLOCK_MANY_ROWS
    assert verify_block(rows=1024, gpu_sharing=1, resident_ctas=396) == VERIFY_BLOCK_MANY_ROWS
    assert verify_block(rows=396, gpu_sharing=1, resident_ctas=396) == VERIFY_BLOCK_FEW_ROWS
    assert verify_block(rows=397, gpu_sharing=1, resident_ctas=396) == VERIFY_BLOCK_MANY_ROWS
    assert verify_block(rows=1, gpu_sharing=0, resident_ctas=0) == VERIFY_BLOCK_FEW_ROWS
    assert (VERIFY_BLOCK_FEW_ROWS, VERIFY_BLOCK_MANY_ROWS) == (256, 128)


def test_verify_splits_stay_within_what_the_owners_hold() -> None:
    region = 8 * (256 // 8 * 4) * 268  # u32 of one parity at tp=8, max_pad_bs=256, N=4
    shard = 152064 // 8
    assert verify_splits(rows=32, tp=8, vocab_shard=shard, cap=0, region_words=region) == 8
    assert verify_splits(rows=32, tp=8, vocab_shard=shard, cap=50, region_words=region) == 2
    assert verify_splits(rows=32, tp=8, vocab_shard=shard, cap=128, region_words=region) == 1
    assert verify_splits(rows=1024, tp=8, vocab_shard=shard, cap=0, region_words=region) == 1
    # 8 ranks on one GPU share its SMs: a block of work each already fills it
    kw = dict(rows=32, tp=8, vocab_shard=shard, cap=0, region_words=region)
    assert verify_splits(**kw, gpu_sharing=8) == 1
    assert verify_splits(**kw, gpu_sharing=2) == 4
    for rows in (1, 4, 32, 100, 512, 4096):
        for tp in (1, 2, 3, 8, 64):
            for cap in (0, 2, 50, 128):
                for shard in (97, 2048, 19008, 152064):
                    if tp * cap > DV_MERGE_MAX:
                        continue
                    words = tp * rows * record_words(128)
                    s = verify_splits(
                        rows=rows, tp=tp, vocab_shard=shard, cap=cap, region_words=words
                    )
                    assert s >= 1 and tp * s <= max(tp, DV_MAX_SOURCES)
                    assert tp * s * cap <= DV_MERGE_MAX
                    assert s == 1 or s * rows * record_words(cap) <= words
                    assert s == 1 or shard // s >= SPLIT_MIN_COLUMNS
                    assert s == 1 or rows * s <= SPLIT_TARGET_UNITS
    # IPC_DPSAMPLE_VERIFY_SPLITS (want=) sets the count, within the same hard limits
    kw = dict(rows=32, tp=8, vocab_shard=shard, cap=0, region_words=region, gpu_sharing=8)
    assert verify_splits(**kw, want=3) == 3
    assert verify_splits(**kw, want=64) == DV_MAX_SOURCES // 8
    assert verify_splits(**{**kw, "cap": 50}, want=3) == 2  # 8 * 2 * 50 <= DV_MERGE_MAX
    assert verify_splits(**{**kw, "vocab_shard": 2}, want=3) == 2  # a column per block
    assert verify_splits(**{**kw, "region_words": 32 * record_words(0) * 2}, want=5) == 2
    # ranks that split differently never combine silently: the digest says
    assert call_digest(1000, 0, False, 4, 1) == call_digest(1000, 0, False, 4)
    assert call_digest(1000, 0, False, 4, 2) != call_digest(1000, 0, False, 4)


def test_kernels_n1_and_block_sizes(lib: Any) -> None:
    _case(lib, 18, tp=2, vs=97, n=1, pad_bs=4, dtype="float32", mode="mixed", specials=False)
    for block in (1, 8, 256):
        _case(lib, 19, tp=2, vs=130, n=2, pad_bs=4, dtype="bfloat16", mode="top_k", block=block)


def test_top_p_boundary_is_exclusive(lib: Any) -> None:
    # two equal maxima, top-k 2, top-p 0.5: the second column's mass-before equals
    # ceil(0.5 * W) exactly, so only the first (lower id) survives, whatever the noise
    tp, vs, n, pad_bs = 2, 40, 1, 64
    g = np.random.default_rng(21)
    full = (g.standard_normal((pad_bs, vs * tp)) - 20).astype(np.float32)
    full[:, 7] = full[:, vs + 3] = 5.0
    shards = [np.ascontiguousarray(full[:, s * vs : (s + 1) * vs]) for s in range(tp)]
    prm = _stream_params(
        g,
        np.ones(pad_bs, np.float32),
        top_k=np.full(pad_bs, 2, np.int32),
        top_p=np.full(pad_bs, 0.5, np.float32),
    )
    cand = np.zeros((pad_bs, n), np.int32)
    got, _, _ = run_kernels(lib, shards, cand, prm, dtype="float32")
    assert (got[0][:, 0] == 7).all()
    want = reference_verify_batch_vocab(shards, cand, tp=tp, pad_bs=pad_bs, dtype="float32", **prm)
    assert np.array_equal(got[0], want[0])


def test_raw_device_parameters_are_normalised_by_the_kernels(lib: Any) -> None:
    # what a call with device parameters runs: the caller's arrays as given (top-k 0,
    # 1 << 30 and >= vocab_limit off; phantom requests holding garbage), list capacity 128
    for mode, dtype in (("mixed", "float32"), ("top_k_min_p", "bfloat16"), ("greedy", "float16")):
        _case(lib, 22, tp=3, vs=90, n=2, pad_bs=6, dtype=dtype, mode=mode, specials=True,
              raw_params=True, bs=5, vocab_limit=260)  # fmt: skip


@pytest.mark.parametrize(
    ("field", "value", "code"),
    [
        ("temperature", -1.0, 1),
        ("temperature", np.nan, 1),
        ("top_k", 129, 2),
        ("top_k", -3, 2),
        ("top_p", 0.0, 3),
        ("top_p", 1.5, 3),
        ("min_p", 1.0, 4),
        ("top_p", 0.9, 5),  # top-p without top-k on a sampled request
    ],
)
def test_refused_device_values_are_reported(lib: Any, field: str, value: Any, code: int) -> None:
    g = np.random.default_rng(23)
    tp, vs, n, pad_bs = 2, 100, 2, 4  # V = 200 > every top-k of the mode
    full = _logits(g, pad_bs * n, vs * tp, 2.0, False)
    shards = [np.ascontiguousarray(full[:, s * vs : (s + 1) * vs]) for s in range(tp)]
    prm = _params(g, pad_bs, "top_k_top_p")
    prm["temperature"] = np.ones(pad_bs, np.float32)
    prm["min_p"] = np.zeros(pad_bs, np.float32)
    if code == 5:
        prm["top_k"] = np.array([0, 0, 0, 5], np.int32)
        prm["top_p"] = np.ones(pad_bs, np.float32)
    dt = {"top_k": np.int32}.get(field, np.float32)
    prm[field] = np.array(prm[field], dt)
    prm[field][2] = value
    # a refused value in a phantom request (bs=3 leaves request 3 out) is never read
    prm["temperature"][3] = -5.0
    cand = np.zeros((pad_bs, n), np.int32)
    _, errors, values = run_kernels(lib, shards, cand, prm, dtype="float32", raw_params=True, bs=3)
    assert values == [(code << 24) | 2] * tp
    assert errors == [0] * tp


def test_combine_reports_a_rank_with_other_request_parameters(lib: Any) -> None:
    g = np.random.default_rng(24)
    tp, vs, n, pad_bs = 2, 100, 2, 4
    full = _logits(g, pad_bs * n, vs * tp, 2.0, False)
    shards = [np.ascontiguousarray(full[:, s * vs : (s + 1) * vs]) for s in range(tp)]
    prm = _params(g, pad_bs, "top_k_top_p")
    other = {k: None if a is None else a.copy() for k, a in prm.items()}
    other["seed"][3] += 1  # rank 1 disagrees on request 3, which rank 1 owns
    cand = np.zeros((pad_bs, n), np.int32)
    for raw in (False, True):
        _, errors, _ = run_kernels(
            lib, shards, cand, prm, dtype="float32", raw_params=raw, prms=[prm, other]
        )
        assert errors == [0, 1], raw  # owner 1 sees source 0's other seed


def test_combine_reports_a_rank_with_other_parameters(lib: Any) -> None:
    g = np.random.default_rng(20)
    tp, vs, n, pad_bs = 3, 64, 2, 3
    full = _logits(g, pad_bs * n, vs * tp, 2.0, False)
    shards = [np.ascontiguousarray(full[:, s * vs : (s + 1) * vs]) for s in range(tp)]
    prm = _params(g, pad_bs, "temperature")
    cand = np.zeros((pad_bs, n), np.int32)
    _, errors, _ = run_kernels(lib, shards, cand, prm, dtype="float32", digests=[7, 7, 9])
    # owners 0 and 1 see rank 2's digest 9 (source 2 -> 3); owner 2 sees source 0
    assert errors == [3, 3, 1]


def test_refusals_name_the_reason() -> None:
    prm = _params(np.random.default_rng(1), 4, "greedy")
    params = verify_params(pad_bs=4, num_tokens_per_req=2, vocab_size=400, **prm)
    assert kernel_path_refusal(params, 2) is None
    prm["temperature"] = np.ones(4, np.float32)
    prm["top_p"] = np.array([1, 1, 0.9, 1], np.float32)
    params = verify_params(pad_bs=4, num_tokens_per_req=2, vocab_size=400, **prm)
    assert "request 2 has top_p=0.9" in str(kernel_path_refusal(params, 2))
    # phantom requests do not count
    params = verify_params(pad_bs=4, num_tokens_per_req=2, vocab_size=400, bs=2, **prm)
    assert kernel_path_refusal(params, 2) is None
    prm["top_p"] = None
    prm["top_k"] = np.full(4, 128, np.int32)
    params = verify_params(pad_bs=4, num_tokens_per_req=2, vocab_size=4000, **prm)
    assert kernel_path_refusal(params, 8) is None
    assert "merge entries" in str(kernel_path_refusal(params, 16))


def test_verify_broadcast_only_for_small_batches_whose_records_fit() -> None:
    from ipc_dpsample.backends.onesided.contract import ArenaOffsets
    from ipc_dpsample.backends.verify_plan import BROADCAST_MAX_ROWS, verify_broadcast

    def arena_words(tp: int, max_pad_bs: int, n: int) -> int:
        lay = ArenaOffsets(
            tp=tp, max_pad_bs=max_pad_bs, num_tokens_per_req=n, vocab_size=250 * tp, itemsize=4
        )
        return lay.verify_region_bytes // 4

    assert BROADCAST_MAX_ROWS == 64
    for tp in (2, 3, 4, 8):
        for max_pad_bs in (tp, 4 * tp, 256 // tp * tp):
            for n in (1, 3, 4):
                words = arena_words(tp, max_pad_bs, n)
                for pad_bs in range(tp, max_pad_bs + 1, tp):
                    rows = pad_bs * n
                    for cap in (0, 50, 128):
                        kw = dict(rows=rows, tp=tp, cap=cap, region_words=words)
                        auto = verify_broadcast(**kw, mode="auto")
                        # the arena holds every broadcast batch auto picks, any top-k
                        assert auto == (rows <= BROADCAST_MAX_ROWS), (tp, max_pad_bs, n, pad_bs)
                        on = verify_broadcast(**kw, mode="on")
                        assert on == (tp * rows * record_words(cap) <= words)
                        assert not verify_broadcast(**kw, mode="off")
                        if on:  # the splits a broadcast call takes fit the region too
                            s = verify_splits(
                                rows=rows, tp=tp, vocab_shard=19008, cap=cap,
                                region_words=words // tp,
                            )  # fmt: skip
                            assert tp * s * rows * record_words(cap) <= words
    # one rank has no peer to broadcast to
    assert not verify_broadcast(rows=4, tp=1, cap=0, region_words=10**6, mode="on")
    with pytest.raises(ValueError, match="'auto', 'on' or 'off'"):
        verify_broadcast(rows=4, tp=2, cap=0, region_words=10**6, mode="yes")
    # ranks whose environments disagree never combine silently: the digest says
    assert call_digest(1000, 0, False, 4, 1, True) != call_digest(1000, 0, False, 4, 1, False)
    assert call_digest(1000, 0, False, 4, 2, True) != call_digest(1000, 0, False, 4, 2)

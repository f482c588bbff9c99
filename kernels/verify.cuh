// ipc_dpsample verify device code: sampled speculative verify without moving logits
// (verify_batch_vocab, issue 24). Shared by the one-sided kernels (onesided.cu: records
// pushed into the owners' arenas) and kernels/verify.cu (stand-alone kernels: the CPU
// emulation in tests/test_verify_kernels_cpu.py, and any backend that moves the records
// itself).
//
// The spec is ipc_dpsample.layout.reference_verify_batch_vocab; docs/verify_contract.md
// has the noise, the filters and why the shards compute it exactly. Every rank reduces
// each real row of its vocabulary shard to one RECORD (below); the row's owner combines
// the tp records of each of its rows into the token the full row samples, bit for bit,
// runs the accept chain ("sample, then match") and writes its requests' results, which
// the caller then all-gathers.
//
// Rows this code decides (dv_mode):
//   * GREEDY: temperature < 1e-6 or top_k == 1 -> torch.argmax of the row;
//   * TEMP: temperature only -> the best (score desc, id asc) of the shards' bests;
//   * TOPK: top_k in 2..128, with or without top-p and min-p -> each shard sends its
//     first k columns in key order; the merge holds the row's first k, on which the
//     owner recomputes z, the noise, the fixed-point masses and both thresholds;
//   * degenerate rows (a NaN, or z_max = float32(max / T) not finite) -> the greedy token.
// Top-p or min-p WITHOUT top-k (mode OTHER) needs the row's whole key order: the host
// never sends such a batch here (the one-sided backend moves its logits instead).
//
// Exactness: every decision uses IEEE basic operations without contraction (explicit
// __fadd_rn / __fdiv_rn / __dadd_rn / __dmul_rn / __ddiv_rn on the device; the CPU
// emulation builds with -ffp-contract=off) and the two polynomials of layout.det_log and
// layout.det_exp2_frac with the same coefficients.
//
// RECORD (u32 words, DV_HDR + 2 * kcap per row; kcap = the call's largest top-k, 0 when
// no row has top-k):
//   [0]  flags: bit 0 = a NaN in the shard's columns
//   [1]  the shard's first NaN (global id; DV_NO_ID: none)
//   [2]  the shard's first maximum (global id; DV_NO_ID: no column counts)
//   [3]  its raw logit (float32; -inf when no column counts)
//   [4,5] float64 sum(exp(x - max)) over the shard's columns (return_logprobs only)
//   [6]  TEMP rows: the shard's best-scoring column (global id; DV_NO_ID: none)
//   [7]  its score (float32)
//   [8]  its raw logit (float32)
//   [9]  TOPK rows: list length (min(k, columns of the shard))
//   [10] candidates[req, d] as this rank passed it (the owner compares)
//   [11] the call's parameter digest (host-computed; the owner compares)
//   [12 .. 12+kcap)        list raw logits, key order (value desc, id asc; -0 == +0)
//   [12+kcap .. 12+2kcap)  list global ids
//
// No toolkit headers (see argmax.cuh): NVRTC, nvcc and g++ (DP_ARGMAX_CPU_EMULATION)
// build it.
#pragma once

#include "argmax.cuh"

#ifndef DV_BLOCK
#define DV_BLOCK 256  // threads per CTA of the record and combine kernels (a power of 2)
#endif
// CTAs per SM the record kernels ask the register allocator for (__launch_bounds__): with
// the top-k selection (about 33 KB of shared memory: the vector keys' 12 KB and the
// temperature queue's 20 KB, whose bytes the selection's 18 KB share), and without (about
// 21 KB).
#ifndef DV_LIST_MIN_CTAS
#define DV_LIST_MIN_CTAS 3
#endif
#ifndef DV_NOLIST_MIN_CTAS
#define DV_NOLIST_MIN_CTAS 3
#endif
#define DV_TOPK_MAX 128
#define DV_HDR 12
#define DV_REC_MAX (DV_HDR + 2 * DV_TOPK_MAX)
#define DV_NO_ID 0x7FFFFFFFu
#define DV_MAX_TP 64  // largest tp the combine's shared arrays hold

#define DV_GREEDY 0
#define DV_TEMP 1
#define DV_TOPK 2
#define DV_OTHER 3

#define DV_W_FLAGS 0
#define DV_W_NAN_ID 1
#define DV_W_MAX_ID 2
#define DV_W_MAX_VAL 3
#define DV_W_SUMEXP 4
#define DV_W_BEST_ID 6
#define DV_W_BEST_SCORE 7
#define DV_W_BEST_VAL 8
#define DV_W_LIST_LEN 9
#define DV_W_CAND 10
#define DV_W_DIGEST 11

typedef unsigned long long dv_u64;
typedef long long dv_i64;

// One request's sampling parameters, normalised (dv_load_params): top_k 0 = off, else
// 1..128; top_p 1 = off; min_p 0 = off.
struct DvParams {
  float temperature;
  int top_k;
  float top_p;
  float min_p;
  dv_i64 seed;
  dv_i64 offset;
};

// Where the per-request parameters are: device arrays [pad_bs] as the caller passed
// them to verify_batch_vocab (float32 temperature, int32 top_k, float32 top_p and
// min_p, int64 seed and offset), read when the kernel runs (so a CUDA-graph replay
// sees the values written before it). 0 for top_k / top_p / min_p: off everywhere.
struct DvParamPtrs {
  dv_u64 temperature, top_k, top_p, min_p, seed, offset;
};

// Why a request's parameters are refused (the range rules of layout.verify_params, and
// top-p / min-p without top-k, which these kernels cannot decide).
#define DV_BAD_TEMPERATURE 1u
#define DV_BAD_TOP_K 2u
#define DV_BAD_TOP_P 3u
#define DV_BAD_MIN_P 4u
#define DV_BAD_NEEDS_TOP_K 5u

// -- phase clocks (profiling only: scripts/bench_verify_kernels.py --phases) ------------
// Built with -DDV_PHASE_CLOCKS, thread 0 of CTA 0 writes the SM's clock64 at each mark
// into dv_phase_clock[mark] (a mark inside a loop keeps its last pass): the record kernel's
// marks are DV_PH_REC + 0.., the combine's DV_PH_COMB + 0... Without it a mark is nothing.
#define DV_PHASES 32
#define DV_PH_REC 0
#define DV_PH_COMB 16
#if defined(DV_PHASE_CLOCKS) && !defined(DP_ARGMAX_CPU_EMULATION)
__device__ unsigned long long dv_phase_clock[DV_PHASES];
__device__ __forceinline__ void dv_phase(unsigned mark) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    unsigned long long c;
    asm volatile("mov.u64 %0, %%clock64;" : "=l"(c)::"memory");
    dv_phase_clock[mark] = c;
  }
}
#else
__device__ __forceinline__ void dv_phase(unsigned) {}
#endif

// -- IEEE operations without contraction ---------------------------------------
#ifdef DP_ARGMAX_CPU_EMULATION
__device__ __forceinline__ float dv_fadd(float a, float b) { return a + b; }
__device__ __forceinline__ float dv_fmul(float a, float b) { return a * b; }
__device__ __forceinline__ float dv_fdiv(float a, float b) { return a / b; }
__device__ __forceinline__ double dv_dadd(double a, double b) { return a + b; }
__device__ __forceinline__ double dv_dmul(double a, double b) { return a * b; }
__device__ __forceinline__ double dv_ddiv(double a, double b) { return a / b; }
__device__ __forceinline__ dv_u64 dv_d2u(double x) {
  dv_u64 u;
  __builtin_memcpy(&u, &x, 8);
  return u;
}
__device__ __forceinline__ double dv_u2d(dv_u64 u) {
  double x;
  __builtin_memcpy(&x, &u, 8);
  return x;
}
__device__ __forceinline__ dv_u64 dv_mulhi64(dv_u64 a, dv_u64 b) {
  return (dv_u64)(((unsigned __int128)a * b) >> 64);
}
__device__ __forceinline__ double dv_floor(double x) { return __builtin_floor(x); }
__device__ __forceinline__ double dv_exp(double x) { return __builtin_exp(x); }
__device__ __forceinline__ double dv_log(double x) { return __builtin_log(x); }
#else
__device__ __forceinline__ float dv_fadd(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float dv_fmul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float dv_fdiv(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double dv_dadd(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double dv_dmul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double dv_ddiv(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ dv_u64 dv_d2u(double x) { return (dv_u64)__double_as_longlong(x); }
__device__ __forceinline__ double dv_u2d(dv_u64 u) { return __longlong_as_double((long long)u); }
__device__ __forceinline__ dv_u64 dv_mulhi64(dv_u64 a, dv_u64 b) { return __umul64hi(a, b); }
__device__ __forceinline__ double dv_floor(double x) { return floor(x); }
__device__ __forceinline__ double dv_exp(double x) { return exp(x); }
__device__ __forceinline__ double dv_log(double x) { return log(x); }
#endif

__device__ __forceinline__ float dv_neg_inf() { return argmax_u2f(0xFF800000u); }
__device__ __forceinline__ float dv_nan() { return argmax_u2f(0x7FC00000u); }
// max(a, b), NaN when either is NaN (PTX max.NaN, one instruction from sm_80 on).
__device__ __forceinline__ float dv_fmax_nan(float a, float b) {
#if !defined(DP_ARGMAX_CPU_EMULATION) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (a != a || b != b) ? dv_nan() : argmax_fmax(a, b);
#endif
}

// -- the noise: layout.noise_stream_key, philox4x32_10, uniform_from_uint32 -----
// Philox4x32-10, word 0, counter (c0, c1, 0, 0), key (k0, k1).
__device__ __forceinline__ unsigned dv_philox32_w0(unsigned c0, unsigned k0, unsigned k1,
                                                   unsigned c1 = 0u) {
  unsigned c2 = 0, c3 = 0;
  for (int i = 0; i < 10; ++i) {
    const dv_u64 p0 = (dv_u64)0xD2511F53u * c0;
    const dv_u64 p1 = (dv_u64)0xCD9E8D57u * c2;
    c0 = (unsigned)(p1 >> 32) ^ c1 ^ k0;
    c1 = (unsigned)p1;
    c2 = (unsigned)(p0 >> 32) ^ c3 ^ k1;
    c3 = (unsigned)p0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c0;
}

// The row's stream key (layout.noise_stream_key, Triton's tl.randint(seed, offset + d)):
// philox4x32_10((off & 0xffffffff, off >> 32, 0, 0), (seed & 0xffffffff, seed >> 32))[0],
// a 32-bit value; the uniforms' key is (key, 0).
__device__ __forceinline__ dv_u64 dv_stream_key(const DvParams& p, unsigned d) {
  const dv_u64 off = (dv_u64)p.offset + (dv_u64)d, seed = (dv_u64)p.seed;
  return dv_philox32_w0((unsigned)off, (unsigned)seed, (unsigned)(seed >> 32),
                        (unsigned)(off >> 32));
}

// layout.det_log: the natural log of a positive normal double by fixed operations.
__device__ __forceinline__ double dv_det_log(double x) {
  const dv_u64 bits = dv_d2u(x);
  int e = (int)((bits >> 52) & 0x7FFu) - 1022;  // frexp: x = m * 2**e, m in [0.5, 1)
  double m = dv_u2d((bits & 0x800FFFFFFFFFFFFFull) | 0x3FE0000000000000ull);
  if (m < 0.70710678118654757) {
    m = dv_dmul(m, 2.0);
    e -= 1;
  }
  const double s = dv_ddiv(dv_dadd(m, -1.0), dv_dadd(m, 1.0));
  const double s2 = dv_dmul(s, s);
  double p = 0.086956521739130432;
  p = dv_dadd(dv_dmul(p, s2), 0.095238095238095233);
  p = dv_dadd(dv_dmul(p, s2), 0.10526315789473684);
  p = dv_dadd(dv_dmul(p, s2), 0.11764705882352941);
  p = dv_dadd(dv_dmul(p, s2), 0.13333333333333333);
  p = dv_dadd(dv_dmul(p, s2), 0.15384615384615385);
  p = dv_dadd(dv_dmul(p, s2), 0.18181818181818182);
  p = dv_dadd(dv_dmul(p, s2), 0.22222222222222221);
  p = dv_dadd(dv_dmul(p, s2), 0.2857142857142857);
  p = dv_dadd(dv_dmul(p, s2), 0.40000000000000002);
  p = dv_dadd(dv_dmul(p, s2), 0.66666666666666663);
  p = dv_dadd(dv_dmul(p, s2), 2.0);
  return dv_dadd(dv_dmul((double)e, 0.69314718055994529), dv_dmul(s, p));
}

// layout.det_exp2_frac: 2**f for f in [0, 1).
__device__ __forceinline__ double dv_det_exp2_frac(double f) {
  const double t = dv_dmul(f, 0.69314718055994529);
  double p = 2.8114572543455206e-15;
  p = dv_dadd(dv_dmul(p, t), 4.7794773323873853e-14);
  p = dv_dadd(dv_dmul(p, t), 7.6471637318198164e-13);
  p = dv_dadd(dv_dmul(p, t), 1.1470745597729725e-11);
  p = dv_dadd(dv_dmul(p, t), 1.6059043836821613e-10);
  p = dv_dadd(dv_dmul(p, t), 2.08767569878681e-09);
  p = dv_dadd(dv_dmul(p, t), 2.505210838544172e-08);
  p = dv_dadd(dv_dmul(p, t), 2.7557319223985888e-07);
  p = dv_dadd(dv_dmul(p, t), 2.7557319223985893e-06);
  p = dv_dadd(dv_dmul(p, t), 2.4801587301587302e-05);
  p = dv_dadd(dv_dmul(p, t), 0.00019841269841269841);
  p = dv_dadd(dv_dmul(p, t), 0.0013888888888888889);
  p = dv_dadd(dv_dmul(p, t), 0.0083333333333333332);
  p = dv_dadd(dv_dmul(p, t), 0.041666666666666664);
  p = dv_dadd(dv_dmul(p, t), 0.16666666666666666);
  p = dv_dadd(dv_dmul(p, t), 0.5);
  p = dv_dadd(dv_dmul(p, t), 1.0);
  p = dv_dadd(dv_dmul(p, t), 1.0);
  return p;
}

// layout.uniform_from_uint32 of a Philox word.
__device__ __forceinline__ float dv_uniform(unsigned x) {
  int i = (int)x;
  if (i < 0) i = ~i;
  const float u = dv_fmul((float)i, 4.6566127342e-10f);
  return u < 1e-7f ? 1e-7f : u;
}

// float32(-det_log(-det_log(u))): the Gumbel noise of a uniform. Not inlined on the
// device: the record kernels call it for the few columns that may win, and its float64
// polynomials would otherwise hold registers across their streaming loops.
#ifdef DP_ARGMAX_CPU_EMULATION
#define DV_NOINLINE
#else
#define DV_NOINLINE __noinline__
#endif
__device__ DV_NOINLINE float dv_gumbel(float u) {
  const double a = dv_det_log((double)u);  // < 0
  return (float)(-dv_det_log(-a));
}

// layout.gumbel_noise of one global token id under a row's stream key.
__device__ __forceinline__ float dv_noise(dv_u64 key, unsigned id) {
  return dv_gumbel(
      dv_uniform(dv_philox32_w0(id, (unsigned)(key & 0xFFFFFFFFull), (unsigned)(key >> 32))));
}

// Every noise value is below this (layout: the largest uniform is 1 - 2**-24, whose
// noise is 16.6355...; the margin is far above det_log's few-ulp error), so a column
// with float32(z + DV_G_BOUND) below the best score found cannot win.
#define DV_G_BOUND 16.6375f

// layout.mass_terms of one finite float32 z: exp(z) ~ a * 2**(8*grp - 24).
__device__ __forceinline__ void dv_mass_term(float z, double* grp, dv_i64* a) {
  const double t = dv_dmul((double)z, 1.4426950408889634);
  const double k = dv_floor(t);
  const double q = dv_floor(dv_dmul(dv_det_exp2_frac(dv_dadd(t, -k)), 16777216.0));
  const double g = dv_floor(dv_dmul(k, 0.125));  // k / 8, exact
  const int r = (int)dv_dadd(k, -dv_dmul(8.0, g));  // 0..7
  *grp = g;
  *a = (dv_i64)q << r;
}

// ceil(p * w) exactly for float32 p in (0, 1) and 0 <= w < 2**53 (layout.top_p_threshold).
__device__ __forceinline__ dv_i64 dv_top_p_threshold(float p, dv_i64 w) {
  const unsigned bits = argmax_f2u(p);
  const unsigned ef = (bits >> 23) & 0xFFu;
  const dv_u64 mant = ef ? ((bits & 0x7FFFFFu) | 0x800000u) : (bits & 0x7FFFFFu);
  const int shift = ef ? 150 - (int)ef : 149;  // p = mant * 2**-shift, shift >= 24
  const dv_u64 lo = mant * (dv_u64)w, hi = dv_mulhi64(mant, (dv_u64)w);
  if (lo == 0 && hi == 0) return 0;
  if (shift >= 128) return 1;
  // (hi:lo + 2**shift - 1) >> shift
  dv_u64 add_lo, add_hi;
  if (shift >= 64) {
    add_lo = ~0ull;
    add_hi = (shift == 64) ? 0ull : ((1ull << (shift - 64)) - 1ull);
  } else {
    add_lo = (1ull << shift) - 1ull;
    add_hi = 0;
  }
  const dv_u64 s_lo = lo + add_lo;
  const dv_u64 s_hi = hi + add_hi + (s_lo < lo ? 1ull : 0ull);
  if (shift >= 64) return (dv_i64)(shift == 64 ? s_hi : (s_hi >> (shift - 64)));
  return (dv_i64)((s_lo >> shift) | (s_hi << (64 - shift)));
}

// layout.min_p_log: float32(det_log(min_p)).
__device__ __forceinline__ float dv_min_p_log(float min_p) {
  return (float)dv_det_log((double)min_p);
}

__device__ __forceinline__ int dv_mode(const DvParams& p) {
  if (p.temperature < 1e-6f || p.top_k == 1) return DV_GREEDY;
  if (p.top_k >= 2) return DV_TOPK;
  if (p.top_p < 1.0f || p.min_p > 0.0f) return DV_OTHER;
  return DV_TEMP;
}

__device__ __forceinline__ unsigned dv_mix(unsigned h, unsigned w) {
  h ^= w;
  h *= 0x01000193u;
  return h ^ (h >> 15);
}

// Request `req`'s parameters, normalised as layout.verify_params does. *bad: 0, or the
// DV_BAD_* code of the first rule broken (*bad_bits: the offending value's bits).
// *digest: in, the call's digest (host); out, mixed with the request's raw values, so
// the owner of a row can tell that a peer passed other values for that request.
__device__ __forceinline__ DvParams dv_load_params(const DvParamPtrs& q, unsigned req,
                                                   unsigned vocab_limit, unsigned* bad,
                                                   unsigned* bad_bits, unsigned* digest) {
  DvParams p;
  p.temperature = ((const float*)q.temperature)[req];
  const int k = q.top_k ? ((const int*)q.top_k)[req] : 0;
  p.top_p = q.top_p ? ((const float*)q.top_p)[req] : 1.0f;
  p.min_p = q.min_p ? ((const float*)q.min_p)[req] : 0.0f;
  p.seed = ((const dv_i64*)q.seed)[req];
  p.offset = ((const dv_i64*)q.offset)[req];
  unsigned h = *digest;
  h = dv_mix(h, argmax_f2u(p.temperature));
  h = dv_mix(h, (unsigned)k);
  h = dv_mix(h, argmax_f2u(p.top_p));
  h = dv_mix(h, argmax_f2u(p.min_p));
  h = dv_mix(h, (unsigned)((dv_u64)p.seed & 0xFFFFFFFFull));
  h = dv_mix(h, (unsigned)((dv_u64)p.seed >> 32));
  h = dv_mix(h, (unsigned)((dv_u64)p.offset & 0xFFFFFFFFull));
  h = dv_mix(h, (unsigned)((dv_u64)p.offset >> 32));
  *digest = h;
  const bool off = k == 0 || k >= (int)vocab_limit;
  p.top_k = off ? 0 : k;
  *bad = 0;
  *bad_bits = 0;
  if (!(argmax_isfinite(p.temperature) && p.temperature >= 0.0f)) {
    *bad = DV_BAD_TEMPERATURE;
    *bad_bits = argmax_f2u(p.temperature);
  } else if (!off && !(k >= 1 && k <= DV_TOPK_MAX)) {
    *bad = DV_BAD_TOP_K;
    *bad_bits = (unsigned)k;
  } else if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) {
    *bad = DV_BAD_TOP_P;
    *bad_bits = argmax_f2u(p.top_p);
  } else if (!(p.min_p >= 0.0f && p.min_p < 1.0f)) {
    *bad = DV_BAD_MIN_P;
    *bad_bits = argmax_f2u(p.min_p);
  }
  if (*bad) {  // decide the row as greedy: an error is reported, no value is trusted
    p.temperature = 0.0f;
    p.top_k = 0;
    p.top_p = 1.0f;
    p.min_p = 0.0f;
  } else if (p.temperature >= 1e-6f && p.top_k != 1 && p.top_k < 2 &&
             (p.top_p < 1.0f || p.min_p > 0.0f)) {
    *bad = DV_BAD_NEEDS_TOP_K;
    *bad_bits = argmax_f2u(p.top_p < 1.0f ? p.top_p : p.min_p);
    p.top_p = 1.0f;
    p.min_p = 0.0f;
  }
  return p;
}

// Key order as one unsigned: larger = earlier (value descending); -0 == +0; NaN last.
__device__ __forceinline__ unsigned dv_order_key(float x) {
  unsigned u = argmax_f2u(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0u;
  if (u == 0x80000000u) u = 0u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ bool dv_better(float av, unsigned aid, float bv, unsigned bid) {
  return av > bv || (av == bv && aid < bid);
}

// -- block helpers (blockDim.x a power of 2, <= DV_BLOCK) --------------------------
// Warp shuffles within each warp, then one shared slot per warp: two barriers per call.
// Every thread of the block calls them (the warp intrinsics name the whole warp).
#define DV_WARPS (DV_BLOCK / 32)
#define DV_FULL 0xFFFFFFFFu
struct DvShared {
  float f[DV_WARPS];
  float f2[DV_WARPS];
  unsigned u[DV_WARPS];
  unsigned u2[DV_WARPS];
  double d[DV_WARPS];
};

// Threads of this thread's warp (32, or fewer when the block is smaller).
__device__ __forceinline__ unsigned dv_warp_width() {
  const unsigned base = threadIdx.x & ~31u;
  return blockDim.x - base < 32u ? blockDim.x - base : 32u;
}

__device__ __forceinline__ unsigned dv_nwarps() { return (blockDim.x + 31u) / 32u; }

// (value desc, id asc) best over the warp, on every lane; carries a second float.
__device__ __forceinline__ void dv_warp_best(float& v, unsigned& id, float& extra) {
  for (unsigned o = dv_warp_width() / 2; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(DV_FULL, v, (int)o);
    const unsigned oi = __shfl_xor_sync(DV_FULL, id, (int)o);
    const float oe = __shfl_xor_sync(DV_FULL, extra, (int)o);
    if (dv_better(ov, oi, v, id)) {
      v = ov;
      id = oi;
      extra = oe;
    }
  }
}

// (value desc, id asc) best over the block; carries a second float.
__device__ __forceinline__ void dv_block_best(DvShared& sh, float& v, unsigned& id, float& extra) {
  const unsigned t = threadIdx.x;
  dv_warp_best(v, id, extra);
  if ((t & 31u) == 0) {
    sh.f[t >> 5] = v;
    sh.u[t >> 5] = id;
    sh.f2[t >> 5] = extra;
  }
  __syncthreads();
  for (unsigned w = 0; w < dv_nwarps(); ++w) {
    if (dv_better(sh.f[w], sh.u[w], v, id)) {
      v = sh.f[w];
      id = sh.u[w];
      extra = sh.f2[w];
    }
  }
  __syncthreads();
}

__device__ __forceinline__ unsigned dv_block_min(DvShared& sh, unsigned x) {
  const unsigned t = threadIdx.x;
  for (unsigned o = dv_warp_width() / 2; o > 0; o >>= 1) {
    const unsigned y = __shfl_xor_sync(DV_FULL, x, (int)o);
    x = y < x ? y : x;
  }
  if ((t & 31u) == 0) sh.u2[t >> 5] = x;
  __syncthreads();
  for (unsigned w = 0; w < dv_nwarps(); ++w) x = sh.u2[w] < x ? sh.u2[w] : x;
  __syncthreads();
  return x;
}

// The block's sum, in one fixed order (the same on every thread).
__device__ __forceinline__ double dv_block_sum(DvShared& sh, double x) {
  const unsigned t = threadIdx.x;
  for (unsigned o = dv_warp_width() / 2; o > 0; o >>= 1)
    x = dv_dadd(x, __shfl_xor_sync(DV_FULL, x, (int)o));
  if ((t & 31u) == 0) sh.d[t >> 5] = x;
  __syncthreads();
  double r = sh.d[0];
  for (unsigned w = 1; w < dv_nwarps(); ++w) r = dv_dadd(r, sh.d[w]);
  __syncthreads();
  return r;
}

// Inclusive prefix sum of one unsigned per thread; returns this thread's inclusive
// sum, *total the block's.
__device__ __forceinline__ unsigned dv_block_scan(DvShared& sh, unsigned x, unsigned* total) {
  const unsigned t = threadIdx.x, lane = t & 31u;
  for (unsigned o = 1; o < dv_warp_width(); o <<= 1) {
    const unsigned y = __shfl_sync(DV_FULL, x, (int)(lane >= o ? lane - o : lane));
    if (lane >= o) x += y;
  }
  if (lane == dv_warp_width() - 1) sh.u2[t >> 5] = x;
  __syncthreads();
  unsigned before = 0, all = 0;
  for (unsigned w = 0; w < dv_nwarps(); ++w) {
    before += w < (t >> 5) ? sh.u2[w] : 0u;
    all += sh.u2[w];
  }
  *total = all;
  __syncthreads();
  return before + x;
}

// -- the record of one row of one shard -------------------------------------------
#ifndef DV_CAND_CAP
// Candidates of the top-k selection held in shared memory (8 KB); a row with more (many
// equal values) is selected by radix passes over the row instead. 1024 keeps the top-k
// kernel within the queue's bytes, at about 33 KB a CTA: six of its 128-thread CTAs fit
// on an H100 SM, where 2048 (38 KB) fit five and measured 5 % slower (BENCHMARKS.md).
#define DV_CAND_CAP 1024
#endif

// DV_TEMP_ONEPASS: which temperature rows the record kernel without top-k lists (batches
// without top-k rows) reads once (dv_row_max_temp), their maximum and their sampled column
// from the same read, the bound on the columns worth scoring rising as the block scores
// them; the others read the row for its maximum, then again (dv_row_temp). 1 (default):
// float32 rows, whose second read an H100 found mostly coming from DRAM again; 2: every
// dtype; 0: none. The top-k kernel never
// does (its code, and so its top-k rows' speed, is that of 0: the one-read code made it
// spill more). With one read, more columns need their noise
// (the bound is looser while little of the row has been scored: about 24 % of the
// bench's columns instead of 15 %, by a NumPy model, benchmarks/h100-2026-12-07g). On an
// H100 (gated tp=8, pad_bs=256, BENCHMARKS.md) float32 rows took 11 % less time with one
// read, bfloat16 rows (whose second read L2 serves) 14 % more.
#ifndef DV_TEMP_ONEPASS
#define DV_TEMP_ONEPASS 1
#endif
#ifndef DV_ONEPASS_UNROLL
#define DV_ONEPASS_UNROLL 2  // 16-byte loads a thread issues a round ahead in that pass
#endif

// What every row needs: the reductions and the temperature path's bound.
struct DvRowShared {
  DvShared red;
  float bound;
#if DV_TEMP_ONEPASS > 0
  unsigned best_key;  // dv_row_max_temp: the best score reached so far (dv_ord; 0: none)
#endif
};

// Each warp's queue of the columns that pass the temperature path's bound
// (dv_row_temp): room for a warp's leftover (< 64) plus one 16-byte vector per lane.
#define DV_QCAP (32 * 10)
struct DvQueue {
  alignas(16) float x[DV_WARPS][DV_QCAP];
  unsigned id[DV_WARPS][DV_QCAP];
};

// The top-k selection's histogram, candidates and list.
struct DvTopKShared {
  unsigned hist[2048];
  // the candidates as (order key << 32) | ~global id: a larger value comes first in key
  // order (value desc, id asc); the raw logit is dv_key_value of the key
  alignas(16) dv_u64 cand[DV_CAND_CAP];
  unsigned sel_key[DV_TOPK_MAX];
  unsigned sel_id[DV_TOPK_MAX];
  float sel_val[DV_TOPK_MAX];
  unsigned found_bin, found_above, n_gt, n_eq, n_cand;
  unsigned wcount[DV_WARPS];  // each warp's list length (dv_row_topk_gather)
};

// A record kernel's shared memory without top-k lists (kcap == 0) ...
struct DvRowQueueShared {
  DvRowShared row;
  DvQueue q;
};

// ... and with them: a row takes either the temperature path or the top-k selection,
// so the queue and the selection share their bytes (static shared memory <= 48 KB).
#ifndef DV_VKEY_CAP
#define DV_VKEY_CAP 6144  // vectors of a top-k row whose keys the first pass keeps (12 KB)
#endif
#ifndef DV_VLIST
#define DV_VLIST (2048 / DV_WARPS)  // a warp's list of vectors to read again (histogram words)
#endif
#if DV_VLIST * DV_WARPS > 2048
#error "DV_VLIST * DV_WARPS must fit the top-k histogram (2048 words)"
#endif
#if DV_VKEY_CAP % 8 != 0
#error "DV_VKEY_CAP must be a multiple of 8 (the second pass reads the keys 8 at a time)"
#endif
struct DvRecordShared {
  DvRowShared row;
  // a top-k row's vector keys (dv_vector_key), for its first DV_VKEY_CAP vectors
  alignas(16) unsigned short vkey[DV_VKEY_CAP > 0 ? DV_VKEY_CAP : 4];
  union {
    DvQueue q;
    DvTopKShared k;
  };
};

// Columns of a shard's row as (order key, global id, raw logit; -0 read as +0), in
// column order.
template <typename Tag>
struct DvRowSource {
  const typename Tag::Storage* row;
  unsigned n, col0;
  static constexpr bool kColumnOrder = true;
  __device__ __forceinline__ unsigned size() const { return n; }
  __device__ __forceinline__ void get(unsigned i, unsigned& key, unsigned& id, float& val) const {
    const float x = argmax_load1<Tag>(row + i);
    key = dv_order_key(x);
    id = col0 + i;
    val = x == 0.0f ? 0.0f : x;
  }
};

// The raw logit of an order key, -0 read as +0 (dv_order_key's inverse; a NaN's key
// gives a NaN).
__device__ __forceinline__ float dv_key_value(unsigned key) {
  return argmax_u2f((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

// A 16-byte vector's key for the top-k pass, as the first pass keeps it: the upper 16
// bits of its maximum's float bits (one shift a vector) ...
__device__ __forceinline__ unsigned short dv_vector_key(float vmax) {
  return (unsigned short)(argmax_f2u(vmax) >> 16);
}
// ... and as the second pass reads it: the upper 16 bits of the maximum's order key
// (dv_order_key >> 16: sign flipped for a positive value, every bit for a negative one,
// -0 as +0). Every column x of the vector (no NaN) has dv_order_key(x) >> 16 <= this, so
// a column at or above a threshold key thr lies only in a vector whose key is at or
// above thr >> 16.
__device__ __forceinline__ unsigned dv_vector_order_key(unsigned h) {
  return (h & 0x8000u) ? (h == 0x8000u ? 0x8000u : (~h & 0xFFFFu)) : (h | 0x8000u);
}
// The kept keys h with dv_vector_order_key(h) >= thr >> 16 are one range of raw keys,
// lo <= h <= lo + span (one unsigned test: h - lo <= span): a non-negative threshold keeps
// the positive keys from its own up (and -0's when it is 0), a negative one every key up
// to the negative key of its magnitude.
__device__ __forceinline__ void dv_vector_key_range(unsigned thr, unsigned* lo,
                                                    unsigned* span) {
  const unsigned t16 = thr >> 16;
  const unsigned l = t16 >= 0x8000u ? (t16 == 0x8000u ? 0u : t16 & 0x7FFFu) : 0u;
  const unsigned h = t16 >= 0x8000u ? (t16 == 0x8000u ? 0x8000u : 0x7FFFu) : 0xFFFFu - t16;
  *lo = l;
  *span = h - l;
}

// The candidates gathered in shared memory (any order).
struct DvCandSource {
  const DvRecordShared* sh;
  unsigned n;
  static constexpr bool kColumnOrder = false;
  __device__ __forceinline__ unsigned size() const { return n; }
  __device__ __forceinline__ void get(unsigned i, unsigned& key, unsigned& id, float& val) const {
    const dv_u64 c = sh->k.cand[i];
    key = (unsigned)(c >> 32);
    id = ~(unsigned)c;
    val = dv_key_value(key);
  }
};

// Add one to hist[bin] for every thread with `active` (warp-aggregated on the device:
// one shared atomic per distinct bin of a warp, so concentrated digits do not serialise).
__device__ __forceinline__ void dv_hist_add(unsigned* hist, unsigned bin, bool active) {
#ifdef DP_ARGMAX_CPU_EMULATION
  if (active) atomicAdd(&hist[bin], 1u);
#else
  const unsigned live = __ballot_sync(0xFFFFFFFFu, active);
  if (!active) return;
  const unsigned peers = __match_any_sync(live, bin);
  const unsigned lane = threadIdx.x & 31u;
  if ((__ffs(peers) - 1) == (int)lane) atomicAdd(&hist[bin], (unsigned)__popc(peers));
#endif
}

// One radix digit: the bin (from the top) holding the remaining-th largest key among
// the counted ones; sets sh.k.found_bin / sh.k.found_above. hist holds nb counts.
__device__ __forceinline__ void dv_find_bin(DvRecordShared& sh, unsigned nb, unsigned remaining) {
  const unsigned t = threadIdx.x, B = blockDim.x;
  const unsigned per = nb / B ? nb / B : 1u;
  const unsigned lo = t * per, hi = lo + per;  // this thread's bins [lo, hi)
  unsigned cs = 0;
  for (unsigned i = lo; i < hi && i < nb; ++i) cs += sh.k.hist[i];
  unsigned total;
  const unsigned incl = dv_block_scan(sh.row.red, cs, &total);
  const unsigned above = total - incl;  // bins >= hi
  if (lo < nb && above < remaining && above + cs >= remaining) {
    unsigned acc = above;
    for (unsigned i = (hi < nb ? hi : nb); i-- > lo;) {
      if (acc + sh.k.hist[i] >= remaining) {
        sh.k.found_bin = i;
        sh.k.found_above = acc;
        break;
      }
      acc += sh.k.hist[i];
    }
  }
  __syncthreads();
}

// Radix passes first_pass..2 over `src` (the digits above first_pass already fixed in
// prefix/mask, `remaining` of the kk still to find among keys matching them), then the
// kk columns into rec's list in key order (kk >= 1).
template <typename Src>
__device__ void dv_select(const Src& src, unsigned kk, int first_pass, unsigned prefix,
                          unsigned mask, unsigned remaining, unsigned eq_count, unsigned kcap,
                          unsigned* rec, DvRecordShared& sh) {
  const unsigned t = threadIdx.x, B = blockDim.x, n = src.size();
  for (int pass = first_pass; pass < 3; ++pass) {
    const unsigned shift = pass == 0 ? 21u : (pass == 1 ? 10u : 0u);
    const unsigned nb = pass == 2 ? 1024u : 2048u;
    for (unsigned i = t; i < nb; i += B) sh.k.hist[i] = 0;
    __syncthreads();
    for (unsigned c0 = 0; c0 < n; c0 += B) {  // uniform trip count (warp-aggregated adds)
      const unsigned c = c0 + t;
      unsigned key = 0, id;
      float val;
      if (c < n) src.get(c, key, id, val);
      dv_hist_add(sh.k.hist, (key >> shift) & (nb - 1), c < n && (key & mask) == prefix);
    }
    __syncthreads();
    dv_find_bin(sh, nb, remaining);
    const unsigned bin = sh.k.found_bin;
    remaining -= sh.k.found_above;
    eq_count = sh.k.hist[bin];
    prefix |= bin << shift;
    mask |= (nb - 1) << shift;
    __syncthreads();
  }
  // prefix is the key of the kk-th column; take every larger key and the `remaining`
  // lowest ids among the equal ones
  const unsigned thr = prefix, gt = kk - remaining;
  if (t == 0) {
    sh.k.n_gt = 0;
    sh.k.n_eq = 0;
  }
  __syncthreads();
  const bool all_eq = eq_count == remaining;
  for (unsigned c = t; c < n; c += B) {
    unsigned key, id;
    float val;
    src.get(c, key, id, val);
    unsigned slot = DV_TOPK_MAX;
    if (key > thr) {
      slot = atomicAdd(&sh.k.n_gt, 1u);
    } else if (key == thr && all_eq) {
      slot = gt + atomicAdd(&sh.k.n_eq, 1u);
    } else if (key == thr && !Src::kColumnOrder) {
      // ties at the k-th value, candidates in any order: rank by id among the equal
      unsigned r = 0;
      for (unsigned j = 0; j < n; ++j) {
        unsigned kj, ij;
        float vj;
        src.get(j, kj, ij, vj);
        r += (kj == thr && ij < id) ? 1u : 0u;
      }
      if (r < remaining) slot = gt + r;
    }
    if (slot < DV_TOPK_MAX) {
      sh.k.sel_key[slot] = key;
      sh.k.sel_id[slot] = id;
      sh.k.sel_val[slot] = val;
    }
  }
  __syncthreads();
  if (!all_eq && Src::kColumnOrder) {  // ties at the k-th value: lowest ids, column order
    unsigned base = 0;
    for (unsigned c0 = 0; c0 < n && base < remaining; c0 += B) {
      const unsigned c = c0 + t;
      unsigned key = 0, id = 0, pred = 0;
      float val = 0.0f;
      if (c < n) {
        src.get(c, key, id, val);
        pred = key == thr ? 1u : 0u;
      }
      unsigned total;
      const unsigned pos = dv_block_scan(sh.row.red, pred, &total) - pred;
      if (pred && base + pos < remaining) {
        const unsigned slot = gt + base + pos;
        sh.k.sel_key[slot] = thr;
        sh.k.sel_id[slot] = id;
        sh.k.sel_val[slot] = val;
      }
      base += total;
    }
  }
  __syncthreads();
  // sort the kk entries into key order by counting
  for (unsigned i = t; i < kk; i += B) {
    const unsigned k = sh.k.sel_key[i], id = sh.k.sel_id[i];
    unsigned r = 0;
    for (unsigned j = 0; j < kk; ++j)
      r += (sh.k.sel_key[j] > k || (sh.k.sel_key[j] == k && sh.k.sel_id[j] < id)) ? 1u : 0u;
    rec[DV_HDR + r] = argmax_f2u(sh.k.sel_val[i]);
    rec[DV_HDR + kcap + r] = id;
  }
  __syncthreads();
}

// f(x, c) for every column c < ncols of `row` (x its value as float), each thread
// visiting its columns in increasing order: a scalar head up to the first 16-byte
// boundary, then 16-byte vectors (two in flight per thread), then a scalar tail.
template <typename Tag, typename F>
__device__ __forceinline__ void dv_row_each(const typename Tag::Storage* row, unsigned ncols,
                                            F&& f) {
  typedef typename Tag::Storage S;
  constexpr unsigned E = ArgmaxUnpack<Tag>::kPerVec;
  const unsigned t = threadIdx.x, B = blockDim.x;
  const unsigned mis = (unsigned)(((dv_u64)row & 15ull) / sizeof(S));
  unsigned head = mis ? E - mis : 0u;
  if (head > ncols) head = ncols;
  for (unsigned c = t; c < head; c += B) f(argmax_load1<Tag>(row + c), c);
  const unsigned nvec = (ncols - head) / E;
  const ArgmaxVec16* vp = (const ArgmaxVec16*)(row + head);
  for (unsigned v = t; v < nvec; v += 2 * B) {
    const bool second = v + B < nvec;
    const ArgmaxVec16 a = argmax_load16(vp + v);
    ArgmaxVec16 b = a;
    if (second) b = argmax_load16(vp + (v + B));
    float xs[E];
    ArgmaxUnpack<Tag>::run(a, xs);
#pragma unroll
    for (unsigned j = 0; j < E; ++j) f(xs[j], head + v * E + j);
    if (second) {
      ArgmaxUnpack<Tag>::run(b, xs);
#pragma unroll
      for (unsigned j = 0; j < E; ++j) f(xs[j], head + (v + B) * E + j);
    }
  }
  const unsigned tail = head + nvec * E;
  for (unsigned c = tail + t; c < ncols; c += B) f(argmax_load1<Tag>(row + c), c);
}

// A 16-byte vector's maximum as float32, NaN when one of its columns is NaN (its sign
// of zero unspecified: every use compares it, -0 == +0). bfloat16 and float16 from sm_80
// on: max.NaN of the packed pairs (exact, 3 instructions for 8 columns), then of the two
// halves left; otherwise (and in the CPU emulation) max.NaN over the unpacked columns.
template <typename Tag>
__device__ __forceinline__ float dv_vector_max_nan(const ArgmaxVec16& r) {
  constexpr unsigned E = ArgmaxUnpack<Tag>::kPerVec;
#if !defined(DP_ARGMAX_CPU_EMULATION) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (E == 8) {
    unsigned a, b, c;
    if constexpr (Tag::kCode == ArgmaxBf16::kCode) {
      asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(a) : "r"(r.w[0]), "r"(r.w[1]));
      asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(b) : "r"(r.w[2]), "r"(r.w[3]));
      asm("max.NaN.bf16x2 %0, %1, %2;" : "=r"(c) : "r"(a), "r"(b));
      return dv_fmax_nan(argmax_u2f(c << 16), argmax_u2f(c & 0xFFFF0000u));
    } else {
      asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(a) : "r"(r.w[0]), "r"(r.w[1]));
      asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(b) : "r"(r.w[2]), "r"(r.w[3]));
      asm("max.NaN.f16x2 %0, %1, %2;" : "=r"(c) : "r"(a), "r"(b));
      return dv_fmax_nan(Tag::to_float(static_cast<unsigned short>(c & 0xFFFFu)),
                         Tag::to_float(static_cast<unsigned short>(c >> 16)));
    }
  }
#endif
  float xs[E];
  ArgmaxUnpack<Tag>::run(r, xs);
  float vm = xs[0];
#pragma unroll
  for (unsigned j = 1; j < E; ++j) vm = dv_fmax_nan(vm, xs[j]);
  return vm;
}

#ifndef DV_MAX_UNROLL
#define DV_MAX_UNROLL 2  // 16-byte loads in flight per thread in the row's first pass
#endif
#ifndef DV_LIST_UNROLL
#define DV_LIST_UNROLL 4  // ... in the top-k record kernel's (its first pass waits on memory)
#endif

// This thread's first maximum over its columns of `row` (m; mc its column, DV_NO_ID when
// none is above -inf) and whether one of its columns is NaN (then m and mc are not
// meaningful: the caller reads the row again with every special value handled). Each
// thread visits its columns in increasing order (a scalar head, 16-byte vectors in
// rounds of U loads, a scalar tail) and compares each vector's maximum with
// m once: the first column of the vector that holds it when it is larger. keep: blockDim.x
// 16-byte slots of shared memory, free on entry (this thread's slot is keep[t]).
//
// With kKeys, vector i (of the 16-byte vectors after the head) for i < min(nvec, nkeys)
// also leaves the upper 16 bits of its maximum in vkey[i] (dv_vector_key): the top-k pass
// then reads again only the vectors that can hold a candidate (dv_row_topk_gather).
template <typename Tag, bool kKeys = false, unsigned U = DV_MAX_UNROLL>
__device__ __forceinline__ bool dv_row_max(const typename Tag::Storage* row, unsigned ncols,
                                           float& m, unsigned& mc, ArgmaxVec16* keep,
                                           unsigned short* vkey = nullptr,
                                           unsigned nkeys = 0u) {
  typedef typename Tag::Storage S;
  constexpr unsigned E = ArgmaxUnpack<Tag>::kPerVec;
  const unsigned t = threadIdx.x, B = blockDim.x;
  m = dv_neg_inf();
  mc = DV_NO_ID;
  bool nan = false;
  const unsigned mis = (unsigned)(((dv_u64)row & 15ull) / sizeof(S));
  unsigned head = mis ? E - mis : 0u;
  if (head > ncols) head = ncols;
  for (unsigned c = t; c < head; c += B) {
    const float x = argmax_load1<Tag>(row + c);
    nan |= x != x;
    if (x > m) {
      m = x;
      mc = c;
    }
  }
  const unsigned nvec = (ncols - head) / E;
  const ArgmaxVec16* vp = (const ArgmaxVec16*)(row + head);
  float nacc = 0.0f;  // NaN once a vector had one
  // The vector that holds m (index bv, DV_NO_ID: none) is kept as loaded, in this
  // thread's slot of `keep` (shared memory: no registers held across the loop): its first
  // column equal to m is found once, after the loop, instead of at every vector that
  // raises m (most of a row's first vectors do).
  unsigned bv = DV_NO_ID;
  auto take = [&](const ArgmaxVec16& r, unsigned vi) {
    const float vm = dv_vector_max_nan<Tag>(r);
    nacc = dv_fmax_nan(nacc, vm);
    if constexpr (kKeys) {
      if (vi < nkeys) vkey[vi] = dv_vector_key(vm);
    }
    if (vm > m) {  // (vm equals the value of its first column equal to it, -0 == +0)
      m = vm;
      bv = vi;
      keep[t] = r;
    }
  };
  // rounds of U loads a thread, each load behind its own bounds test (without them,
  // ptxas sinks each load to its use: one load in flight)
  for (unsigned v = t; v < nvec; v += U * B) {
    ArgmaxVec16 raw[U];
#pragma unroll
    for (unsigned u = 0; u < U; ++u)
      if (v + u * B < nvec) raw[u] = argmax_load16(vp + (v + u * B));
#pragma unroll
    for (unsigned u = 0; u < U; ++u)
      if (v + u * B < nvec) take(raw[u], v + u * B);
  }
  if (bv != DV_NO_ID) {  // the first column of the vector that holds m
    float xs[E];
    ArgmaxUnpack<Tag>::run(keep[t], xs);
    unsigned j = E - 1;
    float xj = xs[E - 1];
#pragma unroll
    for (int i = (int)E - 2; i >= 0; --i) {  // (no indexing by j: xs stays in registers)
      const bool eq = xs[i] == m;
      j = eq ? (unsigned)i : j;
      xj = eq ? xs[i] : xj;
    }
    m = xj;
    mc = head + bv * E + j;
  }
  for (unsigned c = head + nvec * E + t; c < ncols; c += B) {
    const float x = argmax_load1<Tag>(row + c);
    nan |= x != x;
    if (x > m) {
      m = x;
      mc = c;
    }
  }
  return nan || nacc != nacc;
}

// The top-k pass's threshold (an order key): at least kk columns of the row have a key
// at or above it, so the row's first kk columns in key order are among them. It is the
// kk-th largest of the threads' own maxima (key: my_key, 0 for a thread without one):
// the kk largest are kk distinct columns at or above it. Each warp sorts its lanes' keys
// (bitonic, descending by lane) into sorted[32 * warp ..]; each entry's place in the
// order (key desc, warp asc, place in its warp asc) is its place in its warp plus, in
// every other warp, the entries at or above it (a warp before) or above it (a warp
// after), found by binary search; the entry at place kk - 1 is the threshold. On random
// rows (a rough estimate) about kk columns pass (55 for kk = 50 of 19 008; the smallest
// of the warps' ceil(kk / warps)-th keys let about 97 pass); 0 (every column) when a
// warp is partial or kk exceeds the threads. sorted: blockDim.x words of shared memory,
// free; every thread calls it.
__device__ __forceinline__ unsigned dv_topk_threshold(DvShared& red, unsigned* sorted,
                                                      unsigned my_key, unsigned kk) {
  const unsigned t = threadIdx.x, lane = t & 31u, wid = t >> 5, W = dv_nwarps();
  if (dv_warp_width() != 32u || kk > 32u * W) return 0u;  // (uniform over the block)
  unsigned key = my_key;
  for (unsigned k = 2; k <= 32u; k <<= 1) {
    for (unsigned j = k >> 1; j > 0; j >>= 1) {
      const unsigned other = __shfl_xor_sync(DV_FULL, key, (int)j);
      const bool keep_max = ((lane & k) == 0) == ((lane & j) == 0);
      key = keep_max ? (other > key ? other : key) : (other < key ? other : key);
    }
  }
  sorted[t] = key;
  __syncthreads();
  unsigned place = lane;
  for (unsigned w2 = 0; w2 < W; ++w2) {
    if (w2 == wid) continue;
    const unsigned* a = sorted + 32u * w2;
    const bool before = w2 < wid;
    unsigned c = 0;  // a's leading entries that come before this one (a is descending)
    for (unsigned s = 16; s >= 1; s >>= 1) {
      const unsigned x = a[c + s - 1u];
      if (before ? x >= key : x > key) c += s;
    }
    const unsigned x = a[31];  // (c is 31 at most above: all 32 may come before)
    if (before ? x >= key : x > key) c += 1u;
    place += c;
  }
  if (place == kk - 1u) red.u2[0] = key;  // exactly one entry has each place
  __syncthreads();
  const unsigned thr = red.u2[0];
  __syncthreads();  // (the caller's next reductions reuse red and sorted's words)
  return thr;
}

// Pass 2 of a top-k row without NaN: every column whose order key is at or above thr
// (dv_topk_threshold) into the candidates in shared memory, any order. The first nkeys
// vectors after the head have their keys in sh.vkey (dv_row_max): only those whose key is
// at or above thr >> 16 are read again (a few on random rows). The other columns are
// read again in full. Either way each warp reserves its slots with one atomic, and only
// when one of its lanes has such a column in the vector. sh.k.n_cand must be 0 on entry
// and visible to every thread. Returns false when they overflowed DV_CAND_CAP (many equal
// values): the caller selects over the row.
template <typename Tag>
__device__ bool dv_row_topk_gather(const typename Tag::Storage* row, unsigned ncols,
                                   unsigned col0, unsigned thr, DvRecordShared& sh,
                                   unsigned nkeys) {
  typedef typename Tag::Storage S;
  constexpr unsigned E = ArgmaxUnpack<Tag>::kPerVec;
  const unsigned t = threadIdx.x, B = blockDim.x, lane = t & 31u;
  // no NaN here: key(x) >= thr <=> x >= the value of thr (-0 == +0 on both sides)
  const float tv = thr == 0u ? dv_neg_inf() : dv_key_value(thr);
  auto visit = [&](float x, unsigned c, bool valid) {
    const bool pass = valid && x >= tv;
    const unsigned mask = __ballot_sync(DV_FULL, pass);
    if (mask != 0u) {  // uniform over the warp
      const unsigned leader = (unsigned)__ffs(mask) - 1u;
      unsigned base = 0;
      if (lane == leader) base = atomicAdd(&sh.k.n_cand, (unsigned)__popc(mask));
      base = __shfl_sync(DV_FULL, base, (int)leader);
      const unsigned slot = base + __popc(mask & ((1u << lane) - 1u));
      if (pass && slot < DV_CAND_CAP) {
        sh.k.cand[slot] = ((dv_u64)dv_order_key(x) << 32) | (dv_u64)(~(col0 + c));
      }
    }
  };
  const unsigned mis = (unsigned)(((dv_u64)row & 15ull) / sizeof(S));
  unsigned head = mis ? E - mis : 0u;
  if (head > ncols) head = ncols;
  for (unsigned c0 = 0; c0 < head; c0 += B) {  // fewer than E columns
    const unsigned c = c0 + t;
    visit(c < head ? argmax_load1<Tag>(row + c) : 0.0f, c, c < head);
  }
  const unsigned nvec = (ncols - head) / E;
  const ArgmaxVec16* vp = (const ArgmaxVec16*)(row + head);
  // thr 0 (every column passes) reads the row in full
  unsigned nk = thr == 0u ? 0u : (nkeys < nvec ? nkeys : nvec);
  // the kept keys, 8 vectors a thread per 16-byte shared load: each warp lists the
  // vectors whose key can hold a column at or above thr (dv_vector_key_range; in the
  // histogram's words, unused until a select over the row; any order, a lane reserving
  // its entries with one shared atomic), then reads its whole list at once, a vector a
  // lane. A list that overflows: the row is read in full.
  const unsigned wid = t >> 5;
  unsigned lo, span;
  dv_vector_key_range(thr, &lo, &span);
  constexpr unsigned L = DV_VLIST;  // list entries a warp
  unsigned* wl = sh.k.hist + wid * L;
  if (lane == 0) sh.k.wcount[wid] = 0;
  __syncwarp();
  const unsigned ng = (nk + 7u) / 8u;
  for (unsigned g = t; g < ng; g += B) {
    unsigned w[4];
#ifdef DP_ARGMAX_CPU_EMULATION
    for (unsigned j = 0; j < 4u; ++j)
      w[j] = (unsigned)sh.vkey[8u * g + 2u * j] | ((unsigned)sh.vkey[8u * g + 2u * j + 1u] << 16);
#else
    const ArgmaxVec16 k8 = *reinterpret_cast<const ArgmaxVec16*>(sh.vkey + 8u * g);
    for (unsigned j = 0; j < 4u; ++j) w[j] = k8.w[j];  // (little-endian)
#endif
    unsigned bits = 0;
#pragma unroll
    for (unsigned j = 0; j < 4u; ++j) {
      bits |= ((w[j] & 0xFFFFu) - lo <= span ? 1u : 0u) << (2u * j);
      bits |= ((w[j] >> 16) - lo <= span ? 1u : 0u) << (2u * j + 1u);
    }
    if (8u * g + 8u > nk) bits &= (1u << (nk - 8u * g)) - 1u;  // the last group's keys
    if (bits != 0u) {  // rare: a few vectors of a row
      unsigned at = atomicAdd(&sh.k.wcount[wid], (unsigned)__popc(bits));
      for (; bits != 0u; bits &= bits - 1u, ++at)
        if (at < L) wl[at] = 8u * g + (unsigned)(__ffs(bits) - 1);
    }
  }
  __syncwarp();
  const unsigned nl = sh.k.wcount[wid];  // (uniform over the warp)
  if (dv_block_min(sh.row.red, nl > L ? 0u : 1u) == 0u) {
    nk = 0;  // some warp's list overflowed (uniform over the block)
  } else {
    __syncwarp();
    for (unsigned i0 = 0; i0 < nl; i0 += 32u) {  // uniform over the warp
      const unsigned i = i0 + lane;
      const unsigned v = i < nl ? wl[i] : 0u;
      ArgmaxVec16 raw;
      raw.w[0] = raw.w[1] = raw.w[2] = raw.w[3] = 0u;
      if (i < nl) raw = argmax_load16(vp + v);
      float xs[E];
      ArgmaxUnpack<Tag>::run(raw, xs);
#pragma unroll
      for (unsigned e = 0; e < E; ++e) visit(xs[e], head + v * E + e, i < nl);
    }
  }
  constexpr unsigned G = 2;  // loads per thread and round
  for (unsigned v0 = nk; v0 < nvec; v0 += G * B) {  // uniform trip count (warp votes)
    const unsigned v = v0 + t;
    ArgmaxVec16 raw[G];
#pragma unroll
    for (unsigned h = 0; h < G; ++h) {
      raw[h].w[0] = raw[h].w[1] = raw[h].w[2] = raw[h].w[3] = 0u;
      if (v + h * B < nvec) raw[h] = argmax_load16(vp + (v + h * B));
    }
#pragma unroll
    for (unsigned h = 0; h < G; ++h) {
      const unsigned vv = v + h * B;
      float xs[E];
      ArgmaxUnpack<Tag>::run(raw[h], xs);
      bool any = false;
#pragma unroll
      for (unsigned j = 0; j < E; ++j) any |= xs[j] >= tv;
      if (__ballot_sync(DV_FULL, any && vv < nvec) != 0u) {  // rare once past the head
#pragma unroll
        for (unsigned j = 0; j < E; ++j) visit(xs[j], head + vv * E + j, vv < nvec);
      }
    }
  }
  const unsigned tail = head + nvec * E;
  for (unsigned c0 = tail; c0 < ncols; c0 += B) {  // fewer than E columns
    const unsigned c = c0 + t;
    visit(c < ncols ? argmax_load1<Tag>(row + c) : 0.0f, c, c < ncols);
  }
  __syncthreads();
  const bool ok = sh.k.n_cand <= DV_CAND_CAP;
  __syncthreads();
  return ok;
}

// The first kk of n gathered candidates (n <= blockDim.x) into rec's list in key order:
// candidate t's rank is the number of candidates before it (key desc, id asc), counted
// two candidates (one 16-byte shared load) at a time, without a branch.
struct alignas(16) DvCandPair {
  dv_u64 a, b;
};
__device__ void dv_select_few(const DvRecordShared& sh, unsigned n, unsigned kk, unsigned kcap,
                              unsigned* rec) {
  const unsigned t = threadIdx.x;
  if (t < n) {
    const dv_u64* c = sh.k.cand;
    const dv_u64 me = c[t];
    unsigned r = 0, j = 0;
#pragma unroll 4
    for (; j + 2u <= n; j += 2u) {
#ifdef DP_ARGMAX_CPU_EMULATION
      const dv_u64 a = c[j], b = c[j + 1];
#else
      const DvCandPair pr = *reinterpret_cast<const DvCandPair*>(c + j);
      const dv_u64 a = pr.a, b = pr.b;
#endif
      r += (a > me ? 1u : 0u) + (b > me ? 1u : 0u);
    }
    if (j < n) r += c[j] > me ? 1u : 0u;
    if (r < kk) {
      const unsigned key = (unsigned)(me >> 32);
      rec[DV_HDR + r] = argmax_f2u(dv_key_value(key));
      rec[DV_HDR + kcap + r] = ~(unsigned)me;
    }
  }
  __syncthreads();
}

// Floats (no NaN) as unsigned in their order; -0 just below +0.
__device__ __forceinline__ unsigned dv_ord(float x) {
  const unsigned u = argmax_f2u(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float dv_unord(unsigned k) {
  return argmax_u2f((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

// The smallest raw logit x with float32(x / T + DV_G_BOUND) >= s, the column's best
// possible score (T > 0; s is the score of a column of the row, whose value is at most
// m, so x = m qualifies).
// Division by a positive T and the addition are monotone, so a column whose raw logit
// is below the result cannot reach s: one comparison per column instead of a division.
// An estimate, then a doubling search for a bracket, then bisection (a few steps).
__device__ float dv_raw_bound(float s, float T, float m) {
  if (s == dv_neg_inf()) return dv_neg_inf();  // every column qualifies
  const unsigned lo_end = dv_ord(dv_neg_inf()), hi_end = dv_ord(m);
  float est = (s - DV_G_BOUND) * T;
  if (!argmax_isfinite(est) || est > m) est = m;
  const unsigned k = dv_ord(est);
  unsigned lo, hi;  // the predicate is false at lo, true at hi
  if (dv_fadd(dv_fdiv(est, T), DV_G_BOUND) >= s) {
    hi = k;
    for (unsigned step = 1;; step *= 2) {
      if (hi - lo_end <= step) {
        if (dv_fadd(dv_fdiv(dv_neg_inf(), T), DV_G_BOUND) >= s) return dv_neg_inf();
        lo = lo_end;
        break;
      }
      lo = hi - step;
      if (!(dv_fadd(dv_fdiv(dv_unord(lo), T), DV_G_BOUND) >= s)) break;
      hi = lo;
    }
  } else {
    lo = k;
    for (unsigned step = 1;; step *= 2) {
      if (hi_end - lo <= step) {
        hi = hi_end;
        break;
      }
      hi = lo + step;
      if (dv_fadd(dv_fdiv(dv_unord(hi), T), DV_G_BOUND) >= s) break;
      lo = hi;
    }
  }
  while (hi - lo > 1) {
    const unsigned mid = lo + (hi - lo) / 2;
    if (dv_fadd(dv_fdiv(dv_unord(mid), T), DV_G_BOUND) >= s)
      hi = mid;
    else
      lo = mid;
  }
  return dv_unord(hi);
}

// The largest float32 at or below d (not NaN).
__device__ __forceinline__ float dv_float_down(double d) {
  float f = (float)d;
  if ((double)f > d) {
    const unsigned u = argmax_f2u(f);
    f = f > 0.0f ? argmax_u2f(u - 1u) : (f == 0.0f ? argmax_u2f(0x80000001u) : argmax_u2f(u + 1u));
  }
  return f;
}

// A raw logit at or below every x with float32(float32(x / T) + DV_G_BOUND) >= s (T > 0):
// at or below dv_raw_bound's result, without its search (float64, margins far above the
// roundings'); -inf when s is not finite (every column then passes).
__device__ __forceinline__ float dv_raw_bound_fast(float s, float T) {
  if (!argmax_isfinite(s)) return dv_neg_inf();
  const double sd = (double)s;
  // a float32 sum at or above s: its exact sum is at or above s - |s| 2**-24 - 2**-150
  double c = sd - (double)DV_G_BOUND - (fabs(sd) * 0x1p-20 + 0x1p-140);
  // a float32 quotient at or above c: the exact x / T is at or above c - |c| 2**-24 - 2**-150
  c -= fabs(c) * 0x1p-20 + 0x1p-140;
  const double xd = c * (double)T;
  return dv_float_down(xd - fabs(xd) * 0x1p-40);
}

// A shared word another warp may raise (a load the loop does not keep in a register).
__device__ __forceinline__ unsigned dv_shared_read(const unsigned* p) {
#ifdef DP_ARGMAX_CPU_EMULATION
  return __atomic_load_n(p, __ATOMIC_RELAXED);
#else
  return *(const volatile unsigned*)p;
#endif
}

// A warp's queue of the columns of a TEMP row that pass the bound (xb), scored two warps'
// worth at a time (dv_row_temp, dv_row_max_temp): the lane's best so far (best_*). kRising
// (dv_row_max_temp): the bound rises as the block scores columns; a lane whose best rises
// raises the block's (sh->best_key) at its next drain, and the warp then reads that back
// (bar, the best score the lane knows of) and raises xb; else bar is the lane's best.
template <bool kRising>
struct DvTempQueue {
  float* qx;
  unsigned* qid;
  unsigned cnt;  // the queue's length (the same on every lane of the warp)
  unsigned lane, W, col0, k0, k1;
  float T, rT, xb;
  float best_score, best_val;
  unsigned best_id;
  float bar;         // kRising: the best score this lane knows of (its own or the block's)
  unsigned bar_key;  // kRising: dv_ord of bar (0: none)
  bool improved;     // kRising: this lane's best rose since it last raised the block's
  DvRowShared* sh;   // kRising: the block's best (best_key)

  // a row's start: its noise stream and temperature, no best yet, this warp's queue empty
  // and every column passing (xb = -inf) until the caller sets the bound
  __device__ __forceinline__ void start(const DvParams& p, dv_u64 key, unsigned c0,
                                        DvRowShared& s, DvQueue& q) {
    const unsigned t = threadIdx.x;
    T = p.temperature;
    rT = 1.0f / T;
    k0 = (unsigned)(key & 0xFFFFFFFFull);
    k1 = (unsigned)(key >> 32);
    best_score = dv_neg_inf();
    best_id = DV_NO_ID;
    best_val = dv_neg_inf();
    bar = dv_neg_inf();
    bar_key = 0u;
    xb = dv_neg_inf();
    improved = false;
    sh = &s;
    qx = q.x[t >> 5];
    qid = q.id[t >> 5];
    cnt = 0;
    lane = t & 31u;
    W = dv_warp_width();
    col0 = c0;
  }

  // queue column c (value x) if it passes the bound; every lane of the warp calls it
  __device__ __forceinline__ void push(float x, unsigned c, bool valid) {
    const bool pass = valid && x >= xb;
    const unsigned mask = __ballot_sync(DV_FULL, pass);
    if (pass) {
      const unsigned slot = cnt + __popc(mask & ((1u << lane) - 1u));
      qx[slot] = x;
      qid[slot] = col0 + c;
    }
    cnt += __popc(mask);
  }
  // the rest of one queued column's score, its uniform u known
  __device__ __forceinline__ void finish(float x, unsigned id, float u) {
    // z + g(u) >= best needs u >= exp(-exp(z - best)) (g increases with u): a fast
    // estimate, from an upper bound on z (x times 1/T is within 2 ulp of x / T) and with
    // a wide margin, skips the exact division and noise of the columns that cannot win;
    // any score some column reaches will do as best (a score below it cannot win)
    const float b = kRising ? bar : best_score;
    const float za = x * rT, zh = za + ((za < 0.0f ? -za : za) * 1e-6f + 1e-37f);
    if (!(dv_fadd(zh, DV_G_BOUND) >= b)) return;  // cannot win
    if (u < __expf(-__expf(zh - b)) * 0.9999f) return;
    const float sc = dv_fadd(dv_fdiv(x, T), dv_gumbel(u));
    if (dv_better(sc, id, best_score, best_id)) {
      best_score = sc;
      best_id = id;
      best_val = x;
      if constexpr (kRising) improved = true;
    }
  }
  // score every two warps' worth of the queue, move the rest to its front
  __device__ __forceinline__ void drain() {
    if (cnt < 2 * W) return;  // uniform over the warp
    __syncwarp();
    unsigned base = 0;
    for (; base + 2 * W <= cnt; base += 2 * W) {
      const float xa = qx[base + lane], xc = qx[base + W + lane];
      const unsigned ia = qid[base + lane], ic = qid[base + W + lane];
      const unsigned wa = dv_philox32_w0(ia, k0, k1), wc = dv_philox32_w0(ic, k0, k1);
      finish(xa, ia, dv_uniform(wa));
      finish(xc, ic, dv_uniform(wc));
    }
    // lane l reads and writes only slots l, W + l, base + l, base + W + l: no hazard
    const unsigned rest = cnt - base;
    if (lane < rest) {
      qx[lane] = qx[base + lane];
      qid[lane] = qid[base + lane];
    }
    if (W + lane < rest) {
      qx[W + lane] = qx[base + W + lane];
      qid[W + lane] = qid[base + W + lane];
    }
    cnt = rest;
    __syncwarp();
    if constexpr (kRising) raise();
  }
  // the leftovers (fewer than two warps' worth): pad the queue with a column that never
  // beats a lane's best (x, id: the first best's), and score one more round
  __device__ __forceinline__ void flush(float pad_x, unsigned pad_id) {
    if (cnt > 0) {
      if (lane >= cnt) {
        qx[lane] = pad_x;
        qid[lane] = pad_id;
      }
      if (W + lane >= cnt) {
        qx[W + lane] = pad_x;
        qid[W + lane] = pad_id;
      }
      cnt = 2 * W;
      drain();
    }
  }
  // kRising: share this lane's best if it rose, take the block's, raise the bound
  __device__ __forceinline__ void raise() {
#if DV_TEMP_ONEPASS > 0
    if (improved) {
      atomicMax(&sh->best_key, dv_ord(best_score));
      improved = false;
    }
    const unsigned bk = dv_shared_read(&sh->best_key);
    if (bk > bar_key) {
      bar_key = bk;
      bar = dv_unord(bk);
      xb = dv_raw_bound_fast(bar, T);
    }
#endif
  }
};

// The best (score desc, id asc) column of a TEMP row of one shard: m (its column
// max_id) is the shard's maximum, my_m (column my_id, DV_NO_ID: none) this thread's, no
// column is NaN. Each column's score is float32(x / T) + noise, and the noise is below
// DV_G_BOUND: only columns at or above dv_raw_bound of a score already reached can win.
// That first score is the best of every thread's own maximum (one noise per thread, near
// the row's final best, so the bound spares nearly every column that cannot win). Each
// warp queues the columns that pass in shared memory and scores them 64 at a time, two
// per lane (two independent Philox chains), so the noise runs on full warps whatever
// the share of such columns; a fast single-precision estimate then spares the exact
// double-precision noise of the columns that cannot beat the lane's best. The scoring
// code sits at three places only (head, vectors, tail), not once per unrolled column:
// the kernel's instructions stay within the instruction caches.
template <typename Tag>
__device__ void dv_row_temp(const typename Tag::Storage* row, unsigned ncols, unsigned col0,
                            const DvParams& p, unsigned d, float m, float my_m, unsigned my_id,
                            float& best_score, unsigned& best_id, float& best_val,
                            DvRowShared& sh, DvQueue& q) {
  typedef typename Tag::Storage S;
  constexpr unsigned E = ArgmaxUnpack<Tag>::kPerVec;
  const unsigned t = threadIdx.x, B = blockDim.x;
  const dv_u64 key = dv_stream_key(p, d);
  DvTempQueue<false> w;
  w.start(p, key, col0, sh, q);
  if (my_id != DV_NO_ID) {
    w.best_score = dv_fadd(dv_fdiv(my_m, w.T), dv_noise(key, my_id));
    w.best_id = my_id;
    w.best_val = my_m;
  }
  dv_block_best(sh.red, w.best_score, w.best_id, w.best_val);
  if (t == 0) sh.bound = dv_raw_bound(w.best_score, w.T, m);  // m's score is at most this
  __syncthreads();
  w.xb = sh.bound;
  const float first_val = w.best_val;  // a column that never beats the best (queue padding)
  const unsigned first_id = w.best_id;
  const unsigned mis = (unsigned)(((dv_u64)row & 15ull) / sizeof(S));
  unsigned head = mis ? E - mis : 0u;
  if (head > ncols) head = ncols;
  for (unsigned c0 = 0; c0 < head; c0 += B) {  // fewer than E columns: no drain needed
    const unsigned c = c0 + t;
    w.push(c < head ? argmax_load1<Tag>(row + c) : 0.0f, c, c < head);
  }
  w.drain();
  const unsigned nvec = (ncols - head) / E;
  const ArgmaxVec16* vp = (const ArgmaxVec16*)(row + head);
  ArgmaxVec16 cur;
  cur.w[0] = cur.w[1] = cur.w[2] = cur.w[3] = 0u;
  if (t < nvec) cur = argmax_load16(vp + t);
  for (unsigned v0 = 0; v0 < nvec; v0 += B) {
    const unsigned v = v0 + t;
    ArgmaxVec16 nxt;  // the next vector's load in flight while this one is scored
    nxt.w[0] = nxt.w[1] = nxt.w[2] = nxt.w[3] = 0u;
    if (v + B < nvec) nxt = argmax_load16(vp + (v + B));
    float xs[E];
    ArgmaxUnpack<Tag>::run(cur, xs);
#pragma unroll
    for (unsigned j = 0; j < E; ++j) w.push(xs[j], head + v * E + j, v < nvec);
    w.drain();
    cur = nxt;
  }
  const unsigned tail = head + nvec * E;
  for (unsigned c0 = tail; c0 < ncols; c0 += B) {  // fewer than E columns
    const unsigned c = c0 + t;
    w.push(c < ncols ? argmax_load1<Tag>(row + c) : 0.0f, c, c < ncols);
  }
  w.drain();
  w.flush(first_val, first_id);
  best_score = w.best_score;
  best_id = w.best_id;
  best_val = w.best_val;
  dv_block_best(sh.red, best_score, best_id, best_val);
}

#if DV_TEMP_ONEPASS > 0

// A TEMP row's one read (DV_TEMP_ONEPASS): what dv_row_max gives (this thread's first
// maximum m at column mc, and whether one of its columns is NaN) and, as dv_row_temp
// finds it, this thread's best (score desc, id asc) column under the row's noise
// (best_*). The caller takes the block's best when the row has no NaN and a finite
// maximum; otherwise it calls dv_row_temp, which reads the row again.
// No score is known before the read, so the bound starts from a seed: the block's
// maximum over every thread's first vector, scored (one noise a row). Then, as in
// dv_row_temp, each warp queues the columns at or above its bound and scores 64 at a
// time; a lane whose best rises raises the block's best (sh.best_key), and each warp
// reads that back after each drain and raises its bound. Every bound comes from a score
// some column of the row reaches, which the winner's is at or above, so the winner is
// always queued and scored; the bound is a cheap one at or below dv_raw_bound's. The
// loads run a round of DV_ONEPASS_UNROLL vectors a thread ahead.
template <typename Tag>
__device__ bool dv_row_max_temp(const typename Tag::Storage* row, unsigned ncols,
                                unsigned col0, const DvParams& p, unsigned d, float& m,
                                unsigned& mc, float& best_score, unsigned& best_id,
                                float& best_val, DvRowShared& sh, DvQueue& q) {
  typedef typename Tag::Storage S;
  constexpr unsigned E = ArgmaxUnpack<Tag>::kPerVec, U = DV_ONEPASS_UNROLL;
  const unsigned t = threadIdx.x, B = blockDim.x;
  const dv_u64 key = dv_stream_key(p, d);
  m = dv_neg_inf();
  mc = DV_NO_ID;
  bool nan = false;
  float nacc = 0.0f;  // NaN once a vector had one
  DvTempQueue<true> w;
  w.start(p, key, col0, sh, q);
  const unsigned mis = (unsigned)(((dv_u64)row & 15ull) / sizeof(S));
  unsigned head = mis ? E - mis : 0u;
  if (head > ncols) head = ncols;
  for (unsigned c0 = 0; c0 < head; c0 += B) {  // fewer than E columns, queued (no bound yet)
    const unsigned c = c0 + t;
    const bool ok = c < head;
    const float x = ok ? argmax_load1<Tag>(row + c) : 0.0f;
    if (ok) {
      nan |= x != x;
      if (x > m) {
        m = x;
        mc = c;
      }
    }
    w.push(x, c, ok);
  }
  const unsigned nvec = (ncols - head) / E;
  const ArgmaxVec16* vp = (const ArgmaxVec16*)(row + head);
  ArgmaxVec16 cur[U];
#pragma unroll
  for (unsigned u = 0; u < U; ++u) {
    cur[u].w[0] = cur[u].w[1] = cur[u].w[2] = cur[u].w[3] = 0u;
    if (t + u * B < nvec) cur[u] = argmax_load16(vp + (t + u * B));
  }
  // the seed: the block's first maximum over every thread's first vector, scored
  float sm = dv_neg_inf(), unused = 0.0f;
  unsigned sid = DV_NO_ID;
  if (t < nvec) {
    float xs[E];
    ArgmaxUnpack<Tag>::run(cur[0], xs);
#pragma unroll
    for (unsigned j = 0; j < E; ++j) {
      if (xs[j] > sm) {  // (never a NaN)
        sm = xs[j];
        sid = col0 + head + t * E + j;
      }
    }
  }
  if (t == 0) sh.best_key = 0u;  // (the previous row's: no thread reads it before the barrier)
  dv_block_best(sh.red, sm, sid, unused);
  if (sid != DV_NO_ID) {
    w.best_score = dv_fadd(dv_fdiv(sm, w.T), dv_noise(key, sid));
    w.best_id = sid;
    w.best_val = sm;
    w.bar = w.best_score;
    w.bar_key = dv_ord(w.bar);
    w.xb = dv_raw_bound_fast(w.bar, w.T);
  }
  const float first_val = w.best_val;  // a column that never beats a lane's best (padding)
  const unsigned first_id = w.best_id;
  w.drain();
  for (unsigned v0 = 0; v0 < nvec; v0 += U * B) {  // (v0 the same on every thread)
    ArgmaxVec16 nxt[U];
#pragma unroll
    for (unsigned u = 0; u < U; ++u) {
      nxt[u].w[0] = nxt[u].w[1] = nxt[u].w[2] = nxt[u].w[3] = 0u;
      const unsigned vn = v0 + (U + u) * B + t;
      if (vn < nvec) nxt[u] = argmax_load16(vp + vn);
    }
#pragma unroll
    for (unsigned u = 0; u < U; ++u) {
      const unsigned v = v0 + u * B + t;
      const bool ok = v < nvec;
      float xs[E];
      ArgmaxUnpack<Tag>::run(cur[u], xs);
      if (ok) {
        float vm = xs[0];
#pragma unroll
        for (unsigned j = 1; j < E; ++j) vm = dv_fmax_nan(vm, xs[j]);
        nacc = dv_fmax_nan(nacc, vm);
        if (vm > m) {  // its first column equal to vm (-0 == +0) is the new first maximum
          unsigned j = E - 1;
          float xj = xs[E - 1];
#pragma unroll
          for (int i = (int)E - 2; i >= 0; --i) {  // (no indexing by j: xs stays in registers)
            const bool eq = xs[i] == vm;
            j = eq ? (unsigned)i : j;
            xj = eq ? xs[i] : xj;
          }
          m = xj;
          mc = head + v * E + j;
        }
      }
#pragma unroll
      for (unsigned j = 0; j < E; ++j) w.push(xs[j], head + v * E + j, ok);
      w.drain();
    }
#pragma unroll
    for (unsigned u = 0; u < U; ++u) cur[u] = nxt[u];
  }
  const unsigned tail = head + nvec * E;
  for (unsigned c0 = tail; c0 < ncols; c0 += B) {  // fewer than E columns
    const unsigned c = c0 + t;
    const bool ok = c < ncols;
    const float x = ok ? argmax_load1<Tag>(row + c) : 0.0f;
    if (ok) {
      nan |= x != x;
      if (x > m) {
        m = x;
        mc = c;
      }
    }
    w.push(x, c, ok);
  }
  w.drain();
  w.flush(first_val, first_id);  // the leftovers, padded with the seed's column
  best_score = w.best_score;
  best_id = w.best_id;
  best_val = w.best_val;
  return nan || nacc != nacc;
}
#endif

// DV_PREFETCH_LINES 128-byte lines a thread of the first ones of the CTA's next row
// (next, next_cols columns; null: none) asked of L2, once this row's first pass has read
// its columns: the next row's first reads then come from L2 while this row's serial steps
// (the temperature pass's noise) keep its own loads few. 0: off (no code). The one-sided
// kernel without top-k lists passes its next row (env IPC_DPSAMPLE_VERIFY_PREFETCH_LINES).
// With 2 (the default), pad_bs=256 temperature rows measured 3 % faster in fp32 and 1 % in
// bf16 on an H100 (BENCHMARKS.md); top-k rows were slower with it, so the kernel of batches
// with top-k lists never asks.
#ifndef DV_PREFETCH_LINES
#define DV_PREFETCH_LINES 2
#endif
template <typename S>
__device__ __forceinline__ void dv_prefetch_head(const S* next, unsigned next_cols) {
#if DV_PREFETCH_LINES > 0 && !defined(DP_ARGMAX_CPU_EMULATION)
  if (next == nullptr) return;
  const char* a = reinterpret_cast<const char*>(next);
  const dv_u64 bytes = (dv_u64)next_cols * sizeof(S);
#pragma unroll
  for (unsigned j = 0; j < DV_PREFETCH_LINES; ++j) {
    const dv_u64 at = ((dv_u64)j * blockDim.x + threadIdx.x) * 128ull;
    if (at < bytes) asm volatile("prefetch.global.L2 [%0];" ::"l"(a + at));
  }
#else
  (void)next;
  (void)next_cols;
#endif
}

// The record of one row: `ncols` counted columns (those below vocab_limit) starting at
// global id col0; rec is DV_HDR + 2*kcap words (shared or global memory of this CTA).
// Every thread of the block calls it; rec is complete when it returns. kList: the
// kernel holds the top-k selection's shared memory (`ls`, whose queue is `q`); without
// it (kcap must be 0) the row needs only `rs` and `q`, so more CTAs fit on an SM.
// next, next_cols: the CTA's next row, for dv_prefetch_head (null: none).
template <typename Tag, bool kList>
__device__ void dv_row_record(const typename Tag::Storage* row, unsigned ncols, unsigned col0,
                              const DvParams& p, unsigned d, unsigned kcap, bool want_lp,
                              unsigned cand, unsigned digest, unsigned* rec, DvRowShared& rs,
                              DvQueue& q, DvRecordShared* ls,
                              const typename Tag::Storage* next = nullptr,
                              unsigned next_cols = 0) {
  const unsigned t = threadIdx.x;
  dv_phase(DV_PH_REC + 0);
  const int mode = dv_mode(p);
  unsigned list_len = 0;
  if (kList && mode == DV_TOPK && ncols > 0) {
    list_len = (unsigned)p.top_k < ncols ? (unsigned)p.top_k : ncols;
    if (list_len > kcap) list_len = kcap;  // the host sizes kcap to the largest top-k
  }
  if (kList && t == 0) ls->k.n_cand = 0;  // (the barriers below publish it)
  // pass 1: first maximum; a row with a NaN is read again, every value handled, for its
  // first NaN (and its maximum, as torch.argmax has it)
  unsigned nan_id = DV_NO_ID, max_id = DV_NO_ID;
  float m = dv_neg_inf();
  unsigned mc;
  // the top-k kernel's first pass with DV_LIST_UNROLL loads in flight, the other's with
  // DV_MAX_UNROLL
  constexpr unsigned kUnroll = kList ? DV_LIST_UNROLL : DV_MAX_UNROLL;
#if DV_TEMP_ONEPASS > 0
  // a TEMP row of this dtype in the kernel without lists: its sampled column from the
  // same read (dv_row_max_temp), this thread's best
  constexpr bool kOnePass =
      !kList &&
      (DV_TEMP_ONEPASS == 2 || (DV_TEMP_ONEPASS == 1 && sizeof(typename Tag::Storage) == 4));
  float t_score = dv_neg_inf(), t_val = dv_neg_inf();
  unsigned t_id = DV_NO_ID;
  bool saw_nan;
  if constexpr (kOnePass) {
    if (mode == DV_TEMP)
      saw_nan = dv_row_max_temp<Tag>(row, ncols, col0, p, d, m, mc, t_score, t_id, t_val, rs, q);
    else
      saw_nan = dv_row_max<Tag, kList, kUnroll>(
          row, ncols, m, mc, reinterpret_cast<ArgmaxVec16*>(q.x), kList ? ls->vkey : nullptr,
          list_len > 0 ? (unsigned)DV_VKEY_CAP : 0u);
  } else {
    saw_nan = dv_row_max<Tag, kList, kUnroll>(
        row, ncols, m, mc, reinterpret_cast<ArgmaxVec16*>(q.x), kList ? ls->vkey : nullptr,
        list_len > 0 ? (unsigned)DV_VKEY_CAP : 0u);
  }
#else
  const bool saw_nan =
      dv_row_max<Tag, kList, kUnroll>(row, ncols, m, mc, reinterpret_cast<ArgmaxVec16*>(q.x),
                                      kList ? ls->vkey : nullptr,
                                      list_len > 0 ? (unsigned)DV_VKEY_CAP : 0u);
#endif
  if (mc != DV_NO_ID) max_id = col0 + mc;
  const bool has_nan = dv_block_min(rs.red, saw_nan ? 0u : 1u) == 0u;
  dv_phase(DV_PH_REC + 1);  // pass 1
  dv_prefetch_head(next, next_cols);  // the CTA's next row, during this one's serial steps
  if (has_nan) {
    m = dv_neg_inf();
    max_id = DV_NO_ID;
    dv_row_each<Tag>(row, ncols, [&](float x, unsigned c) {
      if (argmax_isnan(x)) {
        if (nan_id == DV_NO_ID) nan_id = col0 + c;
      } else if (max_id == DV_NO_ID || x > m) {
        m = x;
        max_id = col0 + c;
      }
    });
    nan_id = dv_block_min(rs.red, nan_id);
  }
  const float my_m = m;  // this thread's own maximum (the temperature and top-k start)
  const unsigned my_id = max_id;
  float unused = 0.0f;
  dv_block_best(rs.red, m, max_id, unused);
  dv_phase(DV_PH_REC + 2);
  if (!has_nan && max_id == DV_NO_ID && ncols > 0) max_id = col0;  // every column -inf
  // the top-k rows' candidates: the columns at or above a threshold from the threads'
  // own maxima (a second read of the row)
  bool gathered = false;
  if constexpr (kList) {
    if (list_len > 0 && !has_nan) {
      const unsigned thr = dv_topk_threshold(
          rs.red, ls->k.hist, my_id != DV_NO_ID ? dv_order_key(my_m) : 0u, list_len);
      dv_phase(DV_PH_REC + 3);
      gathered = dv_row_topk_gather<Tag>(row, ncols, col0, thr, *ls, DV_VKEY_CAP);
      dv_phase(DV_PH_REC + 4);  // pass 2
    }
  }
  // pass 2 (logprobs): sum of exp(x - max) in float64
  double se = 0.0;
  if (want_lp && !has_nan && argmax_isfinite(m)) {
    dv_row_each<Tag>(row, ncols, [&](float x, unsigned) {
      if (x != dv_neg_inf()) se = dv_dadd(se, dv_exp(dv_dadd((double)x, -(double)m)));
    });
    se = dv_block_sum(rs.red, se);
  }
  dv_phase(DV_PH_REC + 5);
  float best_score = dv_neg_inf(), best_val = dv_neg_inf();
  unsigned best_id = DV_NO_ID;
  if (mode == DV_TEMP && !has_nan && max_id != DV_NO_ID) {
#if DV_TEMP_ONEPASS > 0
    if (kOnePass && argmax_isfinite(m)) {  // (the same on every thread) the one read's best
      best_score = t_score;
      best_id = t_id;
      best_val = t_val;
      dv_block_best(rs.red, best_score, best_id, best_val);
    } else {  // a maximum of +inf or every column -inf: the row is read again
      dv_row_temp<Tag>(row, ncols, col0, p, d, m, my_m, my_id, best_score, best_id, best_val,
                       rs, q);
    }
#else
    dv_row_temp<Tag>(row, ncols, col0, p, d, m, my_m, my_id, best_score, best_id, best_val, rs,
                     q);
#endif
  } else if constexpr (kList) {
    if (list_len > 0) {  // the first list_len columns in key order: a radix select
      const unsigned n = ls->k.n_cand;
      if (gathered && n <= blockDim.x)
        dv_select_few(*ls, n, list_len, kcap, rec);
      else if (gathered)
        dv_select(DvCandSource{ls, n}, list_len, 0, 0u, 0u, list_len, 0u, kcap, rec, *ls);
      else
        dv_select(DvRowSource<Tag>{row, ncols, col0}, list_len, 0, 0u, 0u, list_len, 0u, kcap,
                  rec, *ls);
    }
  }
  dv_phase(DV_PH_REC + 6);  // the temperature pass or the list
  if (t == 0) {
    rec[DV_W_FLAGS] = has_nan ? 1u : 0u;
    rec[DV_W_NAN_ID] = nan_id;
    rec[DV_W_MAX_ID] = max_id;
    rec[DV_W_MAX_VAL] = argmax_f2u(m);
    const dv_u64 sb = dv_d2u(se);
    rec[DV_W_SUMEXP] = (unsigned)(sb & 0xFFFFFFFFull);
    rec[DV_W_SUMEXP + 1] = (unsigned)(sb >> 32);
    rec[DV_W_BEST_ID] = best_id;
    rec[DV_W_BEST_SCORE] = argmax_f2u(best_score);
    rec[DV_W_BEST_VAL] = argmax_f2u(best_val);
    rec[DV_W_LIST_LEN] = list_len;
    rec[DV_W_CAND] = cand;
    rec[DV_W_DIGEST] = digest;
  }
  __syncthreads();
  dv_phase(DV_PH_REC + 7);
}

// -- the owner's combine of one request ----------------------------------------------
// The merge holds every source's list in shared memory: tp * kcap <= DV_MERGE_MAX
// entries, and a request has at most DV_MAX_N rows (the host checks both).
#define DV_MERGE_MAX (8 * DV_TOPK_MAX)
#define DV_MERGE_ILP 8  // other sources' lists one merge entry searches at once
#define DV_TK_SLOTS 4   // top-k rows a request's combine merges at once ...
#define DV_TK_POOL 1600  // ... while their lists fit this many entries (one always does)
#define DV_MAX_N 64
#define DV_FILL_ILP 7  // pool entries a thread loads at once (DV_TK_POOL / DV_BLOCK, up)
#define DV_HDR_WORDS 2048  // staged record headers: at least 2 rows of DV_MAX_TP sources
struct DvCombineShared {
  unsigned hdr[DV_HDR_WORDS];  // the next rows' record headers (row, then source)
  // the top-k merge of up to DV_TK_SLOTS rows at once: every source's list of each slot's
  // row, slot after slot, source after source, in one pool
  unsigned mid[DV_TK_POOL];
  float mval[DV_TK_POOL];
  unsigned off[DV_TK_SLOTS][DV_MAX_TP + 1];  // slot g's source s: pool entries off[g][s]..
  unsigned slot_base[DV_TK_SLOTS + 1];       // slot g's entries: slot_base[g]..[g + 1]
  unsigned slot_rr[DV_TK_SLOTS];             // its row (of the staged headers)
  unsigned n_slots, rr_next;
  dv_u64 slot_key[DV_TK_SLOTS];
  float m_val[DV_TK_SLOTS][DV_TOPK_MAX];  // each slot's merged first k: raw logits, ids,
  unsigned m_id[DV_TK_SLOTS][DV_TOPK_MAX];  // scores, masses (z is recomputed)
  float m_score[DV_TK_SLOTS][DV_TOPK_MAX];
  double m_grp[DV_TK_SLOTS][DV_TOPK_MAX];
  dv_i64 m_a[DV_TK_SLOTS][DV_TOPK_MAX];
  dv_i64 m_before[DV_TK_SLOTS][DV_TOPK_MAX];  // top-p: the fixed-point mass before each entry
  dv_i64 mass_total[DV_TK_SLOTS];             // top-p: W, the first k's
  // the merge ranks only the entries up to each slot's cut (its key and id): source s of
  // slot g's prefix is pool entries off[g][s] .. + pre[g*tp + s + 1] - pre[g*tp + s],
  // pre the running count over (slot, source) pairs; pre_longest its longest prefix
  unsigned cut_key[DV_TK_SLOTS], cut_id[DV_TK_SLOTS];
  unsigned pre[DV_TK_SLOTS * DV_MAX_TP + 1];
  unsigned pre_longest;
  unsigned row_total[DV_MAX_N];  // the entries of the row's lists (the top-k merge's rows)
  DvShared red;
  int tok[DV_MAX_N];
  float tok_val[DV_MAX_N];
  float lp[DV_MAX_N];
  float row_max[DV_MAX_N];       // the row's maximum over the sources (dv_better order)
  unsigned row_flags[DV_MAX_N];  // bit 0: a NaN; bit 1: the owners' top-k merge decides
  unsigned row_bad[DV_MAX_N];    // the row's first source with other parameters (or none)
  double lp_term[DV_WARPS][DV_MAX_TP];  // each warp's row: its sources' sum-exp terms
};


// The (slot, source) pair of ranked entry u: x with pre[x] <= u < pre[x + 1] (pre is the
// running count over the `pairs` pairs, pre[0] = 0; a bisection).
__device__ __forceinline__ unsigned dv_pair_of(const unsigned* pre, unsigned pairs,
                                               unsigned u) {
  unsigned x = 0, hi = pairs;
  while (hi - x > 1) {
    const unsigned mid = (x + hi) / 2;
    if (pre[mid] <= u)
      x = mid;
    else
      hi = mid;
  }
  return x;
}

// Combine the tp records of request `req` (rows req*N .. req*N+N-1; local request i,
// its records at recs + (s * rows_per_src + i*N + d) * rec_words) and write the
// request's predict[N], accept_index[N] (numbered aidx_base + d), accept_length and,
// with want_lp, logprobs[N]. Returns the first source whose digest or candidate
// differs from this rank's (DV_NO_ID: none), in the first row that has one. Every
// thread calls it. Rows are decided a warp each, the warps' rows at once (the sources
// over the lanes); the rows that the top-k merge decides then take the whole block, up
// to DV_TK_SLOTS of them at once.
__device__ unsigned dv_combine_request(const unsigned* recs, unsigned tp, unsigned rows_per_src,
                                       unsigned rec_words, unsigned kcap, unsigned i, unsigned n,
                                       const DvParams& p, const int* cand, unsigned digest,
                                       bool want_lp, int aidx_base, int* predict,
                                       int* accept_index, int* accept_length, float* logprobs,
                                       DvCombineShared& sh) {
  dv_phase(DV_PH_COMB + 0);
  const unsigned t = threadIdx.x, B = blockDim.x, lane = t & 31u;
  const unsigned W = dv_nwarps(), ww = dv_warp_width();
  const int mode = dv_mode(p);
  // rows whose headers fit in shared memory at once
  const unsigned per_row = tp * DV_HDR, fit = DV_HDR_WORDS / per_row;
  for (unsigned d0 = 0; d0 < n; d0 += fit) {
    const unsigned rows_now = n - d0 < fit ? n - d0 : fit;
    // the record headers of every source of these rows into shared memory at once (one
    // round of loads)
    for (unsigned e = t; e < rows_now * per_row; e += B) {
      const unsigned rr = e / per_row, s = (e - rr * per_row) / DV_HDR;
      const unsigned w = e - rr * per_row - s * DV_HDR;
      sh.hdr[e] = recs[((dv_u64)s * rows_per_src + i * n + d0 + rr) * rec_words + w];
    }
    __syncthreads();
    dv_phase(DV_PH_COMB + 1);  // headers staged
    // each warp decides its rows: lane l reads sources l, l + 32, ...
    for (unsigned rr = t >> 5; rr < rows_now; rr += W) {
      const unsigned d = d0 + rr;
      const unsigned* hdr = sh.hdr + rr * per_row;
      unsigned bad = DV_NO_ID, nan_id = DV_NO_ID, max_id = DV_NO_ID, bid = DV_NO_ID;
      bool has_nan = false;
      float mx = dv_neg_inf(), bs = dv_neg_inf(), bval = dv_neg_inf();
      unsigned list_total = 0;  // entries of the sources' lists (capped at kcap each)
      for (unsigned s = lane; s < tp; s += ww) {
        const unsigned* r = hdr + s * DV_HDR;
        list_total += r[DV_W_LIST_LEN] > kcap ? kcap : r[DV_W_LIST_LEN];
        if ((r[DV_W_DIGEST] != digest || r[DV_W_CAND] != (unsigned)cand[d]) && s < bad) bad = s;
        if (r[DV_W_FLAGS] & 1u) {
          has_nan = true;
          if (r[DV_W_NAN_ID] < nan_id) nan_id = r[DV_W_NAN_ID];
        }
        const float v = argmax_u2f(r[DV_W_MAX_VAL]);
        if (dv_better(v, r[DV_W_MAX_ID], mx, max_id)) {
          mx = v;
          max_id = r[DV_W_MAX_ID];
        }
        const float sc = argmax_u2f(r[DV_W_BEST_SCORE]);
        if (dv_better(sc, r[DV_W_BEST_ID], bs, bid)) {
          bs = sc;
          bid = r[DV_W_BEST_ID];
          bval = argmax_u2f(r[DV_W_BEST_VAL]);
        }
      }
      // the warp's reductions (each a total order: the result is the serial loop's)
      for (unsigned o = ww / 2; o > 0; o >>= 1) {
        const unsigned ob = __shfl_xor_sync(DV_FULL, bad, (int)o);
        const unsigned on = __shfl_xor_sync(DV_FULL, nan_id, (int)o);
        const bool oh = __shfl_xor_sync(DV_FULL, has_nan ? 1u : 0u, (int)o) != 0u;
        const float omx = __shfl_xor_sync(DV_FULL, mx, (int)o);
        const unsigned omi = __shfl_xor_sync(DV_FULL, max_id, (int)o);
        const float obs = __shfl_xor_sync(DV_FULL, bs, (int)o);
        const unsigned obi = __shfl_xor_sync(DV_FULL, bid, (int)o);
        const float obv = __shfl_xor_sync(DV_FULL, bval, (int)o);
        list_total += __shfl_xor_sync(DV_FULL, list_total, (int)o);
        bad = ob < bad ? ob : bad;
        nan_id = on < nan_id ? on : nan_id;
        has_nan = has_nan || oh;
        if (dv_better(omx, omi, mx, max_id)) {
          mx = omx;
          max_id = omi;
        }
        if (dv_better(obs, obi, bs, bid)) {
          bs = obs;
          bid = obi;
          bval = obv;
        }
      }
      if (lane == 0) {
        int tok = has_nan ? (int)nan_id : (int)max_id;
        float tok_val = has_nan ? dv_nan() : mx;
        unsigned flags = has_nan ? 1u : 0u;
        if (bad == DV_NO_ID && !has_nan && mode != DV_GREEDY &&
            argmax_isfinite(dv_fdiv(mx, p.temperature))) {
          if (mode == DV_TEMP) {
            tok = (int)bid;
            if (bid != DV_NO_ID) tok_val = bval;
          } else if (mode == DV_TOPK) {
            flags |= 2u;
          }
        }
        sh.tok[d] = tok;
        sh.tok_val[d] = tok_val;
        sh.row_max[d] = mx;
        sh.row_flags[d] = flags;
        sh.row_bad[d] = bad;
        sh.row_total[d] = list_total;
      }
    }
    __syncthreads();
    dv_phase(DV_PH_COMB + 2);  // rows decided
    // the rows the top-k merge decides, DV_TK_SLOTS at a time (as many as the entry pool
    // holds), each step over every slot's entries at once: the rows' long chains of
    // loads and noise overlap instead of running one row after another
    for (unsigned rr_next = 0;;) {
      if (t == 0) {  // the next top-k rows whose lists fit the pool together
        unsigned ns = 0, used = 0;
        for (; rr_next < rows_now && ns < DV_TK_SLOTS; ++rr_next) {
          const unsigned d = d0 + rr_next;
          if (!(sh.row_flags[d] & 2u)) continue;
          if (ns > 0 && used + sh.row_total[d] > DV_TK_POOL) break;  // the next round's
          sh.slot_rr[ns] = rr_next;
          sh.slot_base[ns] = used;
          used += sh.row_total[d];
          ++ns;
        }
        sh.slot_base[ns] = used;
        sh.n_slots = ns;
        sh.rr_next = rr_next;
      }
      __syncthreads();
      const unsigned ns = sh.n_slots;
      rr_next = sh.rr_next;
      if (ns == 0) break;  // (uniform over the block)
      dv_phase(DV_PH_COMB + 3);
      // slot g's stream key and each source's offset in the pool (a thread per slot)
      for (unsigned g = t; g < ns; g += B) {
        const unsigned rr = sh.slot_rr[g];
        const unsigned* hdr = sh.hdr + rr * per_row;
        sh.slot_key[g] = dv_stream_key(p, d0 + rr);
        unsigned at = sh.slot_base[g];
        for (unsigned s = 0; s < tp; ++s) {
          sh.off[g][s] = at;
          unsigned len = hdr[s * DV_HDR + DV_W_LIST_LEN];
          at += len > kcap ? kcap : len;
        }
        sh.off[g][tp] = at;
        sh.mass_total[g] = 0;
      }
      __syncthreads();
      dv_phase(DV_PH_COMB + 4);
      // every slot's lists into the pool (values and ids; the order key is the value's),
      // DV_FILL_ILP entries a thread at once: each entry's slot and source by branchless
      // searches of fixed steps over the pool offsets, then all their loads in flight
      // together (was one entry after another, each behind two linear searches)
      const unsigned all = sh.slot_base[ns];
      unsigned src_step = 1;  // the largest power of 2 <= tp
      while (src_step * 2u <= tp) src_step *= 2u;
      for (unsigned e0 = 0; e0 < all; e0 += DV_FILL_ILP * B) {
        dv_u64 at[DV_FILL_ILP];
        unsigned wv[DV_FILL_ILP], wi[DV_FILL_ILP];
#pragma unroll
        for (unsigned q = 0; q < DV_FILL_ILP; ++q) {
          const unsigned e = e0 + q * B + t;
          unsigned g = 0;  // the last slot whose base is <= e (bases never decrease)
#pragma unroll
          for (unsigned h = 1; h < DV_TK_SLOTS; ++h) g += (h < ns) & (sh.slot_base[h] <= e);
          unsigned s = 0;  // the last source whose offset is <= e: its list holds e
          for (unsigned step = src_step; step > 0; step >>= 1)
            s = s + step < tp && sh.off[g][s + step] <= e ? s + step : s;
          const unsigned row = i * n + d0 + sh.slot_rr[g];
          at[q] = ((dv_u64)s * rows_per_src + row) * rec_words + DV_HDR + (e - sh.off[g][s]);
        }
#pragma unroll
        for (unsigned q = 0; q < DV_FILL_ILP; ++q) {
          if (e0 + q * B + t < all) {
            wv[q] = recs[at[q]];
            wi[q] = recs[at[q] + kcap];
          }
        }
#pragma unroll
        for (unsigned q = 0; q < DV_FILL_ILP; ++q) {
          const unsigned e = e0 + q * B + t;
          if (e < all) {
            sh.mval[e] = argmax_u2f(wv[q]);
            sh.mid[e] = wi[q];
          }
        }
      }
      __syncthreads();
      dv_phase(DV_PH_COMB + 5);  // pool filled
      // each slot's cut: with c the fewest first entries per list whose union holds the
      // slot's k_g (its first k) entries, the last of those entries in the order (key
      // desc, id asc). At least k_g entries are at or before the cut, so no entry after it
      // is among the first k_g: only the lists' prefixes up to the cut are ranked (a
      // thread per slot; c by bisection)
      for (unsigned g = t; g < ns; g += B) {
        const unsigned tot = sh.slot_base[g + 1] - sh.slot_base[g];
        const unsigned kg = (unsigned)p.top_k < tot ? (unsigned)p.top_k : tot;
        unsigned longest = 0;
        for (unsigned s = 0; s < tp; ++s) {
          const unsigned l = sh.off[g][s + 1] - sh.off[g][s];
          longest = l > longest ? l : longest;
        }
        unsigned lo = 0, hi = longest;  // the union of the first lo holds < kg, of hi >= kg
        while (hi - lo > 1) {
          const unsigned c = (lo + hi) / 2;
          unsigned got = 0;
          for (unsigned s = 0; s < tp; ++s) {
            const unsigned l = sh.off[g][s + 1] - sh.off[g][s];
            got += l < c ? l : c;
          }
          if (got >= kg)
            hi = c;
          else
            lo = c;
        }
        unsigned ck = 0xFFFFFFFFu, ci = 0u;  // (an empty slot: no entry is ranked)
        bool any = false;
        for (unsigned s = 0; s < tp; ++s) {
          const unsigned l = sh.off[g][s + 1] - sh.off[g][s];
          if (l == 0) continue;
          const unsigned at = sh.off[g][s] + (l < hi ? l : hi) - 1u;
          const unsigned ka = dv_order_key(sh.mval[at]), ia = sh.mid[at];
          if (!any || ka < ck || (ka == ck && ia > ci)) {
            ck = ka;
            ci = ia;
            any = true;
          }
        }
        sh.cut_key[g] = ck;
        sh.cut_id[g] = any ? ci : 0u;
      }
      __syncthreads();
      dv_phase(DV_PH_COMB + 6);  // cuts
      // each list's prefix up to its slot's cut (the list is in the order: a bisection)
      for (unsigned x = t; x < ns * tp; x += B) {
        const unsigned g = x / tp, s = x - g * tp;
        const unsigned a = sh.off[g][s], ck = sh.cut_key[g], ci = sh.cut_id[g];
        unsigned lo = 0, hi = sh.off[g][s + 1] - a;  // entries at or before the cut: lo
        while (lo < hi) {
          const unsigned mid = (lo + hi) / 2;
          const unsigned ka = dv_order_key(sh.mval[a + mid]), ia = sh.mid[a + mid];
          if (ka > ck || (ka == ck && ia <= ci))
            lo = mid + 1;
          else
            hi = mid;
        }
        sh.pre[x + 1] = lo;
      }
      __syncthreads();
      dv_phase(DV_PH_COMB + 7);  // prefixes
      if (t < 32) {  // warp 0: the running count over the pairs, and the longest prefix
        const unsigned pairs = ns * tp;
        unsigned carry = 0, mx = 0;
        for (unsigned b0 = 0; b0 < pairs; b0 += ww) {
          const unsigned x = b0 + lane;
          unsigned v = x < pairs ? sh.pre[x + 1] : 0u;
          mx = v > mx ? v : mx;
          for (unsigned o = 1; o < ww; o <<= 1) {
            const unsigned y = __shfl_sync(DV_FULL, v, (int)(lane >= o ? lane - o : lane));
            if (lane >= o) v += y;
          }
          if (x < pairs) sh.pre[x + 1] = carry + v;
          carry += __shfl_sync(DV_FULL, v, (int)(ww - 1u));
        }
        for (unsigned o = ww / 2; o > 0; o >>= 1) {
          const unsigned y = __shfl_xor_sync(DV_FULL, mx, (int)o);
          mx = y > mx ? y : mx;
        }
        if (t == 0) {
          sh.pre[0] = 0;
          sh.pre_longest = mx;
        }
      }
      __syncthreads();
      dv_phase(DV_PH_COMB + 8);
      // each ranked entry's rank in its row's merge: its place in its own list plus the
      // entries of every other source before it (key desc, id asc), which lie in that
      // source's prefix: counted by a branchless search of fixed steps, DV_MERGE_ILP
      // sources at once (independent shared loads, every one made)
      unsigned top_step = 1;  // the largest power of 2 <= the longest prefix
      while (top_step * 2u <= sh.pre_longest) top_step *= 2u;
      const unsigned ranked = sh.pre[ns * tp];
      for (unsigned u = t; u < ranked; u += B) {
        const unsigned x = dv_pair_of(sh.pre, ns * tp, u);
        const unsigned g = x / tp, s = x - g * tp, j = u - sh.pre[x];
        const unsigned e = sh.off[g][s] + j;
        const float ve = sh.mval[e];
        const unsigned ke = dv_order_key(ve), ie = sh.mid[e];
        const unsigned k_g = (unsigned)p.top_k < sh.slot_base[g + 1] - sh.slot_base[g]
                                 ? (unsigned)p.top_k
                                 : sh.slot_base[g + 1] - sh.slot_base[g];
        unsigned rank = j;
        for (unsigned o0 = 0; o0 < tp; o0 += DV_MERGE_ILP) {
          unsigned base[DV_MERGE_ILP], len[DV_MERGE_ILP], cnt[DV_MERGE_ILP];
#pragma unroll
          for (unsigned q = 0; q < DV_MERGE_ILP; ++q) {
            const unsigned o = o0 + q;
            const bool other = o < tp && o != s;
            len[q] = other ? sh.pre[g * tp + o + 1] - sh.pre[g * tp + o] : 0u;
            // an empty prefix (or none) reads entry e, a pool entry, and never counts it
            base[q] = len[q] > 0 ? sh.off[g][o] : e;
            cnt[q] = 0u;
          }
          for (unsigned step = top_step; step > 0; step >>= 1) {
#pragma unroll
            for (unsigned q = 0; q < DV_MERGE_ILP; ++q) {
              const unsigned jj = cnt[q] + step;  // is entry jj - 1 of the list before e?
              const bool in = jj <= len[q];
              const unsigned at = base[q] + (in ? jj - 1u : 0u);
              const unsigned ka = dv_order_key(sh.mval[at]), ia = sh.mid[at];
              cnt[q] = in && (ka > ke || (ka == ke && ia < ie)) ? jj : cnt[q];
            }
          }
#pragma unroll
          for (unsigned q = 0; q < DV_MERGE_ILP; ++q) rank += cnt[q];
        }
        if (rank < k_g) {
          sh.m_val[g][rank] = ve;
          sh.m_id[g][rank] = ie;
        }
      }
      __syncthreads();
      dv_phase(DV_PH_COMB + 9);  // ranks
      // the first k of every slot: scaled logit, score, top-p mass term
      const float T = p.temperature;
      const bool use_p = p.top_p < 1.0f;
      const unsigned kk = (unsigned)p.top_k;
      for (unsigned x = t; x < ns * kk; x += B) {
        const unsigned g = x / kk, j = x - g * kk;
        if (j >= sh.slot_base[g + 1] - sh.slot_base[g]) continue;  // a row of fewer entries
        const float z = dv_fdiv(sh.m_val[g][j], T);
        sh.m_score[g][j] = dv_fadd(z, dv_noise(sh.slot_key[g], sh.m_id[g][j]));
        if (use_p) {
          if (argmax_isfinite(z)) {
            dv_mass_term(z, &sh.m_grp[g][j], &sh.m_a[g][j]);
          } else {
            sh.m_grp[g][j] = (double)dv_neg_inf();
            sh.m_a[g][j] = 0;
          }
        }
      }
      __syncthreads();
      dv_phase(DV_PH_COMB + 10);  // scores
      // top-p: each entry's fixed-point mass before it, every entry at once (entry j
      // sums the entries before it group by group, as layout's serial loop does; the
      // last one adds its own for the total W)
      if (use_p) {
        for (unsigned x = t; x < ns * kk; x += B) {
          const unsigned g = x / kk, j = x - g * kk;
          const unsigned k = kk < sh.slot_base[g + 1] - sh.slot_base[g]
                                 ? kk
                                 : sh.slot_base[g + 1] - sh.slot_base[g];
          if (j >= k) continue;
          const double top = sh.m_grp[g][0];
          dv_i64 P[7] = {0, 0, 0, 0, 0, 0, 0};
          for (unsigned m = 0; m < j; ++m) {
            const double dd = top - sh.m_grp[g][m];
            for (int q = 0; q < 7; ++q)
              if (dd == (double)q) P[q] += sh.m_a[g][m];
          }
          dv_i64 before = 0;
          for (int q = 0; q < 7; ++q) before += P[q] >> (8 * q);
          sh.m_before[g][j] = before;
          if (j + 1 == k) {
            const double dd = top - sh.m_grp[g][j];
            for (int q = 0; q < 7; ++q)
              if (dd == (double)q) P[q] += sh.m_a[g][j];
            dv_i64 W = 0;
            for (int q = 0; q < 7; ++q) W += P[q] >> (8 * q);
            sh.mass_total[g] = W;
          }
        }
        __syncthreads();
        dv_phase(DV_PH_COMB + 11);  // top-p
      }
      // the best (score desc, id asc) kept entry of each slot: a warp each (the order is
      // total, so any reduction order gives the serial loop's result)
      const bool use_m = p.min_p > 0.0f;
      for (unsigned g = t >> 5; g < ns; g += W) {
        const unsigned k = kk < sh.slot_base[g + 1] - sh.slot_base[g]
                               ? kk
                               : sh.slot_base[g + 1] - sh.slot_base[g];
        const dv_i64 thr = use_p ? dv_top_p_threshold(p.top_p, sh.mass_total[g]) : 0;
        const float thr_z =
            use_m && k > 0 ? dv_fadd(dv_fdiv(sh.m_val[g][0], T), dv_min_p_log(p.min_p)) : 0.0f;
        float bs = dv_neg_inf();
        unsigned bid = DV_NO_ID;
        float bval = dv_nan();
        for (unsigned j = lane; j < k; j += ww) {
          bool kept = !use_p || sh.m_before[g][j] < thr;
          if (use_m && !(dv_fdiv(sh.m_val[g][j], T) >= thr_z)) kept = false;
          if (kept && dv_better(sh.m_score[g][j], sh.m_id[g][j], bs, bid)) {
            bs = sh.m_score[g][j];
            bid = sh.m_id[g][j];
            bval = sh.m_val[g][j];
          }
        }
        dv_warp_best(bs, bid, bval);
        if (lane == 0) {
          const unsigned d = d0 + sh.slot_rr[g];
          sh.tok[d] = (int)bid;
          sh.tok_val[d] = bval;
        }
      }
      __syncthreads();
      dv_phase(DV_PH_COMB + 12);  // best kept entries
    }
    // the logprobs, now that the tokens' raw logits are known: a warp each row
    if (want_lp) {
      for (unsigned rr = t >> 5; rr < rows_now; rr += W) {
        const unsigned d = d0 + rr;
        const unsigned* hdr = sh.hdr + rr * per_row;
        const float mx = sh.row_max[d];
        const bool ok = !(sh.row_flags[d] & 1u) && argmax_isfinite(mx);
        // source s's term of sum(exp(x - max)) (lanes over the sources), then summed in
        // source order, as one thread would
        double* term = sh.lp_term[t >> 5];
        for (unsigned s = lane; s < tp; s += ww) {
          double x = 0.0;
          const unsigned* r = hdr + s * DV_HDR;
          const float ms = argmax_u2f(r[DV_W_MAX_VAL]);
          if (ok && argmax_isfinite(ms)) {
            const double se =
                dv_u2d((dv_u64)r[DV_W_SUMEXP] | ((dv_u64)r[DV_W_SUMEXP + 1] << 32));
            x = ms == mx ? se : dv_dmul(se, dv_exp(dv_dadd((double)ms, -(double)mx)));
          }
          term[s] = x;
        }
        __syncwarp();
        double S = 0.0;
        if (lane == 0)
          for (unsigned s = 0; s < tp; ++s) S = dv_dadd(S, term[s]);
        if (lane == 0) {
          sh.lp[d] = ok ? (float)dv_dadd(dv_dadd((double)sh.tok_val[d], -(double)mx), -dv_log(S))
                        : dv_nan();
        }
        __syncwarp();  // the warp's terms are read before its next row writes them
      }
    }
    __syncthreads();
    dv_phase(DV_PH_COMB + 13);
  }
  if (t == 0) {
    unsigned accepted = 0;
    while (accepted + 1 < n && cand[accepted + 1] == sh.tok[accepted]) ++accepted;
    for (unsigned d = 0; d < n; ++d) {
      predict[d] = sh.tok[d];
      accept_index[d] = d <= accepted ? aidx_base + (int)d : -1;
      if (want_lp) logprobs[d] = sh.lp[d];
    }
    *accept_length = (int)accepted + 1;
  }
  __syncthreads();
  unsigned bad = DV_NO_ID;  // the first row's first source with other parameters
  for (unsigned d = 0; d < n && bad == DV_NO_ID; ++d) bad = sh.row_bad[d];
  __syncthreads();  // every thread has read it before the next request writes it
  dv_phase(DV_PH_COMB + 14);
  return bad;
}

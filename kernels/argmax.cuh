// ipc_dpsample argmax device code: greedy verify without moving logits (issue 14).
//
// Every rank reduces its own vocabulary shard of a row to an ArgmaxPartial
// (max, first global index of the max, sum of exp(x - max)); the row's owner
// combines the tp partials with argmax_combine and turns the result into
// (token id, log-softmax value). Shared by the one-sided kernels (partials
// travel as LL packets) and kernels/argmax.cu (the NCCL backend's kernels).
//
// Semantics are those of ipc_dpsample.layout.reference_argmax_batch_vocab
// (torch.argmax + torch.log_softmax on the float32 row trimmed to vocab_limit):
//   * a NaN wins; among NaNs the first column wins;
//   * otherwise the largest value wins, equal values -> the smaller column, so a
//     tie across a shard boundary goes to the lower global column;
//   * an all -inf row gives column 0 (the first column that counts);
//   * logprob = -log(sum exp(x - max)) (the winner is the max), NaN when the max
//     is NaN or +inf or -inf (torch gives NaN for +inf and all -inf rows too).
//
// No toolkit headers: NVRTC (CuPy), nvcc and g++ (the CPU emulation in
// tests/test_argmax_kernels_cpu.py, which defines DP_ARGMAX_CPU_EMULATION plus
// __device__, __shared__, __syncthreads, __expf, threadIdx/blockDim) all build it.
#pragma once

#ifndef DP_ARGMAX_UNROLL
// 16-byte loads each thread issues before it reduces them (IPC_DPSAMPLE_ARGMAX_UNROLL).
// 2 measured fastest on an H200 (BENCHMARKS.md): fewer registers, more resident
// CTAs, and it is those that keep enough bytes in flight.
#define DP_ARGMAX_UNROLL 2
#endif

// "no column": loses every tie (idx is compared as unsigned).
#define DP_ARGMAX_NO_IDX 0xFFFFFFFFu

// One row's (or one shard of one row's) reduction state; idx is a GLOBAL column.
// A NaN partial has max = NaN and idx = its first NaN column (sumexp unused).
struct ArgmaxPartial {
  float max;
  unsigned int idx;
  float sumexp;
};
static_assert(sizeof(ArgmaxPartial) == 12, "ArgmaxPartial travels as 3 x 32-bit words");

// 16 bytes: one vector load per thread.
struct alignas(16) ArgmaxVec16 {
  unsigned int w[4];
};
static_assert(sizeof(ArgmaxVec16) == 16, "ArgmaxVec16 must be 16 bytes");

// -- bit casts and float helpers ------------------------------------------------
#ifdef DP_ARGMAX_CPU_EMULATION
union ArgmaxBits {
  float f;
  unsigned int u;
};
__device__ __forceinline__ unsigned int argmax_f2u(float f) {
  ArgmaxBits b;
  b.f = f;
  return b.u;
}
__device__ __forceinline__ float argmax_u2f(unsigned int u) {
  ArgmaxBits b;
  b.u = u;
  return b.f;
}
__device__ __forceinline__ float argmax_fmax(float a, float b) { return __builtin_fmaxf(a, b); }
__device__ __forceinline__ float argmax_log(float x) { return __builtin_logf(x); }
#else
__device__ __forceinline__ unsigned int argmax_f2u(float f) { return __float_as_uint(f); }
__device__ __forceinline__ float argmax_u2f(unsigned int u) { return __uint_as_float(u); }
__device__ __forceinline__ float argmax_fmax(float a, float b) { return fmaxf(a, b); }
// once per row: the accurate log (no header needed under nvcc or NVRTC)
__device__ __forceinline__ float argmax_log(float x) { return logf(x); }
#endif

// Bit tests, so they hold under --use_fast_math too.
__device__ __forceinline__ bool argmax_isnan(float x) {
  return (argmax_f2u(x) & 0x7FFFFFFFu) > 0x7F800000u;
}
__device__ __forceinline__ bool argmax_isfinite(float x) {
  return (argmax_f2u(x) & 0x7F800000u) != 0x7F800000u;
}
__device__ __forceinline__ float argmax_neg_inf() { return argmax_u2f(0xFF800000u); }
__device__ __forceinline__ float argmax_nan() { return argmax_u2f(0x7FC00000u); }

// -- element loads: one tag per logits dtype ------------------------------------
// Tag::Storage is what the row holds; Tag::to_float decodes one element.
struct ArgmaxBf16 {
  typedef unsigned short Storage;
  static constexpr int kCode = 1;  // ipc_dpsample.protocol.Dtype.BFLOAT16
  __device__ __forceinline__ static float to_float(unsigned short h) {
    return argmax_u2f(static_cast<unsigned int>(h) << 16);
  }
};

struct ArgmaxF16 {
  typedef unsigned short Storage;
  static constexpr int kCode = 2;  // Dtype.FLOAT16
  __device__ __forceinline__ static float to_float(unsigned short h) {
#ifdef DP_ARGMAX_CPU_EMULATION
    // IEEE half -> float by hand: normals re-bias the exponent (15 -> 127),
    // subnormals are mant * 2^-24 (exact in float), inf/NaN keep their payload.
    const unsigned int sign = (static_cast<unsigned int>(h) & 0x8000u) << 16;
    const unsigned int exp = (static_cast<unsigned int>(h) >> 10) & 0x1Fu;
    const unsigned int mant = static_cast<unsigned int>(h) & 0x3FFu;
    if (exp == 0x1Fu) return argmax_u2f(sign | 0x7F800000u | (mant << 13));
    if (exp == 0u) {
      const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;  // 2^-24
      return sign ? -mag : mag;
    }
    return argmax_u2f(sign | ((exp + 112u) << 23) | (mant << 13));
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
  }
};

struct ArgmaxF32 {
  typedef float Storage;
  static constexpr int kCode = 3;  // Dtype.FLOAT32
  __device__ __forceinline__ static float to_float(float x) { return x; }
};

// Elements of one 16-byte vector, in column order (little-endian halves).
template <typename Tag>
struct ArgmaxUnpack;

template <>
struct ArgmaxUnpack<ArgmaxBf16> {
  static constexpr int kPerVec = 8;
  __device__ __forceinline__ static void run(const ArgmaxVec16& v, float* out) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      out[2 * k] = argmax_u2f(v.w[k] << 16);
      out[2 * k + 1] = argmax_u2f(v.w[k] & 0xFFFF0000u);
    }
  }
};

template <>
struct ArgmaxUnpack<ArgmaxF16> {
  static constexpr int kPerVec = 8;
  __device__ __forceinline__ static void run(const ArgmaxVec16& v, float* out) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      out[2 * k] = ArgmaxF16::to_float(static_cast<unsigned short>(v.w[k] & 0xFFFFu));
      out[2 * k + 1] = ArgmaxF16::to_float(static_cast<unsigned short>(v.w[k] >> 16));
    }
  }
};

template <>
struct ArgmaxUnpack<ArgmaxF32> {
  static constexpr int kPerVec = 4;
  __device__ __forceinline__ static void run(const ArgmaxVec16& v, float* out) {
#pragma unroll
    for (int k = 0; k < 4; ++k) out[k] = argmax_u2f(v.w[k]);
  }
};

// The CPU emulation may count every load (bytes read, misaligned vectors) through
// DP_ARGMAX_EMU_LOAD(ptr, bytes); nothing on the device.
#if defined(DP_ARGMAX_CPU_EMULATION) && defined(DP_ARGMAX_EMU_LOAD)
#define DP_ARGMAX_COUNT_LOAD(ptr, bytes) DP_ARGMAX_EMU_LOAD(ptr, bytes)
#else
#define DP_ARGMAX_COUNT_LOAD(ptr, bytes) ((void)0)
#endif

// Read-once data: the non-coherent path (the row is not written during the kernel).
__device__ __forceinline__ ArgmaxVec16 argmax_load16(const ArgmaxVec16* p) {
  DP_ARGMAX_COUNT_LOAD(p, 16);
#ifdef DP_ARGMAX_CPU_EMULATION
  return *p;
#else
  ArgmaxVec16 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
               : "l"(p));
  return v;
#endif
}

template <typename Tag>
__device__ __forceinline__ float argmax_load1(const typename Tag::Storage* p) {
  DP_ARGMAX_COUNT_LOAD(p, sizeof(*p));
  return Tag::to_float(*p);
}

// -- packing: 3 words [max bits, idx, sumexp bits] ----------------------------
__device__ __forceinline__ void argmax_pack(ArgmaxPartial p, unsigned int* w) {
  w[0] = argmax_f2u(p.max);
  w[1] = p.idx;
  w[2] = argmax_f2u(p.sumexp);
}

__device__ __forceinline__ ArgmaxPartial argmax_unpack(unsigned int w0, unsigned int w1,
                                                       unsigned int w2) {
  ArgmaxPartial p;
  p.max = argmax_u2f(w0);
  p.idx = w1;
  p.sumexp = argmax_u2f(w2);
  return p;
}

// The partial of no column at all: loses to everything, adds nothing.
__device__ __forceinline__ ArgmaxPartial argmax_empty() {
  ArgmaxPartial p;
  p.max = argmax_neg_inf();
  p.idx = DP_ARGMAX_NO_IDX;
  p.sumexp = 0.0f;
  return p;
}

// sumexp of p rescaled to the max m >= p.max: a -inf max (no column, or only -inf
// columns) contributes 0 (exp(-inf - -inf) would be NaN); p.max == m needs no exp
// (and keeps +inf == +inf from turning into NaN by itself).
__device__ __forceinline__ float argmax_rescaled(const ArgmaxPartial& p, float m) {
  if (p.max == argmax_neg_inf()) return 0.0f;
  if (p.max == m) return p.sumexp;
  return p.sumexp * __expf(p.max - m);
}

// Associative and commutative (up to float rounding of sumexp): NaN beats
// everything (the smaller idx among NaNs); else the larger max, equal max -> the
// smaller idx; the sums are rescaled to the winning max.
__device__ __forceinline__ ArgmaxPartial argmax_combine(ArgmaxPartial a, ArgmaxPartial b) {
  const bool a_nan = argmax_isnan(a.max);
  const bool b_nan = argmax_isnan(b.max);
  if (a_nan || b_nan) {
    if (a_nan && b_nan) return a.idx <= b.idx ? a : b;
    return a_nan ? a : b;
  }
  const bool a_wins = a.max > b.max || (a.max == b.max && a.idx <= b.idx);
  ArgmaxPartial r = a_wins ? a : b;
  r.sumexp = argmax_rescaled(a, r.max) + argmax_rescaled(b, r.max);
  return r;
}

// log_softmax at the argmax: the max's own term is exp(0) = 1, so it is
// -log(sumexp). NaN for a NaN, +inf or -inf max (torch's log_softmax gives NaN).
__device__ __forceinline__ float argmax_logprob(ArgmaxPartial p) {
  return argmax_isfinite(p.max) ? -argmax_log(p.sumexp) : argmax_nan();
}

// -- per-thread online reduction ----------------------------------------------
// Columns are local to the shard here; every thread visits its columns in
// increasing order, so a later equal value never replaces idx.
struct ArgmaxState {
  float m;        // running max (-inf before the first column)
  float s;        // sum of exp(x - m) over the non-NaN columns seen
  unsigned idx;   // first column holding m (NO_IDX before the first column)
  unsigned nan;   // first NaN column (NO_IDX: none seen)
};

__device__ __forceinline__ void argmax_state_init(ArgmaxState& st) {
  st.m = argmax_neg_inf();
  st.s = 0.0f;
  st.idx = DP_ARGMAX_NO_IDX;
  st.nan = DP_ARGMAX_NO_IDX;
}

// One element, every special value handled (the scalar head/tail and the rare
// vector chunks the fast path cannot take).
__device__ __forceinline__ void argmax_push(ArgmaxState& st, float x, unsigned col) {
  if (argmax_isnan(x)) {
    if (st.nan == DP_ARGMAX_NO_IDX) st.nan = col;
    return;
  }
  if (st.idx == DP_ARGMAX_NO_IDX) {  // first column: even -inf must claim idx
    st.m = x;
    st.idx = col;
    st.s = x == argmax_neg_inf() ? 0.0f : 1.0f;
  } else if (x > st.m) {  // new max: rescale (m = -inf -> the old sum is 0)
    st.s = (st.m == argmax_neg_inf() ? 0.0f : st.s * __expf(st.m - x)) + 1.0f;
    st.m = x;
    st.idx = col;
  } else if (x != argmax_neg_inf()) {  // -inf adds exp(-inf) = 0
    st.s += x == st.m ? 1.0f : __expf(x - st.m);
  }
}

// K elements in increasing columns col_of(j). Fast path: the sum of exp against
// the new max M is finite, which rules out NaN, +inf (inf - inf) and an all -inf
// state (-inf - -inf); the state then changes once. Otherwise element by element.
template <int K>
__device__ __forceinline__ void argmax_push_chunk(ArgmaxState& st, const float* v,
                                                  const unsigned* cols) {
  float cm = v[0];
#pragma unroll
  for (int j = 1; j < K; ++j) cm = argmax_fmax(cm, v[j]);
  const float m_new = argmax_fmax(st.m, cm);
  float cs = 0.0f;
#pragma unroll
  for (int j = 0; j < K; ++j) cs += __expf(v[j] - m_new);
  if (!argmax_isnan(cs)) {
    if (m_new > st.m) {  // rare after the first few chunks
      st.s = st.m == argmax_neg_inf() ? 0.0f : st.s * __expf(st.m - m_new);
      unsigned first = cols[K - 1];
#pragma unroll
      for (int j = K - 2; j >= 0; --j) first = v[j] == m_new ? cols[j] : first;
      st.m = m_new;
      st.idx = first;
    }
    st.s += cs;
  } else {
#pragma unroll
    for (int j = 0; j < K; ++j) argmax_push(st, v[j], cols[j]);
  }
}

// The partial of one thread's state, with global columns.
__device__ __forceinline__ ArgmaxPartial argmax_state_partial(const ArgmaxState& st,
                                                              unsigned col0) {
  ArgmaxPartial p;
  if (st.nan != DP_ARGMAX_NO_IDX) {
    p.max = argmax_nan();
    p.idx = st.nan + col0;
    p.sumexp = 0.0f;
  } else if (st.idx == DP_ARGMAX_NO_IDX) {
    p = argmax_empty();
  } else {
    p.max = st.m;
    p.idx = st.idx + col0;
    p.sumexp = st.s;
  }
  return p;
}

// Block-wide reduction of the local columns [0, limit_cols) of one row (limit_cols
// is clamped to ncols) into a partial with global columns (+ col0). Every thread
// of the block must call it (it synchronises); every thread gets the result.
// smem_f: 2 * blockDim.x floats, smem_u: blockDim.x unsigned, free on entry and
// on return. limit_cols == 0 gives argmax_empty(). The row is read once: a scalar
// head up to 16-byte alignment, 16-byte vectors (DP_ARGMAX_UNROLL in flight per
// thread, the last round predicated), a scalar tail; a row whose address is not
// even element-aligned is read with scalars only.
template <typename Tag>
__device__ __forceinline__ ArgmaxPartial argmax_row_partial(const typename Tag::Storage* row,
                                                            unsigned ncols, unsigned col0,
                                                            unsigned limit_cols, float* smem_f,
                                                            unsigned* smem_u) {
  typedef typename Tag::Storage S;
  constexpr int K = ArgmaxUnpack<Tag>::kPerVec;
  constexpr int U = DP_ARGMAX_UNROLL;
  const unsigned limit = limit_cols < ncols ? limit_cols : ncols;
  const unsigned t = threadIdx.x;
  const unsigned nt = blockDim.x;

  const unsigned long long addr = reinterpret_cast<unsigned long long>(row);
  unsigned head = limit;  // columns before the first 16-byte boundary
  if (addr % sizeof(S) == 0) {
    const unsigned to_boundary =
        static_cast<unsigned>(((16u - (addr & 15u)) & 15u) / sizeof(S));
    head = to_boundary < limit ? to_boundary : limit;
  }
  const unsigned nvec = (limit - head) / K;
  const unsigned body_end = head + nvec * K;
  const ArgmaxVec16* vecs = reinterpret_cast<const ArgmaxVec16*>(row + head);

  ArgmaxState st;
  argmax_state_init(st);
  // Per thread, columns only increase: head, then vectors t, t+nt, ..., then tail.
  for (unsigned c = t; c < head; c += nt) argmax_push(st, argmax_load1<Tag>(row + c), c);
  // Rounds of U vectors per thread, every load of a round issued before any is
  // used; the last round is partial (predicated loads), so a row costs
  // ceil(nvec / (U * nt)) memory latencies, not one more per leftover vector.
  for (unsigned v = t; v < nvec; v += U * nt) {
    ArgmaxVec16 raw[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (v + u * nt < nvec) raw[u] = argmax_load16(vecs + v + u * nt);
    if (v + (U - 1) * nt < nvec) {
      float x[U * K];
      unsigned cols[U * K];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        ArgmaxUnpack<Tag>::run(raw[u], x + u * K);
#pragma unroll
        for (int j = 0; j < K; ++j) cols[u * K + j] = head + (v + u * nt) * K + j;
      }
      argmax_push_chunk<U * K>(st, x, cols);
    } else {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (v + u * nt < nvec) {
          float x[K];
          unsigned cols[K];
          ArgmaxUnpack<Tag>::run(raw[u], x);
#pragma unroll
          for (int j = 0; j < K; ++j) cols[j] = head + (v + u * nt) * K + j;
          argmax_push_chunk<K>(st, x, cols);
        }
      }
    }
  }
  for (unsigned c = body_end + t; c < limit; c += nt)
    argmax_push(st, argmax_load1<Tag>(row + c), c);

  // Tree over shared memory for any blockDim: the upper half folds into the lower.
  ArgmaxPartial p = argmax_state_partial(st, col0);
  smem_f[t] = p.max;
  smem_f[nt + t] = p.sumexp;
  smem_u[t] = p.idx;
  __syncthreads();
  for (unsigned n = nt; n > 1;) {
    const unsigned half = (n + 1) / 2;
    if (t + half < n) {
      ArgmaxPartial a, b;
      a.max = smem_f[t];
      a.sumexp = smem_f[nt + t];
      a.idx = smem_u[t];
      b.max = smem_f[t + half];
      b.sumexp = smem_f[nt + t + half];
      b.idx = smem_u[t + half];
      a = argmax_combine(a, b);
      smem_f[t] = a.max;
      smem_f[nt + t] = a.sumexp;
      smem_u[t] = a.idx;
    }
    __syncthreads();
    n = half;
  }
  p.max = smem_f[0];
  p.sumexp = smem_f[nt];
  p.idx = smem_u[0];
  __syncthreads();  // smem is free again for the caller's next row
  return p;
}

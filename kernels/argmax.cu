// ipc_dpsample argmax kernels for the NCCL backend (it has no arena): greedy
// verify without moving logits (issue 14). The device code is in argmax.cuh,
// shared with the one-sided backend.
//
// Flow of argmax_batch_vocab on rank r (tp ranks, R = pad_bs / tp requests each,
// N rows per request, Vs = V / tp columns per shard):
//   1. dp_argmax_partials over the whole local input [pad_bs * N, Vs]: one
//      partial per row, 3 words each -> out_words[pad_bs * N][3].
//   2. NCCL all-to-all: rows [s * R * N, (s + 1) * R * N) of out_words (3 * R * N
//      contiguous words) go to rank s.
//   3. dp_argmax_combine over the tp received blocks (block s came from rank s):
//      token_ids int32 [R * N] and logprobs float32 [R * N].
//
// Partial words (u32, little-endian, one row = 3 consecutive words):
//   [0] max as float32 bits   (NaN when the shard's row holds a NaN)
//   [1] GLOBAL column of the first max (first NaN column for a NaN partial;
//       0xFFFFFFFF when no column of the shard counts: max = -inf, sumexp = 0)
//   [2] sum over the counted columns of exp(x - max) as float32 bits
//
// Real rows: requests [0, bs) are real, the rest are phantom padding. Row i of a
// launch belongs to request req0 + i / n; rows of requests >= bs are skipped and
// their outputs left untouched. bs = *(const int*)bs_ptr when bs_ptr != 0 (read
// on the device, so CUDA-graph replays see the current value), else bs_host.
//
// Entry points (every scalar argument 64-bit: CuPy passes Python ints as long
// long, pointers travel as unsigned long long):
//
//   dp_argmax_partials(u64 src, i64 rows, i64 ncols, i64 col0, i64 vocab_limit,
//                      i64 dtype_code, i64 n, i64 req0, u64 bs_ptr, i64 bs_host,
//                      u64 out_words)
//     src          [rows, ncols] logits shard, row-major, dtype_code
//                  (1 bfloat16, 2 float16, 3 float32 = ipc_dpsample.protocol.Dtype);
//                  any other code writes nothing (the host validates)
//     col0         global column of the shard's column 0 (rank * Vs)
//     vocab_limit  global columns >= vocab_limit never count (V for none); a
//                  shard entirely past it yields max=-inf, idx=0xFFFFFFFF, sumexp=0
//     out_words    u32 [rows][3]
//     launch       grid any (grid-stride over rows, one CTA per row; rows is a
//                  good grid), block <= DP_ARGMAX_MAX_THREADS (256 suits V/tp of
//                  tens of thousands), no dynamic shared memory
//
//   dp_argmax_combine(u64 partial_words, i64 tp, i64 rows, i64 stride_words,
//                     u64 out_ids, u64 out_logprobs, i64 n, i64 req0, u64 bs_ptr,
//                     i64 bs_host)
//     partial_words  u32; rank s's partial of row i at
//                    partial_words[s * stride_words + i * 3 .. + 2]
//                    (stride_words >= 3 * rows; 3 * rows when dense [tp][rows][3])
//     out_ids        int32 [rows]   the first maximal global column
//     out_logprobs   float32 [rows] log_softmax at it (NaN: NaN, +inf or all -inf)
//     n, req0        for rank r's own rows: n = N, req0 = r * R
//     launch         one thread per row, grid-stride: any grid and block
//
// No toolkit headers (see argmax.cuh).

#include "argmax.cuh"

typedef unsigned long long u64;
typedef long long i64;

#ifndef DP_ARGMAX_MAX_THREADS
#define DP_ARGMAX_MAX_THREADS 1024
#endif

// Rows [0, result) of a launch are real: requests req0 + i / n < bs.
__device__ __forceinline__ i64 argmax_real_rows(i64 rows, i64 n, i64 req0, u64 bs_ptr,
                                                i64 bs_host) {
  const i64 bs = bs_ptr != 0 ? static_cast<i64>(*reinterpret_cast<const int*>(bs_ptr)) : bs_host;
  const i64 reqs = bs - req0;
  if (reqs <= 0 || n <= 0) return 0;
  return reqs * n < rows ? reqs * n : rows;
}

template <typename Tag>
__device__ __forceinline__ void argmax_partials_rows(u64 src, i64 real_rows, i64 ncols,
                                                     i64 col0, i64 vocab_limit, u64 out_words,
                                                     float* smem_f, unsigned* smem_u) {
  typedef typename Tag::Storage S;
  i64 limit = vocab_limit - col0;
  limit = limit < 0 ? 0 : (limit > ncols ? ncols : limit);
  const S* base = reinterpret_cast<const S*>(src);
  unsigned* out = reinterpret_cast<unsigned*>(out_words);
  for (i64 row = blockIdx.x; row < real_rows; row += gridDim.x) {
    const ArgmaxPartial p = argmax_row_partial<Tag>(
        base + row * ncols, static_cast<unsigned>(ncols), static_cast<unsigned>(col0),
        static_cast<unsigned>(limit), smem_f, smem_u);
    if (threadIdx.x == 0) argmax_pack(p, out + row * 3);
  }
}

extern "C" __global__ void dp_argmax_partials(u64 src, i64 rows, i64 ncols, i64 col0,
                                              i64 vocab_limit, i64 dtype_code, i64 n, i64 req0,
                                              u64 bs_ptr, i64 bs_host, u64 out_words) {
  __shared__ float smem_f[2 * DP_ARGMAX_MAX_THREADS];
  __shared__ unsigned smem_u[DP_ARGMAX_MAX_THREADS];
  const i64 real_rows = argmax_real_rows(rows, n, req0, bs_ptr, bs_host);
  // dtype_code is uniform over the grid: one branch, no divergence
  if (dtype_code == ArgmaxBf16::kCode)
    argmax_partials_rows<ArgmaxBf16>(src, real_rows, ncols, col0, vocab_limit, out_words, smem_f,
                                     smem_u);
  else if (dtype_code == ArgmaxF16::kCode)
    argmax_partials_rows<ArgmaxF16>(src, real_rows, ncols, col0, vocab_limit, out_words, smem_f,
                                    smem_u);
  else if (dtype_code == ArgmaxF32::kCode)
    argmax_partials_rows<ArgmaxF32>(src, real_rows, ncols, col0, vocab_limit, out_words, smem_f,
                                    smem_u);
}

extern "C" __global__ void dp_argmax_combine(u64 partial_words, i64 tp, i64 rows, i64 stride_words,
                                             u64 out_ids, u64 out_logprobs, i64 n, i64 req0,
                                             u64 bs_ptr, i64 bs_host) {
  const i64 real_rows = argmax_real_rows(rows, n, req0, bs_ptr, bs_host);
  const unsigned* words = reinterpret_cast<const unsigned*>(partial_words);
  int* ids = reinterpret_cast<int*>(out_ids);
  float* logprobs = reinterpret_cast<float*>(out_logprobs);
  const i64 step = static_cast<i64>(gridDim.x) * blockDim.x;
  for (i64 i = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; i < real_rows; i += step) {
    // rank order: the same float sum on every run
    const unsigned* w = words + i * 3;
    ArgmaxPartial p = argmax_unpack(w[0], w[1], w[2]);
    for (i64 s = 1; s < tp; ++s) {
      w += stride_words;
      p = argmax_combine(p, argmax_unpack(w[0], w[1], w[2]));
    }
    // no column counted anywhere (vocab_limit 0, refused by the host): column 0
    ids[i] = p.idx == DP_ARGMAX_NO_IDX ? 0 : static_cast<int>(p.idx);
    logprobs[i] = argmax_logprob(p);
  }
}

// ipc_dpsample verify kernels without an arena: the records of a whole local input and
// the owner's combine, as two launches around any all-to-all that moves the records
// (rows [s*R*N, (s+1)*R*N) of the records to rank s). The device code is verify.cuh,
// shared with the one-sided backend (onesided.cu pushes the records into the owners'
// arenas instead). The CPU emulation (tests/test_verify_kernels_cpu.py) runs exactly
// these two kernels against ipc_dpsample.layout.reference_verify_batch_vocab.
//
// Entry points (every scalar argument 64-bit; the per-call values first):
//
//   dp_verify_records(u64 src, u64 cand, i64 kcap, i64 want_lp, i64 digest,
//                     u64 bs_ptr, i64 bs_host, u64 params, i64 rows, i64 ncols,
//                     i64 col0, i64 vocab_limit, i64 dtype_code, i64 n, u64 out_words)
//     src        [rows = pad_bs*N, ncols] logits shard (dtype_code 1 bf16, 2 fp16, 3 fp32)
//     cand       int32 [pad_bs, N] candidates (travel in the records: the owner compares)
//     kcap       list capacity (the call's largest top-k, 0..128); a record is
//                DV_HDR + 2*kcap words
//     params     DvParams [pad_bs]
//     out_words  u32 [rows][DV_HDR + 2*kcap]; rows of requests >= bs are not written
//     launch     block DV_BLOCK, any grid (grid-stride over rows)
//
//   dp_verify_combine(u64 cand, i64 kcap, i64 want_lp, i64 digest, u64 bs_ptr,
//                     i64 bs_host, u64 recs, u64 params, i64 tp, i64 reqs, i64 n,
//                     i64 req0, u64 predict, u64 accept_index, u64 accept_length,
//                     u64 logprobs, u64 err_word)
//     recs       u32 [tp][reqs*N][DV_HDR + 2*kcap]: source s's records of this rank's rows
//     reqs, req0 this rank's requests: [req0, req0 + reqs) of the padded batch
//     outputs    int32 predict/accept_index [reqs, N], accept_length [reqs], float32
//                logprobs [reqs, N] (want_lp); requests >= bs are not written
//     err_word   u32: 1 + the first source whose digest or candidate differs (0: none)
//     launch     block DV_BLOCK, any grid (grid-stride over requests)

#include "verify.cuh"

typedef unsigned long long u64;
typedef long long i64;

__device__ __forceinline__ i64 dv_bs(u64 bs_ptr, i64 bs_host) {
  return bs_ptr != 0 ? static_cast<i64>(*reinterpret_cast<const int*>(bs_ptr)) : bs_host;
}

template <typename Tag>
__device__ __forceinline__ void dv_records_rows(u64 src, const int* cand, unsigned kcap,
                                                bool want_lp, unsigned digest, i64 real_rows,
                                                const DvParams* prm, i64 ncols, i64 col0,
                                                i64 vocab_limit, i64 n, u64 out_words,
                                                DvRecordShared& sh) {
  typedef typename Tag::Storage S;
  i64 limit = vocab_limit - col0;
  limit = limit < 0 ? 0 : (limit > ncols ? ncols : limit);
  const unsigned rec_words = DV_HDR + 2 * kcap;
  for (i64 g = blockIdx.x; g < real_rows; g += gridDim.x) {
    const i64 req = g / n;
    const unsigned d = static_cast<unsigned>(g - req * n);
    unsigned* rec = reinterpret_cast<unsigned*>(out_words) + g * rec_words;
    dv_row_record<Tag>(reinterpret_cast<const S*>(src) + g * ncols, static_cast<unsigned>(limit),
                       static_cast<unsigned>(col0), prm[req], d, kcap, want_lp,
                       static_cast<unsigned>(cand[g]), digest, rec, sh);
  }
}

extern "C" __global__ void __launch_bounds__(DV_BLOCK)
    dp_verify_records(u64 src, u64 cand, i64 kcap, i64 want_lp, i64 digest, u64 bs_ptr,
                      i64 bs_host, u64 params, i64 rows, i64 ncols, i64 col0, i64 vocab_limit,
                      i64 dtype_code, i64 n, u64 out_words) {
  __shared__ DvRecordShared sh;
  i64 bs = dv_bs(bs_ptr, bs_host);
  if (bs < 0) bs = 0;
  const i64 real_rows = bs * n < rows ? bs * n : rows;
  const int* c = reinterpret_cast<const int*>(cand);
  const DvParams* prm = reinterpret_cast<const DvParams*>(params);
  const unsigned kc = static_cast<unsigned>(kcap), dg = static_cast<unsigned>(digest);
  if (dtype_code == ArgmaxBf16::kCode)
    dv_records_rows<ArgmaxBf16>(src, c, kc, want_lp != 0, dg, real_rows, prm, ncols, col0,
                                vocab_limit, n, out_words, sh);
  else if (dtype_code == ArgmaxF16::kCode)
    dv_records_rows<ArgmaxF16>(src, c, kc, want_lp != 0, dg, real_rows, prm, ncols, col0,
                               vocab_limit, n, out_words, sh);
  else if (dtype_code == ArgmaxF32::kCode)
    dv_records_rows<ArgmaxF32>(src, c, kc, want_lp != 0, dg, real_rows, prm, ncols, col0,
                               vocab_limit, n, out_words, sh);
}

extern "C" __global__ void __launch_bounds__(DV_BLOCK)
    dp_verify_combine(u64 cand, i64 kcap, i64 want_lp, i64 digest, u64 bs_ptr, i64 bs_host,
                      u64 recs, u64 params, i64 tp, i64 reqs, i64 n, i64 req0, u64 predict,
                      u64 accept_index, u64 accept_length, u64 logprobs, u64 err_word) {
  __shared__ DvCombineShared sh;
  const i64 bs = dv_bs(bs_ptr, bs_host);
  i64 real = bs - req0;
  real = real < 0 ? 0 : (real > reqs ? reqs : real);
  const unsigned rec_words = DV_HDR + 2 * static_cast<unsigned>(kcap);
  const DvParams* prm = reinterpret_cast<const DvParams*>(params);
  const int* c = reinterpret_cast<const int*>(cand);
  for (i64 i = blockIdx.x; i < real; i += gridDim.x) {
    const unsigned bad = dv_combine_request(
        reinterpret_cast<const unsigned*>(recs), static_cast<unsigned>(tp),
        static_cast<unsigned>(reqs * n), rec_words, static_cast<unsigned>(kcap),
        static_cast<unsigned>(i), static_cast<unsigned>(n), prm[req0 + i], c + (req0 + i) * n,
        static_cast<unsigned>(digest), want_lp != 0, static_cast<int>(i * n),
        reinterpret_cast<int*>(predict) + i * n, reinterpret_cast<int*>(accept_index) + i * n,
        reinterpret_cast<int*>(accept_length) + i, reinterpret_cast<float*>(logprobs) + i * n,
        sh);
    if (bad != DV_NO_ID && threadIdx.x == 0)
      atomicCAS(reinterpret_cast<unsigned*>(err_word), 0u, bad + 1u);
  }
}

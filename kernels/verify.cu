// ipc_dpsample verify kernels without an arena: the records of a whole local input and
// the owner's combine, as two launches around any all-to-all that moves the records
// (rows [s*R*N, (s+1)*R*N) of the records to rank s). The device code is verify.cuh,
// shared with the one-sided backend (onesided.cu pushes the records into the owners'
// arenas instead). The CPU emulation (tests/test_verify_kernels_cpu.py) runs exactly
// these two kernels against ipc_dpsample.layout.reference_verify_batch_vocab.
//
// Entry points (every scalar argument 64-bit; the per-call values first):
//
//   dp_verify_records(u64 src, u64 cand, u64 temperature, u64 top_k, u64 top_p,
//                     u64 min_p, u64 seed, u64 offset, i64 kcap, i64 want_lp,
//                     i64 digest, u64 bs_ptr, i64 bs_host, i64 rows, i64 ncols,
//                     i64 col0, i64 vocab_limit, i64 dtype_code, i64 n, u64 out_words,
//                     u64 err_value)
//     src        [rows = pad_bs*N, ncols] logits shard (dtype_code 1 bf16, 2 fp16, 3 fp32)
//     cand       int32 [pad_bs, N] candidates (travel in the records: the owner compares)
//     temperature .. offset  the caller's parameter arrays [pad_bs] (DvParamPtrs; top_k,
//                top_p, min_p may be 0: off), read when the kernel runs
//     kcap       list capacity (the call's largest top-k, 0..128); a record is
//                DV_HDR + 2*kcap words
//     digest     the call's digest (ipc_dpsample.backends.verify_plan.call_digest)
//     out_words  u32 [rows][DV_HDR + 2*kcap]; rows of requests >= bs are not written
//     err_value  u32: (DV_BAD_* << 24) | request of the first refused parameter (0: none)
//     launch     block DV_BLOCK, any grid (grid-stride over rows)
//
//   dp_verify_records_nolist(the same arguments)
//     the same records when kcap == 0 (no row has top-k), with the temperature queue's
//     ~21 KB of shared memory per CTA instead of the top-k kernel's ~33 KB
//
//   dp_verify_combine(u64 cand, u64 temperature, u64 top_k, u64 top_p, u64 min_p,
//                     u64 seed, u64 offset, i64 kcap, i64 want_lp, i64 digest,
//                     u64 bs_ptr, i64 bs_host, u64 recs, i64 tp, i64 reqs, i64 n,
//                     i64 req0, i64 vocab_limit, u64 predict, u64 accept_index,
//                     u64 accept_length, u64 logprobs, u64 err_word)
//     recs       u32 [tp][reqs*N][DV_HDR + 2*kcap]: source s's records of this rank's rows
//     reqs, req0 this rank's requests: [req0, req0 + reqs) of the padded batch
//     outputs    int32 predict/accept_index [reqs, N], accept_length [reqs], float32
//                logprobs [reqs, N] (want_lp); requests >= bs are not written
//     err_word   u32: 1 + the first source whose parameters or candidate differ (0: none)
//     launch     block DV_BLOCK, any grid (grid-stride over requests)

#include "verify.cuh"

typedef unsigned long long u64;
typedef long long i64;

__device__ __forceinline__ i64 dv_bs(u64 bs_ptr, i64 bs_host) {
  return bs_ptr != 0 ? static_cast<i64>(*reinterpret_cast<const int*>(bs_ptr)) : bs_host;
}

template <typename Tag, bool kList>
__device__ __forceinline__ void dv_records_rows(u64 src, const int* cand, const DvParamPtrs& q,
                                                unsigned kcap, bool want_lp, unsigned digest,
                                                i64 real_rows, i64 ncols, i64 col0,
                                                i64 vocab_limit, i64 n, u64 out_words,
                                                unsigned* err_value, DvRowShared& rs,
                                                DvQueue& qu, DvRecordShared* ls) {
  typedef typename Tag::Storage S;
  i64 limit = vocab_limit - col0;
  limit = limit < 0 ? 0 : (limit > ncols ? ncols : limit);
  const unsigned rec_words = DV_HDR + 2 * kcap;
  for (i64 g = blockIdx.x; g < real_rows; g += gridDim.x) {
    const i64 req = g / n;
    const unsigned d = static_cast<unsigned>(g - req * n);
    unsigned bad, bits, dg = digest;
    const DvParams p = dv_load_params(q, static_cast<unsigned>(req),
                                      static_cast<unsigned>(vocab_limit), &bad, &bits, &dg);
    if (bad && threadIdx.x == 0) atomicCAS(err_value, 0u, (bad << 24) | static_cast<unsigned>(req));
    unsigned* rec = reinterpret_cast<unsigned*>(out_words) + g * rec_words;
    dv_row_record<Tag, kList>(reinterpret_cast<const S*>(src) + g * ncols,
                              static_cast<unsigned>(limit), static_cast<unsigned>(col0), p, d,
                              kcap, want_lp, static_cast<unsigned>(cand[g]), dg, rec, rs, qu,
                              ls);
  }
}

template <bool kList>
__device__ __forceinline__ void dv_records(u64 src, u64 cand, u64 temperature, u64 top_k,
                                           u64 top_p, u64 min_p, u64 seed, u64 offset,
                                           i64 kcap, i64 want_lp, i64 digest, u64 bs_ptr,
                                           i64 bs_host, i64 rows, i64 ncols, i64 col0,
                                           i64 vocab_limit, i64 dtype_code, i64 n,
                                           u64 out_words, u64 err_value, DvRowShared& rs,
                                           DvQueue& qu, DvRecordShared* ls) {
  i64 bs = dv_bs(bs_ptr, bs_host);
  if (bs < 0) bs = 0;
  const i64 real_rows = bs * n < rows ? bs * n : rows;
  const int* c = reinterpret_cast<const int*>(cand);
  const DvParamPtrs q{temperature, top_k, top_p, min_p, seed, offset};
  const unsigned kc = static_cast<unsigned>(kcap), dg = static_cast<unsigned>(digest);
  unsigned* ev = reinterpret_cast<unsigned*>(err_value);
  if (dtype_code == ArgmaxBf16::kCode)
    dv_records_rows<ArgmaxBf16, kList>(src, c, q, kc, want_lp != 0, dg, real_rows, ncols, col0,
                                       vocab_limit, n, out_words, ev, rs, qu, ls);
  else if (dtype_code == ArgmaxF16::kCode)
    dv_records_rows<ArgmaxF16, kList>(src, c, q, kc, want_lp != 0, dg, real_rows, ncols, col0,
                                      vocab_limit, n, out_words, ev, rs, qu, ls);
  else if (dtype_code == ArgmaxF32::kCode)
    dv_records_rows<ArgmaxF32, kList>(src, c, q, kc, want_lp != 0, dg, real_rows, ncols, col0,
                                      vocab_limit, n, out_words, ev, rs, qu, ls);
}

extern "C" __global__ void __launch_bounds__(DV_BLOCK, DV_LIST_MIN_CTAS)
    dp_verify_records(u64 src, u64 cand, u64 temperature, u64 top_k, u64 top_p, u64 min_p,
                      u64 seed, u64 offset, i64 kcap, i64 want_lp, i64 digest, u64 bs_ptr,
                      i64 bs_host, i64 rows, i64 ncols, i64 col0, i64 vocab_limit,
                      i64 dtype_code, i64 n, u64 out_words, u64 err_value) {
  __shared__ DvRecordShared sh;
  dv_records<true>(src, cand, temperature, top_k, top_p, min_p, seed, offset, kcap, want_lp,
                   digest, bs_ptr, bs_host, rows, ncols, col0, vocab_limit, dtype_code, n,
                   out_words, err_value, sh.row, sh.q, &sh);
}

extern "C" __global__ void __launch_bounds__(DV_BLOCK, DV_NOLIST_MIN_CTAS)
    dp_verify_records_nolist(u64 src, u64 cand, u64 temperature, u64 top_k, u64 top_p,
                             u64 min_p, u64 seed, u64 offset, i64 kcap, i64 want_lp,
                             i64 digest, u64 bs_ptr, i64 bs_host, i64 rows, i64 ncols,
                             i64 col0, i64 vocab_limit, i64 dtype_code, i64 n, u64 out_words,
                             u64 err_value) {
  __shared__ DvRowQueueShared sh;
  dv_records<false>(src, cand, temperature, top_k, top_p, min_p, seed, offset, kcap, want_lp,
                    digest, bs_ptr, bs_host, rows, ncols, col0, vocab_limit, dtype_code, n,
                    out_words, err_value, sh.row, sh.q, nullptr);
}

extern "C" __global__ void __launch_bounds__(DV_BLOCK)
    dp_verify_combine(u64 cand, u64 temperature, u64 top_k, u64 top_p, u64 min_p, u64 seed,
                      u64 offset, i64 kcap, i64 want_lp, i64 digest, u64 bs_ptr, i64 bs_host,
                      u64 recs, i64 tp, i64 reqs, i64 n, i64 req0, i64 vocab_limit,
                      u64 predict, u64 accept_index, u64 accept_length, u64 logprobs,
                      u64 err_word) {
  __shared__ DvCombineShared sh;
  const i64 bs = dv_bs(bs_ptr, bs_host);
  i64 real = bs - req0;
  real = real < 0 ? 0 : (real > reqs ? reqs : real);
  const unsigned rec_words = DV_HDR + 2 * static_cast<unsigned>(kcap);
  const DvParamPtrs q{temperature, top_k, top_p, min_p, seed, offset};
  const int* c = reinterpret_cast<const int*>(cand);
  for (i64 i = blockIdx.x; i < real; i += gridDim.x) {
    unsigned bad, bits, dg = static_cast<unsigned>(digest);
    const DvParams p = dv_load_params(q, static_cast<unsigned>(req0 + i),
                                      static_cast<unsigned>(vocab_limit), &bad, &bits, &dg);
    const unsigned mismatch = dv_combine_request(
        reinterpret_cast<const unsigned*>(recs), static_cast<unsigned>(tp),
        static_cast<unsigned>(reqs * n), rec_words, static_cast<unsigned>(kcap),
        static_cast<unsigned>(i), static_cast<unsigned>(n), p, c + (req0 + i) * n, dg,
        want_lp != 0, static_cast<int>(i * n), reinterpret_cast<int*>(predict) + i * n,
        reinterpret_cast<int*>(accept_index) + i * n, reinterpret_cast<int*>(accept_length) + i,
        reinterpret_cast<float*>(logprobs) + i * n, sh);
    if (mismatch != DV_NO_ID && threadIdx.x == 0)
      atomicCAS(reinterpret_cast<unsigned*>(err_word), 0u, mismatch + 1u);
  }
}

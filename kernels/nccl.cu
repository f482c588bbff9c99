// ipc_dpsample NCCL-backend kernels: the local halves of the NCCL collectives.
//
// NCCL moves the bytes (grouped send/recv for swap_batch_vocab, argmax_batch_vocab
// and verify_batch_vocab, one allGather for the verify gathers); these kernels put
// them in place and check that every rank made the same call. Host half:
// ipc_dpsample/backends/nccl/. The reductions themselves are argmax.cu and verify.cu.
//
// No toolkit headers: NVRTC (CuPy RawModule) and nvcc (the CI compile check) both
// build this file anywhere. Every scalar argument is 64-bit (the host packs every
// argument as 8 bytes: pointers as unsigned long long, scalars as long long).
//
// Headers (ipc_dpsample/protocol.py, Call.header). Every op carries one 4-word
// int32 header per rank:
//   [tag, pad_bs, bs, seq]   tag = op | dtype << 8 (| graph << 16, never set here),
//                            bs  = real requests (host value, or the caller's device
//                                  int32 scalar read when the op runs),
//                            seq = ops this communicator completed before this one.
// The gathers pack their header in front of their payload (nccl_pack); the swap, the
// argmax and the verify send a 16-byte header message to every peer inside the same
// NCCL group as their data, written just before the group by nccl_header. The kernel
// that finishes an op (permute, unpack, finish, verify_finish) compares every rank's
// header with its own, records the first difference in the host-visible error block,
// and advances seq in device memory: no host value changes between calls, so
// CUDA-graph replays stay correct.
//
// verify_batch_vocab's arguments that the header does not carry (per-request
// parameters, candidates, vocab_limit, return_logprobs) are compared by the owners'
// combine (verify.cu: a digest and the candidate in every record), which sets an error
// word. nccl_verify_finish turns it into ERR_PARAMS in the error block (a parameter
// value the record kernel refused: ERR_VALUE) and flips SEQ_DIVERGED in this rank's
// seq, so the headers of the gathers that follow in the same call differ from every
// peer's: every rank that took part learns of it, not only the owners whose records
// differed.

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define HDR_WORDS 4
#define ERR_MISMATCH 1
#define ERR_PARAMS 2
#define ERR_VALUE 3
// Flipped in seq by a rank whose verify combine saw other arguments (records.py).
#define SEQ_DIVERGED 0x40000000

// Host-visible error block (mapped pinned memory); mirrored by
// ipc_dpsample/backends/nccl/records.py:ERROR_WORDS.
struct ErrorBlock {
  int code;       // 0 ok, ERR_MISMATCH, ERR_PARAMS, ERR_VALUE
  int op;         // op code of the rank that detected it
  int rank;       // the rank that detected it
  int peer;       // the first rank whose header (ERR_PARAMS: verify record) differed;
                  // ERR_VALUE: the request whose parameter the kernels refused
  int mine[4];    // the detecting rank's header
  int theirs[4];  // the peer's header
  int reserved[4];  // ERR_VALUE: [0] = the DV_BAD_* code (verify.cuh)
};
static_assert(sizeof(ErrorBlock) == 64, "ErrorBlock layout is shared with Python");

// 16-byte vector: one ld/st.global.v2.u64 per thread.
struct alignas(16) Vec16 {
  u64 lo;
  u64 hi;
};
static_assert(sizeof(Vec16) == 16, "Vec16 must be 16 bytes");

// bs of this call: the caller's device scalar when bs_ptr != 0, else the host value.
__device__ __forceinline__ int resolve_bs(i64 bs, u64 bs_ptr) {
  return bs_ptr != 0 ? *reinterpret_cast<const int*>(bs_ptr) : (int)bs;
}

// Real requests among rank `rank`'s `reqs` (layout.real_reqs): clamp(bs - rank*reqs, 0, reqs).
__device__ __forceinline__ i64 real_reqs(i64 reqs, i64 bs, i64 rank) {
  const i64 k = bs - rank * reqs;
  return k < 0 ? 0 : (k > reqs ? reqs : k);
}

// Compare every rank's header (rank s at hdrs + s * stride) with `mine`; record
// the first difference. Called by one thread.
__device__ void check_headers(const int* hdrs, i64 stride, i64 tp, i64 skip, const int* mine,
                              ErrorBlock* err, i64 rank) {
  volatile ErrorBlock* e = err;
  if (e->code != 0) return;  // keep the first error
  for (i64 s = 0; s < tp; ++s) {
    if (s == skip) continue;
    const int* h = hdrs + s * stride;
    if (h[0] != mine[0] || h[1] != mine[1] || h[2] != mine[2] || h[3] != mine[3]) {
      e->op = mine[0] & 0xff;
      e->rank = (int)rank;
      e->peer = (int)s;
      for (int w = 0; w < HDR_WORDS; ++w) {
        e->mine[w] = mine[w];
        e->theirs[w] = h[w];
      }
      __threadfence_system();
      e->code = ERR_MISMATCH;
      return;
    }
  }
}

// Before the NCCL group of a swap, argmax or verify: dst (int32[4]) = [tag, pad_bs, bs, seq].
// One thread. The per-call values (bs, bs_ptr) come first.
extern "C" __global__ void nccl_header(i64 bs, u64 bs_ptr, u64 dst, i64 tag, i64 pad_bs,
                                       u64 counter) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  int* d = reinterpret_cast<int*>(dst);
  d[0] = (int)tag;
  d[1] = (int)pad_bs;
  d[2] = resolve_bs(bs, bs_ptr);
  d[3] = *reinterpret_cast<const int*>(counter);
}

// After the NCCL group of an op whose data kernel is not ours (argmax): check the
// received headers (rank s at hdr_recv + 4 s, own slot `skip` unused) against
// my_hdr and advance seq. One thread.
extern "C" __global__ void nccl_finish(u64 hdr_recv, i64 tp, i64 skip, u64 my_hdr, u64 counter,
                                       u64 err, i64 rank) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  const int* mine = reinterpret_cast<const int*>(my_hdr);
  check_headers(reinterpret_cast<const int*>(hdr_recv), HDR_WORDS, tp, skip, mine,
                reinterpret_cast<ErrorBlock*>(err), rank);
  *reinterpret_cast<int*>(counter) = mine[3] + 1;
}

// After verify_batch_vocab's NCCL group and dp_verify_combine: nccl_finish's header
// check, then the verify kernels' two error words (u32, consumed here): err_words[0]
// from dp_verify_combine, 1 + the first source whose parameters or candidate differ
// from this rank's (-> ERR_PARAMS, peer = that source); err_words[1] from
// dp_verify_records, (DV_BAD_* << 24) | request of the first refused parameter value
// (-> ERR_VALUE, peer = the request, reserved[0] = the DV_BAD_* code). Either flips
// SEQ_DIVERGED in the advanced seq. An error already recorded is kept. One thread.
extern "C" __global__ void nccl_verify_finish(u64 hdr_recv, i64 tp, i64 skip, u64 my_hdr,
                                              u64 counter, u64 err, i64 rank, u64 err_words) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  const int* mine = reinterpret_cast<const int*>(my_hdr);
  check_headers(reinterpret_cast<const int*>(hdr_recv), HDR_WORDS, tp, skip, mine,
                reinterpret_cast<ErrorBlock*>(err), rank);
  unsigned* words = reinterpret_cast<unsigned*>(err_words);
  const unsigned mismatch = words[0], refused = words[1];
  int next = mine[3] + 1;
  if (mismatch != 0u || refused != 0u) {
    words[0] = 0u;
    words[1] = 0u;
    next ^= SEQ_DIVERGED;
    volatile ErrorBlock* e = reinterpret_cast<ErrorBlock*>(err);
    if (e->code == 0) {
      e->op = mine[0] & 0xff;
      e->rank = (int)rank;
      e->peer = mismatch != 0u ? (int)(mismatch - 1u) : (int)(refused & 0xFFFFFFu);
      e->reserved[0] = mismatch != 0u ? 0 : (int)(refused >> 24);
      for (int w = 0; w < HDR_WORDS; ++w) {
        e->mine[w] = mine[w];
        e->theirs[w] = mine[w];  // the headers agreed; the records did not
      }
      __threadfence_system();
      e->code = mismatch != 0u ? ERR_PARAMS : ERR_VALUE;
    }
  }
  *reinterpret_cast<int*>(counter) = next;
}

// swap_batch_vocab, local half: out[i, s * rowbytes : (s + 1) * rowbytes] = src_s[i, :]
// for the rows i < real_reqs(reqs, bs, rank) * n of this rank's real requests
// (bs from my_hdr[2], as nccl_header wrote it), where src_s is the own input
// (s == self_rank) or staging[s] (rows * rowbytes bytes per source). A "segment" is
// one (row i, source s) pair: rowbytes contiguous bytes in and out; 2^tps_log2
// threads copy one segment with V-sized vectors. Block 0 checks the headers and
// advances seq. The per-call value (self_src) comes first.
template <typename V>
__global__ void nccl_permute(u64 self_src, u64 out, u64 staging, i64 self_rank, i64 tp, i64 rows,
                             i64 rowbytes, i64 tps_log2, i64 reqs, i64 n, u64 hdr_recv,
                             u64 my_hdr, u64 counter, u64 err, i64 rank) {
  const int* mine = reinterpret_cast<const int*>(my_hdr);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    check_headers(reinterpret_cast<const int*>(hdr_recv), HDR_WORDS, tp, self_rank, mine,
                  reinterpret_cast<ErrorBlock*>(err), rank);
    *reinterpret_cast<int*>(counter) = mine[3] + 1;
  }
  const i64 real_rows = real_reqs(reqs, mine[2], rank) * n;
  const u8* st = reinterpret_cast<const u8*>(staging);
  const u8* own = reinterpret_cast<const u8*>(self_src);
  u8* o = reinterpret_cast<u8*>(out);
  const i64 vecs = rowbytes / (i64)sizeof(V);
  const i64 tps = (i64)1 << tps_log2;
  const i64 segs_per_block = (i64)blockDim.x >> tps_log2;
  const i64 lane = (i64)threadIdx.x & (tps - 1);
  const i64 nseg = real_rows * tp;
  const i64 step = (i64)gridDim.x * segs_per_block;
  for (i64 seg = (i64)blockIdx.x * segs_per_block + ((i64)threadIdx.x >> tps_log2); seg < nseg;
       seg += step) {
    const i64 i = seg / tp;
    const i64 s = seg - i * tp;
    const u8* src_bytes = s == self_rank ? own + i * rowbytes : st + (s * rows + i) * rowbytes;
    const V* src = reinterpret_cast<const V*>(src_bytes);
    V* dst = reinterpret_cast<V*>(o + seg * rowbytes);
    for (i64 k = lane; k < vecs; k += tps) dst[k] = src[k];
  }
}

// nvcc instantiates these for the compile check; NVRTC instantiates the host's
// name_expressions ("nccl_permute<Vec16>", ..., "nccl_permute<u8>").
template __global__ void nccl_permute<Vec16>(u64, u64, u64, i64, i64, i64, i64, i64, i64, i64,
                                             u64, u64, u64, u64, i64);
template __global__ void nccl_permute<u64>(u64, u64, u64, i64, i64, i64, i64, i64, i64, i64, u64,
                                           u64, u64, u64, i64);
template __global__ void nccl_permute<u32>(u64, u64, u64, i64, i64, i64, i64, i64, i64, i64, u64,
                                           u64, u64, u64, i64);
template __global__ void nccl_permute<u16>(u64, u64, u64, i64, i64, i64, i64, i64, i64, i64, u64,
                                           u64, u64, u64, i64);
template __global__ void nccl_permute<u8>(u64, u64, u64, i64, i64, i64, i64, i64, i64, i64, u64,
                                          u64, u64, u64, i64);

// Verify gathers, before the allGather: dst (this rank's slot, int32[width]) =
// [tag, pad_bs, bs, seq | src0[0:n0] | src1[0:n1] | src2[0:n2]] (4-byte words).
// The per-call values (the three sources, bs, bs_ptr) come first.
extern "C" __global__ void nccl_pack(u64 src0, u64 src1, u64 src2, i64 bs, u64 bs_ptr, u64 dst,
                                     i64 n0, i64 n1, i64 n2, i64 tag, i64 pad_bs, u64 counter) {
  int* d = reinterpret_cast<int*>(dst);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    d[0] = (int)tag;
    d[1] = (int)pad_bs;
    d[2] = resolve_bs(bs, bs_ptr);
    d[3] = *reinterpret_cast<const int*>(counter);
  }
  int* body = d + HDR_WORDS;
  const int* s0 = reinterpret_cast<const int*>(src0);
  const int* s1 = reinterpret_cast<const int*>(src1);
  const int* s2 = reinterpret_cast<const int*>(src2);
  const i64 total = n0 + n1 + n2;
  for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
       idx += (i64)gridDim.x * blockDim.x) {
    int v;
    if (idx < n0) {
      v = s0[idx];
    } else if (idx < n0 + n1) {
      v = s1[idx - n0];
    } else {
      v = s2[idx - n0 - n1];
    }
    body[idx] = v;
  }
}

// Verify gathers, after the allGather: recv is int32[tp][width], slot src laid out
// as nccl_pack wrote it; dst_k[src * n_k + j] = segment k of slot src. Block 0
// checks the headers and advances seq. Every row moves (phantom rows included:
// a few KB, and correct whatever bs is).
extern "C" __global__ void nccl_unpack(u64 recv, i64 width, i64 tp, i64 rank, u64 dst0, i64 n0,
                                       u64 dst1, i64 n1, u64 dst2, i64 n2, u64 counter, u64 err) {
  const int* r = reinterpret_cast<const int*>(recv);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    const int* mine = r + rank * width;
    check_headers(r, width, tp, -1, mine, reinterpret_cast<ErrorBlock*>(err), rank);
    *reinterpret_cast<int*>(counter) = mine[3] + 1;
  }
  int* d0 = reinterpret_cast<int*>(dst0);
  int* d1 = reinterpret_cast<int*>(dst1);
  int* d2 = reinterpret_cast<int*>(dst2);
  const i64 per = n0 + n1 + n2;
  const i64 total = tp * per;
  for (i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
       idx += (i64)gridDim.x * blockDim.x) {
    const i64 src = idx / per;
    const i64 j = idx - src * per;
    const int v = r[src * width + HDR_WORDS + j];
    if (j < n0) {
      d0[src * n0 + j] = v;
    } else if (j < n0 + n1) {
      d1[src * n1 + (j - n0)] = v;
    } else {
      d2[src * n2 + (j - n0 - n1)] = v;
    }
  }
}

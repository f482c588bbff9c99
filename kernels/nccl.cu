// ipc_dpsample NCCL-backend kernels: the local halves of the NCCL collectives.
//
// NCCL moves the bytes (grouped send/recv for swap_batch_vocab, one allGather for
// the verify gathers); these kernels put them in place and check that every rank
// made the same call. Host half: ipc_dpsample/backends/nccl.py.
//
// No toolkit headers: NVRTC (CuPy RawModule) and nvcc (the CI compile check) both
// build this file anywhere. Every scalar argument is 64-bit (CuPy passes Python
// ints as long long; pointers travel as unsigned long long).
//
// Headers. Every op carries one 4-word int32 header per rank:
//   [tag, pad_bs, N, seq]   tag = op | dtype_code << 8 (dtype_code 0 for gathers),
//                           seq = ops this communicator completed before this one.
// The gathers pack their header in front of their payload; the swap sends a
// 16-byte header message to every peer inside the same NCCL group as its data,
// taken from a device table of prebuilt swap headers (one per R = pad_bs / tp).
// The kernel that finishes an op (permute or unpack) compares every rank's header
// with its own, records the first difference in the host-visible error block, and
// advances seq (the device counter and the seq column of the swap-header table):
// no host value changes between calls, so CUDA-graph replays stay correct.

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

#define HDR_WORDS 4
#define ERR_MISMATCH 1

// Host-visible error block (mapped pinned memory); mirrored by
// ipc_dpsample/backends/nccl.py:ERROR_WORDS.
struct ErrorBlock {
  int code;       // 0 ok, ERR_MISMATCH
  int op;         // op code of the rank that detected it
  int rank;       // the rank that detected it
  int peer;       // the first rank whose header differed
  int mine[4];    // the detecting rank's header
  int theirs[4];  // the peer's header
  int reserved[4];
};
static_assert(sizeof(ErrorBlock) == 64, "ErrorBlock layout is shared with Python");

// 16-byte vector: one ld/st.global.v2.u64 per thread.
struct alignas(16) Vec16 {
  u64 lo;
  u64 hi;
};
static_assert(sizeof(Vec16) == 16, "Vec16 must be 16 bytes");

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

// Advance the op counter to `next` (block 0 only, every thread of it).
__device__ void advance_seq(int next, int* counter, int* hdr_table, i64 table_entries) {
  if (threadIdx.x == 0) *counter = next;
  for (i64 j = threadIdx.x; j < table_entries; j += blockDim.x) hdr_table[j * HDR_WORDS + 3] = next;
}

// swap_batch_vocab, local half: out[i, s * rowbytes : (s + 1) * rowbytes] = src_s[i, :]
// where src_s is the own input (s == self_rank) or staging[s]. A "segment" is one
// (row i, source s) pair: rowbytes contiguous bytes in and out; 2^tps_log2
// threads copy one segment with V-sized vectors.
template <typename V>
__device__ __forceinline__ void permute_body(u8* out, const u8* staging, const u8* self_src,
                                             i64 self_rank, i64 tp, i64 rows, i64 rowbytes,
                                             i64 tps_log2) {
  const i64 vecs = rowbytes / (i64)sizeof(V);
  const i64 tps = (i64)1 << tps_log2;
  const i64 segs_per_block = (i64)blockDim.x >> tps_log2;
  const i64 lane = (i64)threadIdx.x & (tps - 1);
  const i64 nseg = rows * tp;
  const i64 step = (i64)gridDim.x * segs_per_block;
  for (i64 seg = (i64)blockIdx.x * segs_per_block + ((i64)threadIdx.x >> tps_log2); seg < nseg;
       seg += step) {
    const i64 i = seg / tp;
    const i64 s = seg - i * tp;
    const u8* src_bytes = s == self_rank ? self_src + i * rowbytes : staging + (s * rows + i) * rowbytes;
    const V* src = reinterpret_cast<const V*>(src_bytes);
    V* dst = reinterpret_cast<V*>(out + seg * rowbytes);
    for (i64 k = lane; k < vecs; k += tps) dst[k] = src[k];
  }
}

template <typename V>
__device__ __forceinline__ void permute_kernel(u64 out, u64 staging, u64 self_src, i64 self_rank,
                                               i64 tp, i64 rows, i64 rowbytes, i64 tps_log2,
                                               u64 hdr_recv, u64 my_hdr, u64 hdr_table,
                                               i64 table_entries, u64 counter, u64 err, i64 rank) {
  if (blockIdx.x == 0) {
    const int* mine = reinterpret_cast<const int*>(my_hdr);
    const int next = mine[3] + 1;
    if (threadIdx.x == 0) {
      check_headers(reinterpret_cast<const int*>(hdr_recv), HDR_WORDS, tp, self_rank, mine,
                    reinterpret_cast<ErrorBlock*>(err), rank);
    }
    __syncthreads();  // `mine` is a row of hdr_table, rewritten below
    advance_seq(next, reinterpret_cast<int*>(counter), reinterpret_cast<int*>(hdr_table),
                table_entries);
  }
  permute_body<V>(reinterpret_cast<u8*>(out), reinterpret_cast<const u8*>(staging),
                  reinterpret_cast<const u8*>(self_src), self_rank, tp, rows, rowbytes, tps_log2);
}

// One entry point per vector width (bytes): 16, 8, 4, 2, 1. The host picks the
// widest width that divides rowbytes and every base address.
#define DEFINE_PERMUTE(NAME, V)                                                                 \
  extern "C" __global__ void NAME(u64 out, u64 staging, u64 self_src, i64 self_rank, i64 tp,    \
                                  i64 rows, i64 rowbytes, i64 tps_log2, u64 hdr_recv,           \
                                  u64 my_hdr, u64 hdr_table, i64 table_entries, u64 counter,    \
                                  u64 err, i64 rank) {                                          \
    permute_kernel<V>(out, staging, self_src, self_rank, tp, rows, rowbytes, tps_log2, hdr_recv, \
                      my_hdr, hdr_table, table_entries, counter, err, rank);                    \
  }

DEFINE_PERMUTE(nccl_permute_w16, Vec16)
DEFINE_PERMUTE(nccl_permute_w8, u64)
DEFINE_PERMUTE(nccl_permute_w4, u32)
DEFINE_PERMUTE(nccl_permute_w2, u16)
DEFINE_PERMUTE(nccl_permute_w1, u8)

// Verify gathers, before the allGather: dst (this rank's slot, int32[width]) =
// [tag, pad_bs, N, seq | src0[0:n0] | src1[0:n1] | src2[0:n2]] (4-byte words).
extern "C" __global__ void nccl_pack(u64 dst, u64 src0, i64 n0, u64 src1, i64 n1, u64 src2, i64 n2,
                                     i64 tag, i64 pad_bs, i64 n, u64 counter) {
  int* d = reinterpret_cast<int*>(dst);
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    d[0] = (int)tag;
    d[1] = (int)pad_bs;
    d[2] = (int)n;
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
// checks the headers and advances seq.
extern "C" __global__ void nccl_unpack(u64 recv, i64 width, i64 tp, i64 rank, u64 dst0, i64 n0,
                                       u64 dst1, i64 n1, u64 dst2, i64 n2, u64 hdr_table,
                                       i64 table_entries, u64 counter, u64 err) {
  const int* r = reinterpret_cast<const int*>(recv);
  if (blockIdx.x == 0) {
    const int* mine = r + rank * width;
    if (threadIdx.x == 0) {
      check_headers(r, width, tp, -1, mine, reinterpret_cast<ErrorBlock*>(err), rank);
    }
    advance_seq(mine[3] + 1, reinterpret_cast<int*>(counter), reinterpret_cast<int*>(hdr_table),
                table_entries);
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

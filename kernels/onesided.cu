// ipc_dpsample one-sided kernels: push data into peers' arenas through CUDA IPC
// mappings, signal with epoch-tagged flags, wait with the one bounded spin of
// dp_common.cuh. Host half: ipc_dpsample/backends/onesided/.
//
// Arena (offsets in DpDesc, computed by ArenaOffsets on the host):
//   ctrl   : u32 epoch, counter, broken ... ; u64 probe[tp]
//   flags  : u64 flags[2][tp]            one writer per word: flags[p][src]
//   ready  : u64 ready[2][tp]            graph-mode swap entry barrier, same scheme
//   ll     : u64 ll[2][tp][ll_slots]     LL packets (value | epoch << 32)
//   swap   : swap[2][R_max*N][V]         receive regions of swap_batch_vocab, then
//            one more [R_max*N][V]       fixed output (CUDA-graph mode)
//   outputs: persistent gather / argmax outputs (local only)
// Op e (epochs start at 1) uses region and flag parity e & 1.
//
// Argument order of every op kernel: the per-call values first (input pointers,
// bs_ptr, bs_host: rewritten per call by the host's PreparedLaunch), then the
// descriptor (by value: it lives in the kernel's parameter space), then the op's
// fixed arguments. Real rows: requests >= bs (read from the device int32 at bs_ptr
// when it is set, else bs_host) are neither read nor written; every rank still
// signals and waits, so ranks without a real request keep the protocol going.

#include "dp_common.cuh"
#include "argmax.cuh"
#include "verify.cuh"

// Block-wide copy of n bytes using the widest vector the relative alignment of
// dst and src allows: scalar head until dst is aligned, vector body, scalar tail.
// The body issues UNROLL loads per thread before any store (memory-level
// parallelism: a CTA copies a 32 KiB tile in one round trip), with the tail of
// the last round predicated instead of falling back to one load at a time.
#ifndef DP_SWAP_UNROLL
#define DP_SWAP_UNROLL 4  // vector loads in flight per thread (IPC_DPSAMPLE_SWAP_UNROLL)
#endif
#ifndef DP_SWAP_CTA_RELEASE_GPU
// IPC_DPSAMPLE_SWAP_CTA_FENCE (gpu = 1, sys = 0). 1: each CTA publishes its tiles
// with a gpu-scope acq_rel bump of the local counter and the last CTA alone fences at
// system scope before it signals the peers; 0: each CTA fences at system scope before
// a relaxed bump. Both order every CTA's stores before the flag a peer acquires
// (release and acquire compose across scopes in the PTX memory model; the peer only
// needs the last CTA's system-scope release).
#define DP_SWAP_CTA_RELEASE_GPU 1
#endif
#ifndef DP_SWAP_STREAMING
#define DP_SWAP_STREAMING 0  // 1: streaming cache hints on 16-byte moves (IPC_DPSAMPLE_SWAP_STREAMING)
#endif

template <typename V>
__device__ __forceinline__ V ld_vec(const V* p) { return *p; }
template <typename V>
__device__ __forceinline__ void st_vec(V* p, const V& v) { *p = v; }
#if DP_SWAP_STREAMING
// Reads through the non-coherent path without L1 allocation (L2 fetches 256-byte
// blocks), stores evict-first: every byte is touched once. The source is the
// caller's input, which no kernel writes while the swap runs.
template <>
__device__ __forceinline__ uint4 ld_vec<uint4>(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
template <>
__device__ __forceinline__ void st_vec<uint4>(uint4* p, const uint4& v) {
  asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}
#endif

template <typename V>
__device__ __forceinline__ void copy_block_vec(char* dst, const char* src, u64 n) {
  constexpr int UNROLL = DP_SWAP_UNROLL;
  const u64 A = sizeof(V);
  u64 head = (A - ((u64)dst & (A - 1))) & (A - 1);
  if (head > n) head = n;
  for (u64 i = threadIdx.x; i < head; i += blockDim.x) dst[i] = src[i];
  const u64 nv = (n - head) / A;
  V* dv = (V*)(dst + head);
  const V* sv = (const V*)(src + head);
  const u64 bd = blockDim.x;
  for (u64 i = threadIdx.x; i < nv; i += UNROLL * bd) {
    V r[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; ++k)
      if (i + k * bd < nv) r[k] = ld_vec<V>(sv + i + k * bd);
#pragma unroll
    for (int k = 0; k < UNROLL; ++k)
      if (i + k * bd < nv) st_vec<V>(dv + i + k * bd, r[k]);
  }
  for (u64 k = head + nv * A + threadIdx.x; k < n; k += bd) dst[k] = src[k];
}

__device__ __forceinline__ void copy_block(char* dst, const char* src, u64 n) {
  const u64 rel = ((u64)dst ^ (u64)src);
  if ((rel & 15) == 0) {
    copy_block_vec<uint4>(dst, src, n);
  } else if ((rel & 7) == 0) {
    copy_block_vec<uint2>(dst, src, n);
  } else if ((rel & 3) == 0) {
    copy_block_vec<unsigned int>(dst, src, n);
  } else if ((rel & 1) == 0) {
    copy_block_vec<unsigned short>(dst, src, n);
  } else {
    for (u64 k = threadIdx.x; k < n; k += blockDim.x) dst[k] = src[k];
  }
}

// The swap's data movement. Tiles are (real row, chunk) pairs over the bs*N real
// rows of the padded batch, dest-major (dest d owns rows [d*R*N, (d+1)*R*N)), so
// phantom rows cost nothing; the start is rotated by rank so ranks do not all
// target the same peer at once. I is the tile index type: 32-bit whenever the tile
// count fits (the per-tile index math is then a few instructions, not 64-bit
// divisions that stall the warp between its loads); byte offsets stay 64-bit.
template <typename I>
__device__ __forceinline__ void push_tiles(const DpDesc& d, u64 src_ptr, u64 region_off,
                                           u64 real_rows, u64 rows_per_dest, u64 shard_bytes,
                                           u64 chunks_per_row, u64 chunk_bytes) {
  const I cpr = (I)chunks_per_row;
  const I rows = (I)real_rows;
  const I rpd = (I)rows_per_dest;
  const I tiles = rows * cpr;
  if (tiles == 0) return;  // bs = 0: CTA 0 only signals (and `start` would divide by 0)
  const u64* peers = (const u64*)d.peers;
  const u64 row_bytes_out = shard_bytes * d.tp;
  const I start = (I)(((u64)(d.rank + 1) * rows_per_dest) % real_rows);
  for (I b = blockIdx.x; b < tiles; b += gridDim.x) {
    I g = b / cpr;
    const I chunk = b - g * cpr;
    g += start;
    if (g >= rows) g -= rows;
    const I dest = g / rpd;
    const I row = g - dest * rpd;
    const u64 c0 = (u64)chunk * chunk_bytes;
    u64 n = shard_bytes - c0;
    if (n > chunk_bytes) n = chunk_bytes;
    const char* s = (const char*)src_ptr + (u64)g * shard_bytes + c0;
    char* t = (char*)(peers[dest] + region_off) + (u64)row * row_bytes_out +
              (u64)d.rank * shard_bytes + c0;
    copy_block(t, s, n);
  }
}

// swap_batch_vocab: one launch. Every CTA moves its tiles, fences and bumps the
// local counter; the last CTA alone signals the peers (thread t -> peer t) and
// waits for them.
extern "C" __global__ void dp_swap_push(
    u64 src_ptr,  // local_logits [pad_bs*N, Vs] (shard_bytes per row)
    u64 bs_ptr, i64 bs_host, DpDesc d,
    i64 pad_bs,
    i64 shard_bytes,  // Vs * itemsize
    i64 chunks_per_row, i64 chunk_bytes,
    u64 sig,               // signature without bs
    u64 region_off,        // swap region 0, or the fixed output in graph mode
    u64 data_parity_mask)  // 1: ping-pong regions; 0: one region (graph mode's fixed
                           // output, where dp_swap_enter ran first; or the race test hook)
{
  u32* ctrl = dp_ctrl(d);
  const DpOpStart s = dp_op_start(d, bs_ptr, bs_host, pad_bs, sig);
  const u32 e = s.e, parity = s.parity, full_sig = s.sig;
  const u64 off = region_off + (u64)(parity & data_parity_mask) * d.swap_region_bytes;
  const u64 rows_per_dest = (u64)(pad_bs / d.tp) * d.n;
  const u64 real_rows = (u64)s.bs * d.n;
  // CTAs beyond the real tiles leave at once and are not counted: phantom rows cost
  // no fence or atomic. The host sizes the grid to the real tiles when bs is a host
  // int; a device bs keeps the pad_bs grid of the capture, whose extra CTAs cost
  // their launch and the one round trip of dp_op_start. CTA 0 always stays (with
  // bs = 0 it alone signals).
  const u32 active = dp_active_ctas(real_rows * (u64)chunks_per_row);
  if (s.broken || blockIdx.x >= active) return;

  if (real_rows * (u64)chunks_per_row <= 0xffffffffull)
    push_tiles<u32>(d, src_ptr, off, real_rows, rows_per_dest, shard_bytes, chunks_per_row,
                    chunk_bytes);
  else
    push_tiles<u64>(d, src_ptr, off, real_rows, rows_per_dest, shard_bytes, chunks_per_row,
                    chunk_bytes);

  __shared__ u32 last;
  __syncthreads();
  if (threadIdx.x == 0) {
#if DP_SWAP_CTA_RELEASE_GPU
    const u32 prev = atom_add_acq_rel_gpu(&ctrl[DP_CTRL_COUNTER], 1u);
#else
    fence_sys();
    const u32 prev = atomicAdd(&ctrl[DP_CTRL_COUNTER], 1u);
#endif
    last = (prev == active - 1) ? 1u : 0u;
  }
  __syncthreads();
  if (!last) return;

  fence_sys();  // every CTA's tiles (acquired above) before the flags, at system scope
  const u64 word = ((u64)e << 32) | full_sig;
  const u64* peers = (const u64*)d.peers;
  if (threadIdx.x < d.tp) {
    st_release_sys(dp_flag(d, peers[threadIdx.x], d.flags_off, parity, d.rank), word);
    dp_wait_flag(d, dp_flag(d, d.base, d.flags_off, parity, threadIdx.x), e, threadIdx.x,
                 full_sig);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    ctrl[DP_CTRL_COUNTER] = 0;
    ctrl[DP_CTRL_EPOCH] = e;
  }
}

// The other CUDA-graph mode of a swap (IPC_DPSAMPLE_GRAPH_SWAP=copy): the push
// wrote the ping-pong region of the op that just finished (its parity is only known
// on the device); copy its real rows into the fixed output a captured consumer
// reads. Moves the output's bytes once more; needs no barrier.
extern "C" __global__ void dp_swap_copy_out(u64 bs_ptr, i64 bs_host, DpDesc d, i64 pad_bs,
                                            i64 row_bytes, u64 data_parity_mask) {
  const DpOpStart s = dp_op_start(d, bs_ptr, bs_host, pad_bs, 0);
  if (s.broken) return;
  const u32 e = s.e - 1u;  // the push that just finished
  const u32 bs = s.bs;
  const u32 R = (u32)(pad_bs / d.tp);
  const u64 nbytes = (u64)dp_real_reqs(bs, d.rank, R) * d.n * (u64)row_bytes;
  const char* src = (const char*)(d.base + d.swap_off +
                                  (u64)(e & 1u & data_parity_mask) * d.swap_region_bytes);
  char* dst = (char*)(d.base + d.swap_fixed_off);
  const u64 step = ((nbytes + gridDim.x - 1) / gridDim.x + 15) & ~15ull;
  const u64 begin = step * blockIdx.x;
  if (begin >= nbytes) return;
  u64 n = nbytes - begin;
  if (n > step) n = step;
  copy_block(dst + begin, src + begin, n);
}

// Entry barrier of a swap in CUDA-graph mode, launched right before dp_swap_push
// on the same stream. There the swap writes one fixed output (a captured consumer
// reads one address), so a peer may only push op e into this rank's output once
// this rank has consumed op e-1's: reaching this kernel proves it (stream order).
// Thread t < tp stores ready[e&1][rank] = e << 32 | sig into peer t, then waits
// for peer t's word. One CTA: only it spins, so ranks sharing a GPU cannot starve
// each other of SMs. A peer already inside another op at epoch e (a gather signals
// flags[e&1] without a barrier) is a call-sequence mismatch, reported as such.
extern "C" __global__ void dp_swap_enter(u64 bs_ptr, i64 bs_host, DpDesc d, i64 pad_bs,
                                         u64 sig) {
  const DpOpStart s = dp_op_start(d, bs_ptr, bs_host, pad_bs, sig);
  const u32 e = s.e, parity = s.parity, full_sig = s.sig;
  const u32 t = threadIdx.x;
  if (s.broken || t >= d.tp) return;
  const u64* peers = (const u64*)d.peers;
  st_release_sys(dp_flag(d, peers[t], d.ready_off, parity, d.rank), ((u64)e << 32) | full_sig);
  dp_wait_flag(d, dp_flag(d, d.base, d.ready_off, parity, t), e, t, full_sig,
               dp_flag(d, d.base, d.flags_off, parity, t));
}

// Is value k of a gather payload a real row's? kind 0 payload: predict [R,N],
// accept_index [R,N], accept_length [R]; kind 1: logprobs [R,N]. `c` real requests.
__device__ __forceinline__ bool gather_value_real(i64 k, i64 RN, u32 n, u32 c) {
  if (k < RN) return k < (i64)c * n;
  if (k < 2 * RN) return k - RN < (i64)c * n;
  return k - 2 * RN < (i64)c;
}

// Gathers as LL packets: value | epoch << 32 in one 8-byte store, region parity
// e & 1, no barrier and no clearing pass. One CTA. Values of phantom requests are
// neither sent nor awaited nor written.
extern "C" __global__ void dp_gather_ll(u64 in0, u64 in1, u64 in2, u64 bs_ptr, i64 bs_host,
                                        DpDesc d, i64 pad_bs, i64 kind, u64 sig) {
  const DpOpStart s = dp_op_start(d, bs_ptr, bs_host, pad_bs, sig);
  if (s.broken) return;
  const u32 e = s.e, parity = s.parity, bs = s.bs, full_sig = s.sig;
  const u64 dparity = parity & d.parity_mask;
  const u64 tag = (u64)e << 32;
  const u32 R = (u32)(pad_bs / d.tp), n = d.n, tp = d.tp, rank = d.rank;
  const i64 RN = (i64)R * n;
  const i64 vals = kind == 0 ? 2 * RN + R : RN;
  const u32* a0 = (const u32*)in0;
  const u32* a1 = (const u32*)in1;
  const u32* a2 = (const u32*)in2;
  const u64* peers = (const u64*)d.peers;
  const u32 mine = dp_real_reqs(bs, rank, R);

  // push: every real value to every peer (own rank included)
  for (i64 k = threadIdx.x; k < vals; k += blockDim.x) {
    if (!gather_value_real(k, RN, n, mine)) continue;
    const u32 v = k < RN ? a0[k] : (k < 2 * RN ? a1[k - RN] : a2[k - 2 * RN]);
    const u64 packet = tag | v;
    for (u32 j = 0; j < tp; ++j) {
      u32 dest = rank + j;
      if (dest >= tp) dest -= tp;
      u64* slot = (u64*)(peers[dest] + d.ll_off + dparity * d.ll_region_bytes) +
                  (u64)rank * d.ll_slots + k;
      st_relaxed_sys(slot, packet);
    }
  }
  if (threadIdx.x < tp)
    st_release_sys(dp_flag(d, peers[threadIdx.x], d.flags_off, parity, rank), tag | full_sig);

  // wait: headers first (signature check), then every real packet
  __shared__ u32 failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  if (threadIdx.x < tp &&
      !dp_wait_flag(d, dp_flag(d, d.base, d.flags_off, parity, threadIdx.x), e, threadIdx.x,
                    full_sig))
    atomicOr(&failed, 1u);
  __syncthreads();
  if (failed) return;

  const u64* region = (const u64*)(d.base + d.ll_off + dparity * d.ll_region_bytes);
  u32* o0 = (u32*)(d.base + d.out_off[kind == 0 ? 0 : 3]);
  u32* o1 = (u32*)(d.base + d.out_off[1]);
  u32* o2 = (u32*)(d.base + d.out_off[2]);
  const i64 total = (i64)tp * vals;
  for (i64 t = threadIdx.x; t < total; t += blockDim.x) {
    const u32 src = (u32)(t / vals);
    const i64 k = t - (i64)src * vals;
    if (!gather_value_real(k, RN, n, dp_real_reqs(bs, src, R))) continue;
    const u64 p = dp_wait(d, region + (u64)src * d.ll_slots + k, e, src, full_sig, nullptr, true);
    if (p == 0) break;
    const u32 v = (u32)(p & 0xffffffffull);
    if (k < RN) {
      o0[src * RN + k] = v;
    } else if (k < 2 * RN) {
      o1[src * RN + (k - RN)] = v;
    } else {
      o2[(i64)src * R + (k - 2 * RN)] = v;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) dp_ctrl(d)[DP_CTRL_EPOCH] = e;
}

// argmax_batch_vocab: greedy verify without moving logits. Every CTA reduces real
// rows of this rank's shard (one CTA per row, grid-stride) to (max, first global
// index, sum of exp) partials and sends each as three LL packets to the row's
// owner (row g of the padded batch belongs to request g / N, owned by rank
// g / (R*N)); the last CTA signals the flags, waits for every peer's (signature
// check: op, dtype, pad_bs, bs), then collects the tp partials of each of this
// rank's real rows, combines them in rank order and writes the token id and its
// log-softmax value. Only the last CTA spins.
#define DP_ARGMAX_BLOCK 256
template <typename Tag>
__device__ __forceinline__ bool argmax_push_rows(const DpDesc& d, u64 src, u32 real_rows, u32 rpd,
                                                 u32 ncols, u32 limit, u64 dparity, u64 tag) {
  __shared__ float smem_f[2 * DP_ARGMAX_BLOCK];
  __shared__ unsigned smem_u[DP_ARGMAX_BLOCK];
  const u64* peers = (const u64*)d.peers;
  const u32 col0 = d.rank * ncols;
  const u32 local_limit = limit <= col0 ? 0u : (limit - col0 < ncols ? limit - col0 : ncols);
  bool any = false;
  for (u32 g = blockIdx.x; g < real_rows; g += gridDim.x) {
    const typename Tag::Storage* row = (const typename Tag::Storage*)src + (u64)g * ncols;
    const ArgmaxPartial p = argmax_row_partial<Tag>(row, ncols, col0, local_limit, smem_f, smem_u);
    if (threadIdx.x < 3) {
      unsigned w[3];
      argmax_pack(p, w);
      const u32 dest = g / rpd;
      u64* slot = (u64*)(peers[dest] + d.ll_off + dparity * d.ll_region_bytes) +
                  (u64)d.rank * d.ll_slots + (u64)(g - dest * rpd) * 3 + threadIdx.x;
      st_relaxed_sys(slot, tag | w[threadIdx.x]);
    }
    any = true;
  }
  return any;
}

extern "C" __global__ void __launch_bounds__(DP_ARGMAX_BLOCK)
    dp_argmax(u64 src_ptr, u64 bs_ptr, i64 bs_host, DpDesc d, i64 pad_bs, i64 ncols,
              i64 vocab_limit, i64 dtype_code, u64 sig) {
  u32* ctrl = dp_ctrl(d);
  const DpOpStart s = dp_op_start(d, bs_ptr, bs_host, pad_bs, sig);
  const u32 e = s.e, parity = s.parity, bs = s.bs, full_sig = s.sig;
  const u64 dparity = parity & d.parity_mask;
  const u64 tag = (u64)e << 32;
  const u32 R = (u32)(pad_bs / d.tp), rpd = R * d.n;
  const u32 limit = (u32)vocab_limit;
  const u32 active = dp_active_ctas((u64)bs * d.n);  // one row per CTA at most: see dp_swap_push
  if (s.broken || blockIdx.x >= active) return;
  if (dtype_code == 1)
    argmax_push_rows<ArgmaxBf16>(d, src_ptr, bs * d.n, rpd, (u32)ncols, limit, dparity, tag);
  else if (dtype_code == 2)
    argmax_push_rows<ArgmaxF16>(d, src_ptr, bs * d.n, rpd, (u32)ncols, limit, dparity, tag);
  else
    argmax_push_rows<ArgmaxF32>(d, src_ptr, bs * d.n, rpd, (u32)ncols, limit, dparity, tag);

  // LL packets need no fence: each carries its epoch. The last CTA signals.
  __shared__ u32 last;
  __syncthreads();
  if (threadIdx.x == 0) {
    const u32 prev = atomicAdd(&ctrl[DP_CTRL_COUNTER], 1u);
    last = (prev == active - 1) ? 1u : 0u;
  }
  __syncthreads();
  if (!last) return;
  const u64* peers = (const u64*)d.peers;
  __shared__ u32 failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  if (threadIdx.x < d.tp) {
    st_release_sys(dp_flag(d, peers[threadIdx.x], d.flags_off, parity, d.rank), tag | full_sig);
    if (!dp_wait_flag(d, dp_flag(d, d.base, d.flags_off, parity, threadIdx.x), e, threadIdx.x,
                      full_sig))
      atomicOr(&failed, 1u);
  }
  __syncthreads();
  if (!failed) {
    const u64* region = (const u64*)(d.base + d.ll_off + dparity * d.ll_region_bytes);
    int* ids = (int*)(d.base + d.out_off[4]);
    float* lps = (float*)(d.base + d.out_off[5]);
    const u32 mine = dp_real_reqs(bs, d.rank, R) * d.n;
    for (u32 i = threadIdx.x; i < mine; i += blockDim.x) {
      ArgmaxPartial acc = argmax_empty();
      bool ok = true;
      for (u32 s = 0; s < d.tp && ok; ++s) {
        unsigned w[3];
        for (u32 k = 0; k < 3; ++k) {
          const u64 p = dp_wait(d, region + (u64)s * d.ll_slots + (u64)i * 3 + k, e, s, full_sig,
                                nullptr, true);
          if (p == 0) {
            ok = false;
            break;
          }
          w[k] = (unsigned)(p & 0xffffffffull);
        }
        if (ok) acc = argmax_combine(acc, argmax_unpack(w[0], w[1], w[2]));
      }
      if (!ok) break;
      ids[i] = (int)acc.idx;
      lps[i] = argmax_logprob(acc);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    ctrl[DP_CTRL_COUNTER] = 0;
    ctrl[DP_CTRL_EPOCH] = e;
  }
}

// verify_batch_vocab (issue 24): sampled verify without moving logits, two launches.
// dp_verify_push: every CTA reduces real rows of this rank's shard (or, with splits > 1,
// column blocks of them: more CTAs per row when the batch is small) to records
// (verify.cuh) written straight into the row owner's verify region (parity e & 1, slot
// [this rank * splits + block][row of the owner]), then publishes them as the swap
// publishes its tiles:
// a counter bump per CTA, and the last CTA alone fences, signals every peer's flag and
// waits for every peer's (signature: op, dtype, pad_bs, bs). dp_verify_finish, next on
// the stream: every CTA combines this rank's real requests from the region the push
// filled (its parity from the epoch the push left) into int32 predict / accept_index /
// accept_length and float32 logprobs of this rank's requests, which dp_gather_ll then
// all-gathers. The per-request parameters are read from the caller's device arrays when
// the kernels run (CUDA-graph replays see new values). A record whose parameters or
// candidate differ from this rank's is reported as DP_ERR_PARAMS (ranks passed
// different arguments: the communicator breaks); a refused parameter value as
// DP_ERR_VALUE (the protocol goes on; the host raises at the next call or check()).
#define DP_ERR_PARAMS 3u
#define DP_ERR_VALUE 4u
#define DP_CTRL_VALUE 3  // claimed by the first DP_ERR_VALUE report

__device__ void dp_report_value(const DpDesc& d, u32 req, u32 why, u32 bits, u32 sig) {
  u32* ctrl = dp_ctrl(d);
  if (atomicCAS(&ctrl[DP_CTRL_VALUE], 0u, 1u) != 0u) return;
  if (dp_broken(d)) return;  // a protocol error owns the error block
  volatile DpErrorBlock* e = (volatile DpErrorBlock*)d.err;
  e->rank = d.rank;
  e->peer = req;
  e->op = sig >> DP_SIG_OP_SHIFT;
  e->expected = why;
  e->mine = sig;
  e->seen = bits;
  __threadfence_system();
  e->code = DP_ERR_VALUE;
  __threadfence_system();
}

template <typename Tag, bool kList>
__device__ __forceinline__ void verify_push_rows(const DpDesc& d, u64 src, const int* cand,
                                                 const DvParamPtrs& q, u32 kcap, bool want_lp,
                                                 u32 digest, u32 real_rows, u32 splits,
                                                 u32 rpd, u32 ncols, u32 limit, u64 region,
                                                 u32 sig, bool bcast, DvRowShared& rs,
                                                 DvQueue& qu, DvRecordShared* ls) {
  const u64* peers = (const u64*)d.peers;
  const u32 col0 = d.rank * ncols;
  const u32 local_limit = limit <= col0 ? 0u : (limit - col0 < ncols ? limit - col0 : ncols);
  const u64 rec_words = DV_HDR + 2 * kcap;
  // a row in `splits` column blocks (a multiple of 8 columns each, so each block starts
  // 16-byte aligned when the row does), each its own record: source rank * splits + block
  const u32 cs = ((ncols + splits - 1u) / splits + 7u) & ~7u;
  const u32 units = real_rows * splits;
  for (u32 u = blockIdx.x; u < units; u += gridDim.x) {
    const u32 g = u / splits, sp = u - g * splits;
    const u32 req = g / d.n, pos = g - req * d.n;
    const u32 dest = g / rpd, i = g - dest * rpd;
    const u32 c0 = sp * cs;  // the block's first column in the shard
    const u32 nc = local_limit > c0 ? (local_limit - c0 < cs ? local_limit - c0 : cs) : 0u;
    u32 bad, bits, dg = digest;
    const DvParams p = dv_load_params(q, req, limit, &bad, &bits, &dg);
    if (bad && threadIdx.x == 0) dp_report_value(d, req, bad, bits, sig);
    // broadcast (rpd = pad_bs * N, dest = 0): the record into this rank's own region
    // (copied into every peer's below)
    unsigned* rec = (unsigned*)(peers[bcast ? d.rank : dest] + region) +
                    (((u64)d.rank * splits + sp) * rpd + i) * rec_words;
    // the CTA's next unit's columns, asked of L2 during this one (DV_PREFETCH_LINES; the
    // kernel without top-k lists only: on the top-k kernel 1 and 2 lines measured slower
    // at pad_bs=256, BENCHMARKS.md)
    const typename Tag::Storage* next = nullptr;
    u32 next_nc = 0;
    if (!kList && DV_PREFETCH_LINES > 0 && u + gridDim.x < units) {
      const u32 gn = (u + gridDim.x) / splits, spn = u + gridDim.x - gn * splits;
      const u32 cn = spn * cs;
      next_nc = local_limit > cn ? (local_limit - cn < cs ? local_limit - cn : cs) : 0u;
      next = (const typename Tag::Storage*)src + (u64)gn * ncols + cn;
    }
    dv_row_record<Tag, kList>((const typename Tag::Storage*)src + (u64)g * ncols + c0, nc,
                              col0 + c0, p, pos, kcap, want_lp, (unsigned)cand[g], dg, rec, rs,
                              qu, ls, next, next_nc);
  }
  if (!bcast || d.tp == 1) return;
  // broadcast: this CTA's records, complete (dv_row_record ends with a barrier), into
  // every peer's region at the same place: the header, the list's len values (at
  // DV_HDR) and its len ids (at DV_HDR + kcap)
  for (u32 u = blockIdx.x; u < units; u += gridDim.x) {
    const u32 g = u / splits, sp = u - g * splits;
    const u64 at = region + ((((u64)d.rank * splits + sp) * rpd + g) * rec_words) * 4ull;
    const unsigned* rec = (const unsigned*)(peers[d.rank] + at);
    const u32 len = kcap < rec[DV_W_LIST_LEN] ? kcap : rec[DV_W_LIST_LEN];
    const u32 words = DV_HDR + 2u * len;
    for (u32 e = threadIdx.x; e < (d.tp - 1u) * words; e += blockDim.x) {
      const u32 j = e / words, w = e - j * words;
      u32 peer = d.rank + 1u + j;
      if (peer >= d.tp) peer -= d.tp;
      const u32 off = w < DV_HDR + len ? w : w - len + kcap;
      ((unsigned*)(peers[peer] + at))[off] = rec[off];
    }
  }
}

template <bool kList>
__device__ __forceinline__ void verify_push(u64 src_ptr, u64 cand_ptr, u64 temperature,
                                            u64 top_k, u64 top_p, u64 min_p, u64 seed,
                                            u64 offset, i64 kcap, i64 want_lp, i64 digest,
                                            u64 bs_ptr, i64 bs_host, i64 splits,
                                            const DpDesc& d, i64 pad_bs, i64 ncols,
                                            i64 vocab_limit, i64 dtype_code, u64 sig,
                                            u64 region_off, i64 region_bytes, i64 bcast,
                                            DvRowShared& rs, DvQueue& qu, DvRecordShared* ls) {
  u32* ctrl = dp_ctrl(d);
  const DpOpStart s = dp_op_start(d, bs_ptr, bs_host, pad_bs, sig);
  const u32 e = s.e, parity = s.parity, full_sig = s.sig;
  const u64 region = region_off + (u64)(parity & d.parity_mask) * (u64)region_bytes;
  // rows per source in the region: the owner's rows, or every row when broadcasting
  const u32 rpd = bcast ? (u32)pad_bs * d.n : (u32)(pad_bs / d.tp) * d.n;
  const u32 real_rows = s.bs * d.n;
  const u32 sp = (u32)splits;
  const u32 active = dp_active_ctas((u64)real_rows * sp);  // see dp_swap_push
  if (s.broken || blockIdx.x >= active) return;
  const int* cand = (const int*)cand_ptr;
  const DvParamPtrs q{temperature, top_k, top_p, min_p, seed, offset};
  const u32 kc = (u32)kcap, dg = (u32)digest, lim = (u32)vocab_limit, nc = (u32)ncols;
  const bool lp = want_lp != 0;
  if (dtype_code == 1)
    verify_push_rows<ArgmaxBf16, kList>(d, src_ptr, cand, q, kc, lp, dg, real_rows, sp, rpd, nc,
                                        lim, region, full_sig, bcast != 0, rs, qu, ls);
  else if (dtype_code == 2)
    verify_push_rows<ArgmaxF16, kList>(d, src_ptr, cand, q, kc, lp, dg, real_rows, sp, rpd, nc,
                                       lim, region, full_sig, bcast != 0, rs, qu, ls);
  else
    verify_push_rows<ArgmaxF32, kList>(d, src_ptr, cand, q, kc, lp, dg, real_rows, sp, rpd, nc,
                                       lim, region, full_sig, bcast != 0, rs, qu, ls);

  __shared__ u32 last;
  __syncthreads();
  if (threadIdx.x == 0) {
#if DP_SWAP_CTA_RELEASE_GPU
    const u32 prev = atom_add_acq_rel_gpu(&ctrl[DP_CTRL_COUNTER], 1u);
#else
    fence_sys();
    const u32 prev = atomicAdd(&ctrl[DP_CTRL_COUNTER], 1u);
#endif
    last = (prev == active - 1) ? 1u : 0u;
  }
  __syncthreads();
  if (!last) return;
  fence_sys();  // every CTA's records before the flags, at system scope
  const u64 word = ((u64)e << 32) | full_sig;
  const u64* peers = (const u64*)d.peers;
  if (threadIdx.x < d.tp) {
    st_release_sys(dp_flag(d, peers[threadIdx.x], d.flags_off, parity, d.rank), word);
    dp_wait_flag(d, dp_flag(d, d.base, d.flags_off, parity, threadIdx.x), e, threadIdx.x,
                 full_sig);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    ctrl[DP_CTRL_COUNTER] = 0;
    ctrl[DP_CTRL_EPOCH] = e;
  }
}

// kcap > 0: with the top-k selection's shared memory.
extern "C" __global__ void __launch_bounds__(DV_BLOCK, DV_LIST_MIN_CTAS)
    dp_verify_push(u64 src_ptr, u64 cand_ptr, u64 temperature, u64 top_k, u64 top_p,
                   u64 min_p, u64 seed, u64 offset, i64 kcap, i64 want_lp, i64 digest,
                   u64 bs_ptr, i64 bs_host, i64 splits, DpDesc d, i64 pad_bs, i64 ncols,
                   i64 vocab_limit, i64 dtype_code, u64 sig, u64 region_off,
                   i64 region_bytes, i64 bcast) {
  __shared__ DvRecordShared sh;
  verify_push<true>(src_ptr, cand_ptr, temperature, top_k, top_p, min_p, seed, offset, kcap,
                    want_lp, digest, bs_ptr, bs_host, splits, d, pad_bs, ncols, vocab_limit,
                    dtype_code, sig, region_off, region_bytes, bcast, sh.row, sh.q, &sh);
}

// kcap == 0 (no row has top-k): the same, with a few KB of shared memory per CTA.
extern "C" __global__ void __launch_bounds__(DV_BLOCK, DV_NOLIST_MIN_CTAS)
    dp_verify_push_nolist(u64 src_ptr, u64 cand_ptr, u64 temperature, u64 top_k, u64 top_p,
                          u64 min_p, u64 seed, u64 offset, i64 kcap, i64 want_lp,
                          i64 digest, u64 bs_ptr, i64 bs_host, i64 splits, DpDesc d,
                          i64 pad_bs, i64 ncols, i64 vocab_limit, i64 dtype_code, u64 sig,
                          u64 region_off, i64 region_bytes, i64 bcast) {
  __shared__ DvRowQueueShared sh;
  verify_push<false>(src_ptr, cand_ptr, temperature, top_k, top_p, min_p, seed, offset, kcap,
                     want_lp, digest, bs_ptr, bs_host, splits, d, pad_bs, ncols, vocab_limit,
                     dtype_code, sig, region_off, region_bytes, bcast, sh.row, sh.q, nullptr);
}

extern "C" __global__ void __launch_bounds__(DV_BLOCK)
    dp_verify_finish(u64 cand_ptr, u64 temperature, u64 top_k, u64 top_p, u64 min_p, u64 seed,
                     u64 offset, i64 kcap, i64 want_lp, i64 digest, u64 bs_ptr, i64 bs_host,
                     i64 splits, DpDesc d, i64 pad_bs, i64 vocab_limit, u64 sig,
                     u64 region_off,
                     i64 region_bytes, u64 out_predict, u64 out_accept_index,
                     u64 out_accept_length, u64 out_logprobs, i64 bcast) {
  __shared__ DvCombineShared sh;
  const DpOpStart s = dp_op_start(d, bs_ptr, bs_host, pad_bs, sig);
  if (s.broken) return;  // the push failed: nothing arrived
  const u32 e = s.e - 1u;  // the push that just finished
  const unsigned* region =
      (const unsigned*)(d.base + region_off + (u64)(e & 1u & d.parity_mask) * (u64)region_bytes);
  const u32 R = (u32)(pad_bs / d.tp), n = d.n;
  // owner: this rank's real requests, into its own results (gathered next); broadcast:
  // every real request of the batch (every rank holds every record), into the gathered
  // outputs at the request's place, numbered as its owner numbers it
  const u32 todo = bcast ? s.bs : dp_real_reqs(s.bs, d.rank, R);
  const u32 rows_per_src = bcast ? (u32)pad_bs * n : R * n;
  const u32 first_req = bcast ? 0u : d.rank * R;
  const u32 rec_words = DV_HDR + 2 * (u32)kcap;
  const DvParamPtrs q{temperature, top_k, top_p, min_p, seed, offset};
  const int* cand = (const int*)cand_ptr;
  for (u32 i = blockIdx.x; i < todo; i += gridDim.x) {
    const u32 req = first_req + i;
    const u32 local = req % R;  // the request's row block at its owner
    u32 bad, bits, dg = (u32)digest;
    const DvParams p = dv_load_params(q, req, (u32)vocab_limit, &bad, &bits, &dg);
    const unsigned mismatch = dv_combine_request(
        region, d.tp * (u32)splits, rows_per_src, rec_words, (u32)kcap, i, n, p,
        cand + (u64)req * n, dg,
        want_lp != 0, (int)(local * n), (int*)out_predict + (u64)i * n,
        (int*)out_accept_index + (u64)i * n, (int*)out_accept_length + i,
        (float*)out_logprobs + (u64)i * n, sh);
    if (mismatch != DV_NO_ID) {  // uniform over the CTA
      if (threadIdx.x == 0) {
        const unsigned* r = region + ((u64)mismatch * rows_per_src + (u64)i * n) * rec_words;
        dp_report(d, DP_ERR_PARAMS, mismatch / (u32)splits, s.sig, e,
                  ((u64)r[DV_W_CAND] << 32) | r[DV_W_DIGEST]);
      }
      return;
    }
  }
}

// Init-time verification: write `value` into a peer's probe slot through the
// opened mapping (the real store path kernels use).
extern "C" __global__ void dp_probe_write(u64 dst, u64 value) {
  if (threadIdx.x == 0 && blockIdx.x == 0) st_release_sys((u64*)dst, value);
}

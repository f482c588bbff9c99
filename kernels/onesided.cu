// ipc_dpsample one-sided kernels: push data into peers' arenas through CUDA IPC
// mappings, signal with epoch-tagged flags, wait with a bounded spin.
//
// No toolkit headers: acquire/release and the timer are inline PTX, so NVRTC
// (CuPy RawModule) and nvcc (the CI compile check) both build this file anywhere.
//
// Arena layout (byte offsets come from ipc_dpsample/symmetric.py:ArenaLayout and
// travel as kernel arguments):
//   ctrl   : u32 epoch, u32 cta_counter, u32 broken, ... ; u64 probe[tp]
//   flags  : u64 flags[2][tp]            one writer per word: flags[p][src]
//   ready  : u64 ready[2][tp]            graph-mode swap entry barrier, same scheme
//   ll     : u64 ll[2][tp][ll_slots]     LL packets (value | epoch << 32)
//   swap   : bytes swap[2][R_max*N][V]   receive regions of swap_batch_vocab,
//            then one more [R_max*N][V]  fixed output (CUDA-graph mode: peers push
//                                        into it after the entry barrier dp_swap_enter)
//   outputs: int32/float32 persistent gather outputs (local only)
// Op e (epochs start at 1) uses region and flag parity e & 1.
//
// All scalar arguments are 64-bit (CuPy passes Python ints as long long).

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;

// Host-visible error block (mapped pinned memory); mirrored by
// ipc_dpsample/symmetric.py:ERROR_BLOCK_FORMAT.
struct ErrorBlock {
  u32 code;      // 0 ok, 1 peer timeout, 2 signature mismatch
  u32 rank;      // the rank that detected it
  u32 peer;      // the peer it waited for
  u32 op;        // op code of the waiting rank
  u32 expected;  // epoch the waiting rank expected
  u32 seen_sig;  // signature word seen from the peer (mismatch) or 0
  u64 seen;      // last 64-bit word seen from the peer
};
static_assert(sizeof(ErrorBlock) == 32, "ErrorBlock layout is shared with Python");

#define CTRL_EPOCH 0
#define CTRL_COUNTER 1
#define CTRL_BROKEN 2
#define ERR_TIMEOUT 1u
#define ERR_MISMATCH 2u

__device__ __forceinline__ u64 ld_acquire_sys(const u64* p) {
  u64 v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ u64 ld_relaxed_sys(const u64* p) {
  u64 v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(u64* p, u64 v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys(u64* p, u64 v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// acq_rel is enough for the release/acquire patterns here (data stores, then a
// counter bump or a flag store; a flag load, then data loads); sc would also order
// unrelated stores and costs more.
__device__ __forceinline__ void fence_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

__device__ __forceinline__ u64 globaltimer_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Record the first error of this op (one writer: the elected thread) and mark
// the communicator broken so later launches do nothing.
__device__ void report_error(ErrorBlock* err, u32* ctrl, u32 code, u32 rank, u32 peer, u32 op,
                             u32 expected, u64 seen) {
  // claim first: only one thread (of every kernel of this rank) writes the record
  if (atomicCAS(&ctrl[CTRL_BROKEN], 0u, code) != 0u) return;
  volatile ErrorBlock* e = err;
  e->rank = rank;
  e->peer = peer;
  e->op = op;
  e->expected = expected;
  e->seen_sig = (u32)(seen & 0xffffffffull);
  e->seen = seen;
  __threadfence_system();
  e->code = code;  // written last: the host reads the fields once it sees a code
  __threadfence_system();
}

// Wait until flags[parity][src] carries epoch `e`; check its signature.
// Returns 0 on success, else the error code (already reported).
__device__ u32 wait_flag(const u64* flag, u32 e, u32 sig, u64 timeout_ns, ErrorBlock* err,
                         u32* ctrl, u32 rank, u32 src, u32 op) {
  u64 start = 0;
  u64 v = ld_acquire_sys(flag);
  u32 spins = 0;
  while ((u32)(v >> 32) != e) {
    if (((++spins) & 1023u) == 0) {
      u64 now = globaltimer_ns();
      if (start == 0) {
        start = now;
      } else if (now - start > timeout_ns) {
        report_error(err, ctrl, ERR_TIMEOUT, rank, src, op, e, v);
        return ERR_TIMEOUT;
      }
      if (((volatile u32*)ctrl)[CTRL_BROKEN] != 0) return ERR_TIMEOUT;
    }
    v = ld_acquire_sys(flag);
  }
  if ((u32)(v & 0xffffffffull) != sig) {
    report_error(err, ctrl, ERR_MISMATCH, rank, src, op, e, v);
    return ERR_MISMATCH;
  }
  return 0;
}

// Block-wide copy of n bytes using the widest vector the relative alignment of
// dst and src allows: scalar head until dst is aligned, vector body, scalar tail.
// The body issues UNROLL loads per thread before any store (memory-level
// parallelism: a CTA copies a 32 KiB tile in one round trip), with the tail of
// the last round predicated instead of falling back to one load at a time.
#ifndef DP_SWAP_UNROLL
#define DP_SWAP_UNROLL 4  // vector loads in flight per thread (host: IPC_DPSAMPLE_SWAP_UNROLL)
#endif
#ifndef DP_SWAP_STREAMING
#define DP_SWAP_STREAMING 0  // 1: 16-byte moves with streaming cache hints (IPC_DPSAMPLE_SWAP_STREAMING)
#endif

// Vector load/store of the copy loop. With DP_SWAP_STREAMING the 16-byte path reads
// through the non-coherent path without L1 allocation, asking L2 to fetch 256-byte
// blocks, and stores evict-first: every byte is touched once. The source is the
// caller's input, which no kernel writes while the swap runs.
template <typename V>
__device__ __forceinline__ V ld_vec(const V* p) { return *p; }
template <typename V>
__device__ __forceinline__ void st_vec(V* p, const V& v) { *p = v; }
#if DP_SWAP_STREAMING
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

// The swap's data movement: CTAs stride over the tiles (destination, row, chunk);
// rows for the own rank stay local. I is the tile index type: 32-bit whenever the
// tile count fits (the per-tile index math is then a few instructions, not three
// 64-bit divisions that stall the warp between its loads); byte offsets stay 64-bit.
template <typename I>
__device__ __forceinline__ void push_tiles(u64 src_ptr, const u64* peers, u64 region_off,
                                           i64 rank, i64 tp, i64 rows_per_dest, i64 shard_bytes,
                                           i64 row_bytes_out, i64 chunks_per_row,
                                           i64 chunk_bytes) {
  const I cpr = (I)chunks_per_row;
  const I per_dest = (I)rows_per_dest * cpr;
  const I ntp = (I)tp;
  const I tiles = ntp * per_dest;
  const u64 sb = (u64)shard_bytes, cb = (u64)chunk_bytes;
  for (I b = blockIdx.x; b < tiles; b += gridDim.x) {
    const I di = b / per_dest;
    const I rem = b - di * per_dest;
    const I row = rem / cpr;
    const I chunk = rem - row * cpr;
    // rotate destinations so ranks do not all target the same peer at once
    I dest = (I)rank + 1 + di;  // < 2 tp
    if (dest >= ntp) dest -= ntp;
    const u64 c0 = (u64)chunk * cb;
    u64 n = sb - c0;
    if (n > cb) n = cb;
    const char* s = (const char*)src_ptr + ((u64)dest * (u64)rows_per_dest + row) * sb + c0;
    char* d = (char*)(peers[dest] + region_off) + (u64)row * (u64)row_bytes_out +
              (u64)rank * sb + c0;
    copy_block(d, s, n);
  }
}

// swap_batch_vocab: one launch. Every CTA moves its tiles (push_tiles), fences and
// bumps the local counter; the last CTA alone signals the peers (thread t -> peer t)
// and waits for them.
extern "C" __global__ void dp_swap_push(
    u64 src_ptr,          // local_logits [pad_bs*N, Vs] (bytes: shard_bytes per row)
    u64 peers_ptr,        // u64[tp] peer arena bases (own base at [rank])
    u64 ctrl_ptr,         // own ctrl block (u32*)
    u64 err_ptr,          // ErrorBlock* (host-mapped)
    u64 swap_off,         // offset of swap region 0
    u64 swap_region_bytes,
    u64 flags_off,
    i64 rank, i64 tp,
    i64 rows_per_dest,    // R*N
    i64 shard_bytes,      // Vs * itemsize
    i64 row_bytes_out,    // V * itemsize
    i64 chunks_per_row, i64 chunk_bytes,
    u64 sig, u64 timeout_ns,
    u64 data_parity_mask) {  // 1; 0: one data region (graph mode's fixed output, where
                             // dp_swap_enter ran first; or the test hook showing the race)
  u32* ctrl = (u32*)ctrl_ptr;
  const u64* peers = (const u64*)peers_ptr;
  ErrorBlock* err = (ErrorBlock*)err_ptr;
  if (((volatile u32*)ctrl)[CTRL_BROKEN] != 0) return;
  const u32 e = ((volatile u32*)ctrl)[CTRL_EPOCH] + 1u;
  const u64 parity = e & 1u;
  const u64 region_off = swap_off + (parity & data_parity_mask) * swap_region_bytes;

  // grid-stride: the host launches at most a few CTAs per SM, so each CTA's fence
  // and counter bump is paid once, not per tile
  const u64 tiles = (u64)tp * (u64)rows_per_dest * (u64)chunks_per_row;
  if (tiles <= 0xffffffffull)
    push_tiles<u32>(src_ptr, peers, region_off, rank, tp, rows_per_dest, shard_bytes,
                    row_bytes_out, chunks_per_row, chunk_bytes);
  else
    push_tiles<u64>(src_ptr, peers, region_off, rank, tp, rows_per_dest, shard_bytes,
                    row_bytes_out, chunks_per_row, chunk_bytes);

  __shared__ u32 last;
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_sys();
    const u32 prev = atomicAdd(&ctrl[CTRL_COUNTER], 1u);
    last = (prev == gridDim.x - 1) ? 1u : 0u;
  }
  __syncthreads();
  if (!last) return;

  fence_sys();
  const u64 word = ((u64)e << 32) | (sig & 0xffffffffull);
  if (threadIdx.x < tp) {
    u64* f = (u64*)(peers[threadIdx.x] + flags_off) + parity * tp + rank;
    st_release_sys(f, word);
  }
  if (threadIdx.x < tp) {
    const u64* f = (const u64*)((u64)ctrl + flags_off) + parity * tp + threadIdx.x;
    wait_flag(f, e, (u32)sig, timeout_ns, err, ctrl, (u32)rank, threadIdx.x, (u32)(sig >> 28));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    ctrl[CTRL_COUNTER] = 0;
    ctrl[CTRL_EPOCH] = e;
  }
}

// The other CUDA-graph mode of a swap (IPC_DPSAMPLE_GRAPH_SWAP=copy): the push
// wrote the ping-pong region of the op that just finished (its parity is only known
// on the device); copy it into the fixed output a captured consumer reads. Moves
// the output's bytes once more; needs no barrier and no agreement on the mode.
extern "C" __global__ void dp_swap_copy_out(u64 ctrl_ptr, u64 region0, u64 region_bytes,
                                            u64 dst, u64 nbytes, u64 data_parity_mask) {
  const u32* ctrl = (const u32*)ctrl_ptr;
  if (((volatile const u32*)ctrl)[CTRL_BROKEN] != 0) return;
  const u32 e = ((volatile const u32*)ctrl)[CTRL_EPOCH];
  const char* src = (const char*)(region0 + (u64)(e & 1u & data_parity_mask) * region_bytes);
  const u64 step = ((nbytes + gridDim.x - 1) / gridDim.x + 15) & ~15ull;
  const u64 begin = step * blockIdx.x;
  if (begin >= nbytes) return;
  u64 n = nbytes - begin;
  if (n > step) n = step;
  copy_block((char*)dst + begin, src + begin, n);
}

// Entry barrier of a swap in CUDA-graph mode, launched right before dp_swap_push
// on the same stream. There the swap writes one fixed output (a captured consumer
// reads one address), so a peer may only push op e into this rank's output once
// this rank has consumed op e-1's: reaching this kernel proves it (stream order).
// Thread t < tp stores ready[e&1][rank] = e << 32 | sig into peer t, then waits
// for peer t's word. One CTA: only it spins, so ranks sharing a GPU cannot starve
// each other of SMs. A peer already inside another op at epoch e (a gather signals
// flags[e&1] without a barrier) is a call-sequence mismatch, reported as such.
extern "C" __global__ void dp_swap_enter(u64 peers_ptr, u64 ctrl_ptr, u64 err_ptr, u64 ready_off,
                                         u64 flags_off, i64 rank, i64 tp, u64 sig,
                                         u64 timeout_ns) {
  u32* ctrl = (u32*)ctrl_ptr;
  const u64* peers = (const u64*)peers_ptr;
  ErrorBlock* err = (ErrorBlock*)err_ptr;
  if (((volatile u32*)ctrl)[CTRL_BROKEN] != 0) return;
  const u32 e = ((volatile u32*)ctrl)[CTRL_EPOCH] + 1u;
  const u64 parity = e & 1u;
  const u64 word = ((u64)e << 32) | (sig & 0xffffffffull);
  const u32 op = (u32)(sig >> 28);
  const u64 t = threadIdx.x;
  if (t >= (u64)tp) return;
  st_release_sys((u64*)(peers[t] + ready_off) + parity * tp + rank, word);
  const u64* ready = (const u64*)((u64)ctrl + ready_off) + parity * tp + t;
  const u64* flag = (const u64*)((u64)ctrl + flags_off) + parity * tp + t;
  u64 start = 0;
  u32 spins = 0;
  u64 v = ld_acquire_sys(ready);
  while ((u32)(v >> 32) != e) {
    const u64 f = ld_acquire_sys(flag);
    if ((u32)(f >> 32) == e) {
      // the peer signalled op e: after its own ready word if it is this swap (then
      // the acquire above makes that word visible now), else it is another op
      v = ld_acquire_sys(ready);
      if ((u32)(v >> 32) == e) break;
      report_error(err, ctrl, ERR_MISMATCH, (u32)rank, (u32)t, op, e, f);
      return;
    }
    if (((++spins) & 1023u) == 0) {
      const u64 now = globaltimer_ns();
      if (start == 0) {
        start = now;
      } else if (now - start > timeout_ns) {
        report_error(err, ctrl, ERR_TIMEOUT, (u32)rank, (u32)t, op, e, v);
        return;
      }
      if (((volatile u32*)ctrl)[CTRL_BROKEN] != 0) return;
    }
    v = ld_acquire_sys(ready);
  }
  if ((u32)(v & 0xffffffffull) != (u32)sig)
    report_error(err, ctrl, ERR_MISMATCH, (u32)rank, (u32)t, op, e, v);
}

// Gathers as LL packets: value | epoch << 32 in one 8-byte store, region parity
// e & 1, no barrier and no clearing pass. One CTA. kind 0: verify outputs
// (predict [R,N], accept_index [R,N], accept_length [R]); kind 1: logprobs [R,N]
// (moved as 32-bit patterns).
extern "C" __global__ void dp_gather_ll(
    u64 in0, u64 in1, u64 in2,       // local inputs (in1, in2 unused for kind 1)
    u64 out0, u64 out1, u64 out2,    // persistent outputs [pad_bs,N], [pad_bs,N], [pad_bs]
    u64 peers_ptr, u64 ctrl_ptr, u64 err_ptr,
    u64 ll_off, u64 ll_region_bytes, i64 ll_slots, u64 flags_off,
    i64 rank, i64 tp, i64 R, i64 N, i64 kind, u64 sig, u64 timeout_ns, u64 data_parity_mask) {
  u32* ctrl = (u32*)ctrl_ptr;
  const u64* peers = (const u64*)peers_ptr;
  ErrorBlock* err = (ErrorBlock*)err_ptr;
  if (((volatile u32*)ctrl)[CTRL_BROKEN] != 0) return;
  const u32 e = ((volatile u32*)ctrl)[CTRL_EPOCH] + 1u;
  const u64 parity = e & 1u;
  const u64 dparity = parity & data_parity_mask;
  const u64 tag = (u64)e << 32;
  const i64 RN = R * N;
  const i64 vals = kind == 0 ? 2 * RN + R : RN;
  const u32* a0 = (const u32*)in0;
  const u32* a1 = (const u32*)in1;
  const u32* a2 = (const u32*)in2;

  // push: every value to every peer (own rank included)
  for (i64 k = threadIdx.x; k < vals; k += blockDim.x) {
    u32 v;
    if (k < RN) {
      v = a0[k];
    } else if (k < 2 * RN) {
      v = a1[k - RN];
    } else {
      v = a2[k - 2 * RN];
    }
    const u64 packet = tag | v;
    for (i64 j = 0; j < tp; ++j) {
      const i64 dest = (rank + j) % tp;
      u64* slot = (u64*)(peers[dest] + ll_off + dparity * ll_region_bytes) + rank * ll_slots + k;
      st_relaxed_sys(slot, packet);
    }
  }
  const u64 word = tag | (sig & 0xffffffffull);
  if (threadIdx.x < tp) {
    u64* f = (u64*)(peers[threadIdx.x] + flags_off) + parity * tp + rank;
    st_release_sys(f, word);
  }

  // wait: headers first (signature check), then every packet
  __shared__ u32 failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  if (threadIdx.x < tp) {
    const u64* f = (const u64*)((u64)ctrl + flags_off) + parity * tp + threadIdx.x;
    if (wait_flag(f, e, (u32)sig, timeout_ns, err, ctrl, (u32)rank, threadIdx.x,
                  (u32)(sig >> 28)) != 0)
      atomicOr(&failed, 1u);
  }
  __syncthreads();
  if (failed) return;

  const u64* region = (const u64*)((u64)ctrl + ll_off + dparity * ll_region_bytes);
  u32* o0 = (u32*)out0;
  u32* o1 = (u32*)out1;
  u32* o2 = (u32*)out2;
  const i64 total = tp * vals;
  for (i64 t = threadIdx.x; t < total; t += blockDim.x) {
    const i64 src = t / vals;
    const i64 k = t - src * vals;
    const u64* slot = region + src * ll_slots + k;
    u64 p = ld_relaxed_sys(slot);
    u64 start = 0;
    u32 spins = 0;
    bool ok = true;
    while ((u32)(p >> 32) != e) {
      if (((++spins) & 1023u) == 0) {
        const u64 now = globaltimer_ns();
        if (start == 0) {
          start = now;
        } else if (now - start > timeout_ns) {
          report_error(err, ctrl, ERR_TIMEOUT, (u32)rank, (u32)src, (u32)(sig >> 28), e, p);
          ok = false;
          break;
        }
        if (((volatile u32*)ctrl)[CTRL_BROKEN] != 0) {
          ok = false;
          break;
        }
      }
      p = ld_relaxed_sys(slot);
    }
    if (!ok) break;
    const u32 v = (u32)(p & 0xffffffffull);
    if (k < RN) {
      o0[src * RN + k] = v;
    } else if (k < 2 * RN) {
      o1[src * RN + (k - RN)] = v;
    } else {
      o2[src * R + (k - 2 * RN)] = v;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) ctrl[CTRL_EPOCH] = e;
}

// Init-time verification: write `value` into a peer's probe slot through the
// opened mapping (the real store path kernels use).
extern "C" __global__ void dp_probe_write(u64 dst, u64 value) {
  if (threadIdx.x == 0 && blockIdx.x == 0) st_release_sys((u64*)dst, value);
}

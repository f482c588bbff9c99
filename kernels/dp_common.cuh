// ipc_dpsample: the host/device contract of the one-sided kernels, in one place.
//
// * typedefs, the error block and the arena descriptor (plain structs: the host
//   half, ipc_dpsample/backends/onesided/contract.py, mirrors them with ctypes, and a
//   CPU test compiles this header with g++ (-DDP_HOST_PROBE) and compares every
//   offsetof/sizeof with the Python side);
// * the signature bit fields every flag word carries;
// * the device helpers: PTX loads/stores/fences/timer, the error report and the ONE
//   bounded wait every spin uses.
//
// No toolkit headers: NVRTC (CuPy RawModule) and nvcc (the CI compile check) both
// build it anywhere.
#pragma once

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;

// Host-visible error block (mapped pinned memory), the first error of this rank.
struct DpErrorBlock {
  u32 code;      // 0 ok, DP_ERR_TIMEOUT, DP_ERR_MISMATCH
  u32 rank;      // the rank that detected it
  u32 peer;      // the peer it waited for
  u32 op;        // op code of the waiting rank
  u32 expected;  // epoch the waiting rank expected
  u32 mine;      // the waiting rank's own signature
  u64 seen;      // last 64-bit word seen from the peer (epoch << 32 | its signature)
};
static_assert(sizeof(DpErrorBlock) == 32, "DpErrorBlock is mirrored in Python");

#define DP_ERR_TIMEOUT 1u
#define DP_ERR_MISMATCH 2u

// ctrl words at the start of every arena (u32 each)
#define DP_CTRL_EPOCH 0    // ops completed (the next op uses epoch + 1)
#define DP_CTRL_COUNTER 1  // CTAs of the running op that finished their tiles
#define DP_CTRL_BROKEN 2   // nonzero after an error: every later kernel returns at once

// The arena descriptor: written once at set-up into this rank's arena (desc_off),
// read by every kernel. Offsets are relative to an arena base (own or peer).
struct DpDesc {
  u64 peers;              // device u64[tp]: peer arena bases, own base at [rank]
  u64 base;               // own arena base
  u64 err;                // DpErrorBlock* (host-mapped, device address)
  u64 timeout_ns;         // longest wait for a peer
  u64 flags_off;          // u64 flags[2][tp]: op signal, one writer per word
  u64 ready_off;          // u64 ready[2][tp]: graph-mode swap entry barrier
  u64 ll_off;             // u64 ll[2][tp][ll_slots]: LL packets
  u64 ll_region_bytes;    // one parity of ll
  u64 ll_slots;           // packets per source rank in one parity
  u64 swap_off;           // swap receive region 0 (region 1 follows)
  u64 swap_region_bytes;  // one parity's [R_max*N, V] region
  u64 swap_fixed_off;     // graph-mode fixed swap output [R_max*N, V]
  u64 out_off[6];         // persistent outputs: predict, accept_index, accept_length,
                          // logprobs, argmax token ids, argmax logprobs
  u32 rank;
  u32 tp;
  u32 n;            // num_tokens_per_req
  u32 parity_mask;  // 1; 0: one data region (test hook showing the race)
};
static_assert(sizeof(DpDesc) == 160, "DpDesc is mirrored in Python");

// Signature of one op call, the low 32 bits of every flag/ready word:
//   op << 29 | dtype << 27 | graph << 26 | pad_bs << 13 | bs
// (op 1..4, dtype 0 int32 / 1 bf16 / 2 fp16 / 3 fp32, pad_bs and bs < 8192). The
// host passes everything but bs; the kernel adds the bs it read, so ranks that
// passed different bs (host ints or device scalars) see different signatures.
#define DP_SIG_OP_SHIFT 29
#define DP_SIG_PAD_SHIFT 13
#define DP_SIG_FIELD_MASK 0x1fffu

#ifndef DP_HOST_PROBE

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

// A counter bump that publishes this thread's (and, through the CTA barrier before
// it, its CTA's) stores at gpu scope and acquires what earlier bumps published: the
// CTA that makes the last bump has every CTA's stores ordered before its own.
__device__ __forceinline__ u32 atom_add_acq_rel_gpu(u32* p, u32 v) {
  u32 old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

__device__ __forceinline__ u64 globaltimer_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ u32* dp_ctrl(const DpDesc& d) { return (u32*)d.base; }

__device__ __forceinline__ bool dp_broken(const DpDesc& d) {
  return ((volatile u32*)dp_ctrl(d))[DP_CTRL_BROKEN] != 0u;
}

// The number of real requests: the caller's device int32 when bs_ptr is set (read
// when the kernel runs, so a CUDA-graph replay sees the value written before it),
// else bs_host; clamped to [0, pad_bs].
__device__ __forceinline__ u32 dp_real_bs(u64 bs_ptr, i64 bs_host, i64 pad_bs) {
  i64 bs = bs_ptr ? (i64)(*(const volatile int*)bs_ptr) : bs_host;
  if (bs < 0) bs = 0;
  if (bs > pad_bs) bs = pad_bs;
  return (u32)bs;
}

// What an op kernel starts from. The ctrl words and the caller's bs are loaded back
// to back, with no branch between the loads, so they cost one memory round trip
// instead of one each (a small op's time is mostly such round trips).
struct DpOpStart {
  u32 e;         // this op's epoch: ops completed + 1
  u32 parity;    // e & 1: the flag words (and ping-pong regions) of this op
  u32 bs;        // real requests (dp_real_bs)
  u32 sig;       // the host's signature with bs added: what the flags carry
  bool broken;   // an earlier error: the kernel must do nothing
};

__device__ __forceinline__ DpOpStart dp_op_start(const DpDesc& d, u64 bs_ptr, i64 bs_host,
                                                 i64 pad_bs, u64 sig) {
  const volatile u32* c = (const volatile u32*)dp_ctrl(d);
  const u32 done = c[DP_CTRL_EPOCH];
  const u32 broken = c[DP_CTRL_BROKEN];
  DpOpStart s;
  s.bs = dp_real_bs(bs_ptr, bs_host, pad_bs);
  s.e = done + 1u;
  s.parity = s.e & 1u;
  s.sig = (u32)sig | s.bs;
  s.broken = broken != 0u;
  return s;
}

// Real requests among rank r's R: clamp(bs - r*R, 0, R).
__device__ __forceinline__ u32 dp_real_reqs(u32 bs, u32 r, u32 R) {
  const i64 c = (i64)bs - (i64)r * (i64)R;
  return c <= 0 ? 0u : (c >= (i64)R ? R : (u32)c);
}

// CTAs of this launch that take part in an op with `work` items (tiles, rows) handed
// out blockIdx-first: min(gridDim.x, work), at least 1 (CTA 0 signals even with no
// work). The others return before touching the op's counter.
__device__ __forceinline__ u32 dp_active_ctas(u64 work) {
  if (work == 0) return 1u;
  return work < (u64)gridDim.x ? (u32)work : gridDim.x;
}

// Record the first error of this rank (one writer: whoever claims the broken word)
// and mark the communicator broken so later launches do nothing.
__device__ void dp_report(const DpDesc& d, u32 code, u32 peer, u32 sig, u32 expected, u64 seen) {
  u32* ctrl = dp_ctrl(d);
  if (atomicCAS(&ctrl[DP_CTRL_BROKEN], 0u, code) != 0u) return;
  volatile DpErrorBlock* e = (volatile DpErrorBlock*)d.err;
  e->rank = d.rank;
  e->peer = peer;
  e->op = sig >> DP_SIG_OP_SHIFT;
  e->expected = expected;
  e->mine = sig;
  e->seen = seen;
  __threadfence_system();
  e->code = code;  // written last: the host reads the fields once it sees a code
  __threadfence_system();
}

// The one bounded wait: spin on `word` until its epoch (high 32 bits) is `e`, the
// timer past `timeout_ns` (then report DP_ERR_TIMEOUT naming `peer`), or the
// communicator broken by another thread. `other`, when not null, is a second word
// of the same peer whose epoch reaching `e` first means the peer is in another op
// (the graph-mode entry barrier checks the peer's op flag this way). Returns the
// word seen, or 0 after an error. The caller checks the signature.
__device__ u64 dp_wait(const DpDesc& d, const u64* word, u32 e, u32 peer, u32 sig,
                       const u64* other = nullptr, bool relaxed = false) {
  u64 start = 0;
  u32 spins = 0;
  u64 v = relaxed ? ld_relaxed_sys(word) : ld_acquire_sys(word);
  while ((u32)(v >> 32) != e) {
    if (other != nullptr) {
      const u64 f = ld_acquire_sys(other);
      if ((u32)(f >> 32) == e) {
        v = ld_acquire_sys(word);  // the peer's own word came first if it is this op
        if ((u32)(v >> 32) == e) break;
        dp_report(d, DP_ERR_MISMATCH, peer, sig, e, f);
        return 0;
      }
    }
    if (((++spins) & 1023u) == 0) {
      const u64 now = globaltimer_ns();
      if (start == 0) {
        start = now;
      } else if (now - start > d.timeout_ns) {
        dp_report(d, DP_ERR_TIMEOUT, peer, sig, e, v);
        return 0;
      }
      if (dp_broken(d)) return 0;
    }
    v = relaxed ? ld_relaxed_sys(word) : ld_acquire_sys(word);
  }
  return v;
}

// Wait for a flag word of `peer` at epoch e and check its signature. True when it
// arrived with the same signature.
__device__ bool dp_wait_flag(const DpDesc& d, const u64* word, u32 e, u32 peer, u32 sig,
                             const u64* other = nullptr) {
  const u64 v = dp_wait(d, word, e, peer, sig, other);
  if (v == 0) return false;
  if ((u32)(v & 0xffffffffull) != sig) {
    dp_report(d, DP_ERR_MISMATCH, peer, sig, e, v);
    return false;
  }
  return true;
}

// The flag word of (parity, src) in the arena at `base`.
__device__ __forceinline__ u64* dp_flag(const DpDesc& d, u64 base, u64 off, u32 parity, u32 src) {
  return (u64*)(base + off) + (u64)parity * d.tp + src;
}

#endif  // DP_HOST_PROBE

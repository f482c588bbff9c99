"""The CUDA launch emulated on the CPU for the kernels of ``kernels/`` that include no
toolkit header (argmax.cu, verify.cu): g++ builds them with one ``std::thread`` per CUDA
thread walking the blocks in turn, ``std::barrier`` for ``__syncthreads`` (and after each
block, so that ``__shared__`` arrays, plain statics here, are free before the next block
starts), GCC atomics for ``atomicAdd`` / ``atomicMax`` / ``atomicCAS`` (:data:`ATOMICS`),
the warp intrinsics the kernels use (``__syncwarp``, ``__ballot_sync``, ``__shfl_sync``,
``__shfl_xor_sync``: a barrier per warp of 32 threads, or of the block's last, partial
warp, and an exchange slot per thread; the mask argument must name the whole warp, as the
kernels' does), and ``-ffp-contract=off`` (the device code's ``__*_rn`` intrinsics never
contract). :data:`HEADER` goes before the kernel source's ``#include``, :data:`LAUNCH`
after it; :func:`build` compiles and loads.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

KERNEL_DIR = Path(__file__).resolve().parents[1] / "kernels"

#: The warp intrinsics the kernels use, for any emulated launch: the launch calls
#: ``emu_warps_begin(block)`` before a block's threads start (needs ``<barrier>``,
#: ``<cstring>``, ``<memory>``, ``<vector>`` and ``threadIdx`` / ``blockDim``).
WARPS = r"""
// warps: one barrier each (32 threads, or the block's last, partial warp), one exchange
// slot per thread
static std::vector<std::unique_ptr<std::barrier<>>> g_warp_barriers;
static unsigned long long g_warp_slot[1024];
// before a block's threads start: a barrier per warp of `block` threads
inline void emu_warps_begin(unsigned block) {
  g_warp_barriers.clear();
  for (unsigned w = 0; w * 32 < block; ++w)
    g_warp_barriers.emplace_back(new std::barrier<>(block - w * 32 < 32 ? block - w * 32 : 32));
}
inline void __syncwarp(unsigned = 0xFFFFFFFFu) {
  g_warp_barriers[threadIdx.x / 32]->arrive_and_wait();
}
inline unsigned __popc(unsigned x) { return (unsigned)__builtin_popcount(x); }
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
template <typename T>
inline T emu_shfl_from(T v, unsigned src_lane) {  // every lane of the warp calls it
  static_assert(sizeof(T) <= 8, "a 4- or 8-byte value");
  unsigned long long w = 0;
  std::memcpy(&w, &v, sizeof(T));
  g_warp_slot[threadIdx.x] = w;
  __syncwarp();
  const unsigned base = threadIdx.x & ~31u;
  const unsigned width = blockDim.x - base < 32u ? blockDim.x - base : 32u;
  T out = v;  // a lane outside the warp: the caller's own value
  if (src_lane < width) std::memcpy(&out, &g_warp_slot[base + src_lane], sizeof(T));
  __syncwarp();
  return out;
}
template <typename T>
inline T __shfl_sync(unsigned, T v, int src) { return emu_shfl_from(v, (unsigned)src & 31u); }
template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int m) {
  return emu_shfl_from(v, (threadIdx.x & 31u) ^ (unsigned)m);
}
inline unsigned __ballot_sync(unsigned, bool p) {
  const unsigned base = threadIdx.x & ~31u;
  g_warp_slot[threadIdx.x] = p ? 1u : 0u;
  __syncwarp();
  const unsigned width = blockDim.x - base < 32u ? blockDim.x - base : 32u;
  unsigned out = 0;
  for (unsigned l = 0; l < width; ++l) out |= (unsigned)g_warp_slot[base + l] << l;
  __syncwarp();
  return out;
}
"""

#: The atomics the kernels use, on unsigned words: GCC ``__atomic`` builtins (shared by
#: tests/fakes/emulator.py).
ATOMICS = r"""
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
inline unsigned atomicMax(unsigned* p, unsigned v) {
  unsigned cur = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (cur < v &&
         !__atomic_compare_exchange_n(p, &cur, v, true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
  }
  return cur;
}
inline unsigned atomicCAS(unsigned* p, unsigned expected, unsigned desired) {
  __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return expected;
}
"""

HEADER = (
    r"""
#include <atomic>
#include <barrier>
#include <cmath>
#include <functional>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>
struct Dim { unsigned x = 0, y = 0, z = 0; };
thread_local Dim threadIdx, blockIdx;
Dim blockDim, gridDim;
static std::barrier<>* g_barrier = nullptr;
#define DP_ARGMAX_CPU_EMULATION 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
inline void __syncthreads() { g_barrier->arrive_and_wait(); }
#define __expf(x) std::exp(static_cast<float>(x))
"""
    + WARPS
    + ATOMICS
)

LAUNCH = r"""
static std::mutex g_launch;  // one kernel at a time: the statics stand for one SM
static void launch(unsigned grid, unsigned block, const std::function<void()>& body) {
  std::lock_guard<std::mutex> lock(g_launch);
  gridDim.x = grid;
  blockDim.x = block;
  std::barrier<> bar(block);
  g_barrier = &bar;
  emu_warps_begin(block);
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < block; ++t)
    threads.emplace_back([&, t]() {
      threadIdx.x = t;
      for (unsigned b = 0; b < grid; ++b) {
        blockIdx.x = b;
        body();
        bar.arrive_and_wait();
      }
    });
  for (auto& th : threads) th.join();
}
"""


def build(work: Path, source: str, name: str, flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Compile ``source`` (a C++ translation unit including kernels/ sources) into
    ``work/lib<name>.so`` and load it; skip the test when g++ or C++20 is missing."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip(f"needs g++ (C++20) to emulate the {name} kernels on the CPU")
    (work / f"{name}.cpp").write_text(source)
    lib_path = work / f"lib{name}.so"
    cmd = [gxx, "-std=c++20", "-O2", "-ffp-contract=off", "-Wall", "-Werror"]
    cmd += ["-Wno-unknown-pragmas", "-shared", "-fPIC", *flags, "-I", str(KERNEL_DIR)]
    cmd += [str(work / f"{name}.cpp"), "-o", str(lib_path), "-lpthread"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and ("barrier" in proc.stderr or "c++20" in proc.stderr):
        pytest.skip(f"g++ lacks C++20 <barrier>: {proc.stderr[-300:]}")
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr}"
    return ctypes.CDLL(str(lib_path))

"""The CUDA kernels of ``kernels/`` built with g++ and run on the CPU.

``kernels/nccl.cu``, ``kernels/argmax.cu`` and ``kernels/verify.cu`` include no toolkit
header, so g++ builds them with a few definitions: one ``std::thread`` per CUDA thread,
``std::barrier`` for ``__syncthreads``, the warp intrinsics of
``tests/_cuda_emulation.WARPS``, its GCC ``__atomic`` builtins for ``atomicAdd`` /
``atomicMax`` / ``atomicCAS`` (``ATOMICS``), blocks in turn, one kernel at a time, and
``-ffp-contract=off`` (the verify kernels' float decisions are IEEE basic operations
without contraction).
:func:`launch_params` is the emulated ``cuLaunchKernel``: it takes the kernel's name
and the same ``void**`` parameter block (every argument 8 bytes) that
:class:`ipc_dpsample.backends.common.PreparedLaunch` hands the driver, so the host
code's argument packing runs for real.

The verify and argmax kernels run with at most :data:`BLOCK_CAP` threads per block
whatever the launch asks (the verify kernels are correct for any power-of-two block up
to ``DV_BLOCK``, the argmax kernels for any block: a tree that folds odd halves and a
grid-stride loop, checked at blocks 1 to 64 by ``tests/test_argmax_kernels_cpu.py``;
256 ``std::thread`` per block would make every call take seconds on a small CPU). The
launch's own block size is logged in :attr:`Emulator.blocks`.
"""

from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
from _cuda_emulation import ATOMICS, WARPS

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"

_SOURCE = (
    r"""
#include <barrier>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>
struct Dim { unsigned x = 0, y = 0, z = 0; };
thread_local Dim threadIdx, blockIdx;
Dim blockDim, gridDim;
std::barrier<>* g_barrier = nullptr;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
inline void __syncthreads() { g_barrier->arrive_and_wait(); }
"""
    + WARPS
    + r"""
inline void __threadfence_system() {}
inline void __threadfence() {}
"""
    + ATOMICS
    + r"""
#define DP_ARGMAX_CPU_EMULATION 1
#define __shared__ static
#define __expf(x) std::exp(static_cast<float>(x))
#include "nccl.cu"
#include "argmax.cu"
#include "verify.cu"
static std::mutex g_launch;  // one kernel at a time (ranks may be threads of this process)
static void launch(int grid, int block, const std::function<void()>& body) {
  std::lock_guard<std::mutex> lock(g_launch);
  gridDim.x = grid;
  blockDim.x = block;
  for (int b = 0; b < grid; ++b) {
    std::barrier<> bar(block);
    g_barrier = &bar;
    emu_warps_begin(block);
    std::vector<std::thread> threads;
    for (int t = 0; t < block; ++t)
      threads.emplace_back([&, b, t]() { blockIdx.x = b; threadIdx.x = t; body(); });
    for (auto& th : threads) th.join();
  }
}
#define A15 a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], \
  a[13], a[14]
// Returns 0, or -1 for an unknown kernel name.
extern "C" int emu_launch(const char* name, int grid, int block, void** params, int nparams) {
  std::vector<u64> a(nparams > 0 ? nparams : 1);
  for (int i = 0; i < nparams; ++i) a[i] = *reinterpret_cast<const u64*>(params[i]);
  const std::string k(name);
  std::function<void()> body;
  if (k == "nccl_permute<Vec16>") body = [a]() { nccl_permute<Vec16>(A15); };
  else if (k == "nccl_permute<u64>") body = [a]() { nccl_permute<u64>(A15); };
  else if (k == "nccl_permute<u32>") body = [a]() { nccl_permute<u32>(A15); };
  else if (k == "nccl_permute<u16>") body = [a]() { nccl_permute<u16>(A15); };
  else if (k == "nccl_permute<u8>") body = [a]() { nccl_permute<u8>(A15); };
  else if (k == "nccl_header")
    body = [a]() { nccl_header(a[0], a[1], a[2], a[3], a[4], a[5]); };
  else if (k == "nccl_finish")
    body = [a]() { nccl_finish(a[0], a[1], a[2], a[3], a[4], a[5], a[6]); };
  else if (k == "nccl_verify_finish")
    body = [a]() { nccl_verify_finish(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]); };
  else if (k == "nccl_pack")
    body = [a]() {
      nccl_pack(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11]);
    };
  else if (k == "nccl_unpack")
    body = [a]() {
      nccl_unpack(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11]);
    };
  else if (k == "dp_argmax_partials")
    body = [a]() {
      dp_argmax_partials(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10]);
    };
  else if (k == "dp_argmax_combine")
    body = [a]() {
      dp_argmax_combine(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9]);
    };
  else if (k == "dp_verify_records")
    body = [a]() {
      dp_verify_records(A15, a[15], a[16], a[17], a[18], a[19], a[20]);
    };
  else if (k == "dp_verify_records_nolist")
    body = [a]() {
      dp_verify_records_nolist(A15, a[15], a[16], a[17], a[18], a[19], a[20]);
    };
  else if (k == "dp_verify_combine")
    body = [a]() {
      dp_verify_combine(A15, a[15], a[16], a[17], a[18], a[19], a[20], a[21], a[22]);
    };
  else return -1;
  launch(grid, block, body);
  return 0;
}
"""
)

#: Arguments of every emulated kernel (all 8 bytes wide).
ARITY: dict[str, int] = {
    **{f"nccl_permute<{v}>": 15 for v in ("Vec16", "u64", "u32", "u16", "u8")},
    "nccl_header": 6,
    "nccl_finish": 7,
    "nccl_verify_finish": 8,
    "nccl_pack": 12,
    "nccl_unpack": 12,
    "dp_argmax_partials": 11,
    "dp_argmax_combine": 10,
    "dp_verify_records": 21,
    "dp_verify_records_nolist": 21,
    "dp_verify_combine": 23,
}
#: Most threads per block the emulation runs of these kernels (see the module docstring).
BLOCK_CAP: dict[str, int] = {
    "dp_verify_records": 32,
    "dp_verify_records_nolist": 32,
    "dp_verify_combine": 32,
    "dp_argmax_partials": 32,
    "dp_argmax_combine": 32,
}


class Emulator:
    """The built library; :meth:`launch` runs one kernel."""

    def __init__(self, lib: Any):
        self.lib = lib
        #: ``(kernel name, grid, block)`` of every launch, as the caller asked
        self.blocks: list[tuple[str, int, int]] = []
        lib.emu_launch.argtypes = [
            ctypes.c_char_p,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_int,
        ]
        lib.emu_launch.restype = ctypes.c_int

    def launch_params(self, name: str, grid: int, block: int, params: int, nparams: int) -> None:
        """Run ``name`` on ``grid`` x ``block`` with a ``void**`` parameter block."""
        self.blocks.append((name, grid, block))
        run_block = min(block, BLOCK_CAP.get(name, block))
        rc = self.lib.emu_launch(name.encode(), grid, run_block, params, nparams)
        assert rc == 0, f"the emulator has no kernel {name!r}"

    def launch(self, name: str, grid: int, block: int, *args: int) -> None:
        """Run ``name`` with ``args`` (each passed as 8 bytes, as the host does)."""
        assert len(args) == ARITY[name], f"{name} takes {ARITY[name]} arguments, got {len(args)}"
        vals = (ctypes.c_uint64 * max(1, len(args)))(*[a & (2**64 - 1) for a in args])
        base = ctypes.addressof(vals)
        ptrs = (ctypes.c_void_p * max(1, len(args)))(*[base + 8 * i for i in range(len(args))])
        self.launch_params(name, grid, block, ctypes.addressof(ptrs), len(args))


@functools.cache
def _build() -> Emulator | str:
    gxx = shutil.which("g++")
    if gxx is None:
        return "needs g++ (C++20) to emulate the kernels on the CPU"
    work = Path(tempfile.mkdtemp(prefix="dp_emulator_"))
    (work / "emulate.cpp").write_text(_SOURCE)
    lib_path = work / "libemulation.so"
    cmd = [gxx, "-std=c++20", "-O1", "-ffp-contract=off", "-shared", "-fPIC", "-I", str(KERNEL_DIR)]
    cmd += [str(work / "emulate.cpp"), "-o", str(lib_path), "-lpthread"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and "barrier" in proc.stderr:
        return f"g++ lacks C++20 <barrier>: {proc.stderr[-300:]}"
    assert proc.returncode == 0, proc.stderr
    return Emulator(ctypes.CDLL(str(lib_path)))


def emulator() -> Emulator:
    """The emulator (built once per process); skips the test where g++ cannot."""
    built = _build()
    if isinstance(built, str):
        pytest.skip(built)
    return built

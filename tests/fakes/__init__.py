"""Stand-ins for what the GPU backends touch below their own code: NCCL (an
in-process fabric between ranks that are threads), the CUDA runtime/driver surface
of CuPy (events, capture status, ``cuLaunchKernel``), device buffers (host arrays)
and the kernels themselves (``kernels/*.cu`` compiled with g++ and run on CPU
threads, :mod:`fakes.emulator`).

Import as ``fakes.<module>`` (``tests/`` is on ``sys.path`` via conftest).
"""

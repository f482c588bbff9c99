"""Backends: one identical interface (:class:`~ipc_dpsample.backends.base.Backend`)
implemented by the one-sided CUDA IPC kernels, NCCL through CuPy, and
torch.distributed."""

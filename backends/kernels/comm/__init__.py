"""Tensor-parallel communication kernels: the one-shot all-reduce and the all-reduce fused with the residual add and
RMSNorm, over symmetric (CUDA IPC) buffers, without NVLink multicast (:mod:`~backends.kernels.comm.peer_allreduce`
launches the kernels of :mod:`~backends.kernels.comm.comm_kernels`; docs/parallelism.md)."""

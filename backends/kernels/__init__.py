"""Triton and Gluon kernels of the backends and the model, one package per family; each family's launchers sit beside
its ``@triton.jit`` code (``<name>.py`` launches, ``<name>_kernels.py`` holds the kernels).

* :mod:`backends.kernels.mla_decode`: absorbed-MLA split-KV decode over a paged latent cache (Triton stage 1 and
  merge, the Gluon wgmma stage 1 for Hopper, the plan kernel) and the torch emulation of the Blackwell MLA decode
  kernels' calling contracts;
* :mod:`backends.kernels.mla_extend`: absorbed-MLA causal extend / prefill over the paged cache;
* :mod:`backends.kernels.sparse`: DeepSeek-V3.2 sparse attention (sparse MLA decode, the indexer top-k) and
  HiSparse's host <-> device row copies;
* :mod:`backends.kernels.dsv4`: DeepSeek-V4 attention (decode, extend, the batched indexer, the torch reference and
  the emulation of FlashInfer's V4 sparse decode);
* :mod:`backends.kernels.gemm`: few-row linear layers and MoE experts, block-fp8 linear layers and experts;
* :mod:`backends.kernels.decoder`: the fused decoder-layer elementwise ops.

Shared by all families, at this level: :mod:`backends.kernels.checks` (argument checks, interpreter detection),
:mod:`backends.kernels.pdl` (programmatic dependent launch), :mod:`backends.kernels.sm_count` (per-device SM count
and compute capability). Import launchers from their modules (``from backends.kernels.mla_decode.mla_decode import
mla_decode``); the packages re-export nothing.
"""

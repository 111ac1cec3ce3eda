"""Absorbed-MLA decode (one query token per request) over a paged latent KV cache: the launcher
(:mod:`~backends.kernels.mla_decode.mla_decode`), the Triton split-KV stage 1 and merge, the decode plan kernel, the
Gluon wgmma stage-1 kernels for Hopper (:mod:`~backends.kernels.mla_decode.mla_decode_wgmma` launches them), and the
torch emulation of the Blackwell MLA decode kernels' calling contracts
(:mod:`~backends.kernels.mla_decode.emulated_mla`).
"""

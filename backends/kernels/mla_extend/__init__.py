"""Absorbed-MLA extend / prefill (causal, bottom-right aligned) over a paged latent KV cache: the launcher
(:mod:`~backends.kernels.mla_extend.mla_extend`) and its Triton kernel."""

"""DeepSeek-V4 attention: decode and extend over gathered rows with per-head sinks
(:mod:`~backends.kernels.dsv4.dsv4_decode`, :mod:`~backends.kernels.dsv4.dsv4_extend`), the batched lightning indexer
(:mod:`~backends.kernels.dsv4.dsv4_indexer`), mHC around each block (:mod:`~backends.kernels.dsv4.hc_mix`), a
compressor's fused decode step (:mod:`~backends.kernels.dsv4.compress_decode`), the RoPE tail of q, kv and the
output (:mod:`~backends.kernels.dsv4.rope_tail`), the torch reference
(:mod:`~backends.kernels.dsv4.dsv4_reference`), and the torch emulation of FlashInfer's V4 sparse MLA decode contract
(:mod:`~backends.kernels.dsv4.emulated_dsv4`).
"""

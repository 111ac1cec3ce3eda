"""Fused decoder-layer ops (:mod:`~backends.kernels.decoder.decoder_ops` launches the kernels of
:mod:`~backends.kernels.decoder.decoder_kernels`), each matching the unfused torch path's rounding."""

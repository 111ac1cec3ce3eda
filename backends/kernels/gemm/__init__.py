"""Matrix products of the model's linear layers and MoE experts: few-row (decode) products in the model dtype
(:mod:`~backends.kernels.gemm.skinny`), block-fp8 linear layers (:mod:`~backends.kernels.gemm.fp8_gemm`), block-fp8
MoE experts (:mod:`~backends.kernels.gemm.fp8_moe`) and DeepSeek-V4's packed fp4 experts
(:mod:`~backends.kernels.gemm.fp4_moe`), each launcher beside its ``*_kernels`` module.
"""

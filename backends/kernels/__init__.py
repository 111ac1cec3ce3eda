"""Triton kernels for absorbed MLA over a paged latent KV cache: split-KV decode and causal extend."""

from backends.kernels.mla_decode import (
    DEFAULT_MAX_SPLITS,
    decode_workspace_bytes,
    decode_workspace_shapes,
    mla_decode,
)
from backends.kernels.mla_extend import mla_extend

__all__ = [
    "DEFAULT_MAX_SPLITS",
    "decode_workspace_bytes",
    "decode_workspace_shapes",
    "mla_decode",
    "mla_extend",
]

"""Triton kernels: paged attention over the radixserve KV pool, and the forward's fused ops.

Owns: the kernel wrappers below (each checks its arguments and launches its kernel). Plain-torch
equivalents live in `triton_kernels.reference`. Importing this package needs triton, not CUDA;
to run the kernels on CPU tensors set TRITON_INTERPRET=1 before triton is first imported
(see triton_kernels.testing).
"""

from __future__ import annotations

from triton_kernels.decode_attention import decode_attention
from triton_kernels.extend_attention import extend_attention
from triton_kernels.fused_add_rmsnorm import fused_add_rmsnorm, rms_norm
from triton_kernels.rope import rope_qk, rope_qk_store
from triton_kernels.silu_mul import silu_mul
from triton_kernels.store_kv import store_kv

__all__ = ["decode_attention", "extend_attention", "fused_add_rmsnorm", "rms_norm", "rope_qk",
           "rope_qk_store", "silu_mul", "store_kv"]

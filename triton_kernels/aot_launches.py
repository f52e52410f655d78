"""What aot_check compiles for the attention and elementwise kernels: each kernel's parameter
types and the constexprs its wrapper passes on a GPU, over a set of model shapes (CASES).

Owns: Launch (one compile: kernel, types, constexprs, warps, stages), the shapes, and the
launches of store_kv, decode (split and merge), extend, RMSNorm, RoPE(+store) and silu_mul.
Does not know: compiling (aot_check.py), the GEMM kernels' launches (aot_gemm.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton

from triton_kernels.decode_attention import (
    MAX_SPLITS,
    _decode_merge_kernel,
    _decode_split_kernel,
    decode_config,
)
from triton_kernels.extend_attention import _extend_kernel, extend_config
from triton_kernels.fused_add_rmsnorm import _rmsnorm_kernel
from triton_kernels.rope import _rope_kernel
from triton_kernels.silu_mul import BLOCK as SILU_BLOCK
from triton_kernels.silu_mul import _silu_mul_kernel
from triton_kernels.store_kv import _store_kv_kernel

FUSED_KERNELS = (_rmsnorm_kernel, _rope_kernel, _silu_mul_kernel)  # launched without FP fusion
CUDA = torch.device("cuda")  # only its type is read: picks the GPU launch configs
PTR = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16",
       torch.float8_e4m3fn: "*fp8e4nv", torch.float8_e5m2: "*fp8e5"}


class Case(NamedTuple):
    dtype: torch.dtype
    head_dim: int
    kv_heads: int
    group: int
    kv_dtype: torch.dtype | None = None  # an 8-bit KV cache (with scales); None: dtype


class Launch(NamedTuple):
    kernel: Any  # a triton JITFunction
    types: dict[str, str]  # non-constexpr parameter -> Triton type
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int


CASES = (Case(torch.bfloat16, 128, 8, 4), Case(torch.bfloat16, 64, 3, 3),
         Case(torch.float16, 64, 2, 8), Case(torch.float32, 128, 2, 3),
         Case(torch.float32, 16, 2, 2), Case(torch.bfloat16, 128, 8, 4, torch.float8_e4m3fn),
         Case(torch.bfloat16, 64, 3, 3, torch.float8_e5m2))


def quant_constexprs(c: Case, quant: bool) -> dict[str, Any]:
    """store_kv.quantize_kv's constexprs for this case's KV dtype (GPU: no pre-rounding)."""
    e4m3 = c.kv_dtype == torch.float8_e4m3fn
    return {"QUANT": quant, "FP8_MAX": float(torch.finfo(c.kv_dtype).max) if quant and c.kv_dtype
            else 0.0, "PRE_ROUND": False, "MAN_BITS": 3 if e4m3 else 2,
            "MIN_EXP": -6 if e4m3 else -14}


def launches(c: Case) -> list[Launch]:
    t, g_pad, bd = PTR[c.dtype], triton.next_power_of_2(c.group), max(16, c.head_dim)
    kv, quant = PTR[c.kv_dtype or c.dtype], c.kv_dtype is not None
    prec = "ieee" if c.dtype == torch.float32 else "tf32"
    dec, ext = decode_config(CUDA, c.dtype), extend_config(CUDA, c.dtype)
    block_r = max(ext.block_r, g_pad)
    scales = {"k_scale": "*fp32", "v_scale": "*fp32"}
    attn = {"q": t, "k_cache": kv, "v_cache": kv, "slot_table": "*i32", "rows": "*i64",
            "qk_scale": "fp32", "softcap2": "fp32", **scales}
    # the cases with 3 KV heads compile the sliding-window and soft-capped variants (Gemma's)
    window = {"WINDOW": 1024 if c.kv_heads == 3 else 0, "SOFTCAP": c.kv_heads == 3}
    return [
        Launch(_store_kv_kernel,
               {"k_cache": kv, "v_cache": kv, "k": t, "v": t, "slots": "*i64", **scales,
                "stride_kt": "i32", "stride_kh": "i32", "stride_vt": "i32", "stride_vh": "i32"},
               {"NUM_HEADS": c.kv_heads, "HEAD_DIM": c.head_dim,
                "BLOCK_H": triton.next_power_of_2(c.kv_heads), "BLOCK_D": bd,
                **quant_constexprs(c, quant)},
               4, 3),
        Launch(_decode_split_kernel,
               {**attn, "seq_lens": "*i32", "mid_o": "*fp32", "mid_lse": "*fp32",
                "stride_qb": "i32", "stride_qh": "i32", "stride_table": "i32",
                "num_splits": "i32"},
               {"NUM_KV_HEADS": c.kv_heads, "GROUP": c.group, "HEAD_DIM": c.head_dim,
                "NUM_SPLITS": MAX_SPLITS, "BLOCK_G": max(16, g_pad), "BLOCK_D": bd,
                "BLOCK_N": dec.block_n, "DOT_PRECISION": prec, "UPCAST": False, "QUANT": quant,
                **window},
               dec.num_warps, 2),
        Launch(_decode_merge_kernel,
               {"mid_o": "*fp32", "mid_lse": "*fp32", "seq_lens": "*i32", "out": t,
                "stride_ob": "i32", "stride_oh": "i32", "num_splits": "i32"},
               {"NUM_Q_HEADS": c.kv_heads * c.group, "HEAD_DIM": c.head_dim,
                "NUM_SPLITS": MAX_SPLITS, "BLOCK_S": MAX_SPLITS, "BLOCK_D": bd,
                "BLOCK_N": dec.block_n, "WINDOW": window["WINDOW"]}, 4, 2),
        Launch(_extend_kernel,
               {**attn, "prefix_lens": "*i32", "extend_lens": "*i32", "cu_extend": "*i32",
                "out": t, "stride_qt": "i32", "stride_qh": "i32", "stride_ot": "i32",
                "stride_oh": "i32", "stride_table": "i32"},
               {"NUM_KV_HEADS": c.kv_heads, "GROUP": c.group, "G_PAD": g_pad,
                "HEAD_DIM": c.head_dim, "BLOCK_R": block_r, "BLOCK_D": bd,
                "BLOCK_M": block_r // g_pad, "BLOCK_N": ext.block_n, "DOT_PRECISION": prec,
                "UPCAST": False, "QUANT": quant, **window}, ext.num_warps, ext.num_stages),
    ]


def fused_launches(c: Case) -> list[Launch]:
    """The elementwise kernels at this case's shapes (hidden = the q width, inter = 4 hidden)."""
    t, q_heads = PTR[c.dtype], c.kv_heads * c.group
    hidden = q_heads * c.head_dim
    norm = {"x": t, "residual": t, "weight": t, "out": t, "eps": "fp32", "stride_x": "i32",
            "stride_r": "i32", "stride_o": "i32"}
    block = triton.next_power_of_2(hidden)
    kv = PTR[c.kv_dtype or c.dtype]
    rope = {"qkv": t, "cos": t, "sin": t, "positions": "*i64", "k_cache": kv, "v_cache": kv,
            "slots": "*i64", "k_scale": "*fp32", "v_scale": "*fp32", "stride_t": "i32"}
    return [
        *(Launch(_rmsnorm_kernel, norm, {"N": hidden, "BLOCK": block, "HAS_RESIDUAL": res},
                 max(1, min(16, block // 256)), 3) for res in (False, True)),
        *(Launch(_rope_kernel, rope,
                 {"NUM_Q_HEADS": q_heads, "NUM_KV_HEADS": c.kv_heads, "HEAD_DIM": c.head_dim,
                  "BLOCK_HQ": triton.next_power_of_2(q_heads),
                  "BLOCK_HK": triton.next_power_of_2(c.kv_heads),
                  "BLOCK_HALF": triton.next_power_of_2(c.head_dim // 2), "STORE": store,
                  **quant_constexprs(c, store and c.kv_dtype is not None)},
                 4, 3) for store in (False, True)),
        Launch(_silu_mul_kernel, {"gate_up": t, "out": t, "stride_g": "i32", "stride_o": "i32"},
               {"INTER": 4 * hidden, "BLOCK_N": SILU_BLOCK}, 4, 3),
    ]

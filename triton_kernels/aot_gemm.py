"""What aot_check compiles for the GEMM-like kernels: the fused MoE (float and quantized
experts), the quantized GEMMs
(W4A16 and FP8 W8A8) and LoRA's shrink/expand (SGMV and BGMV), at the constexprs their
wrappers pass on a GPU.

Owns: those kernels' parameter types and constexpr combinations. A constexpr that takes one
value per model shape (a group size, a rank bound) is compiled at the smallest and the
largest tiles the wrappers can pick, and one between; the others (dtype, dot precision, the
FP8 K tile) at every value; a value that follows the batch (the MoE's pair count) is a
runtime argument, not a constexpr. Does not know: compiling (aot_check.py), what
the kernels compute.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from triton_kernels import fused_moe, fused_moe_quant, lora_expand, lora_shrink, quant_gemm
from triton_kernels._common import next_pow2
from triton_kernels.aot_launches import PTR, Launch

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
I32 = "i32"


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _precision(dtype: torch.dtype) -> str:
    """triton_kernels._common.dot_flags on CUDA: IEEE fp32, TF32 never (no upcast there)."""
    return "ieee" if dtype == F32 else "tf32"


def _moe_pair(dtype: torch.dtype, hidden: int, inter: int, top_k: int, w: str,
              quant: dict[str, Any]) -> Iterator[Launch]:
    """fused_moe's two kernels on weights of pointer type `w` (`quant`: KIND, GROUP)."""
    m, t = fused_moe, PTR[dtype]
    common = {"HIDDEN": hidden, "INTER": inter,
              "BLOCK_M": m.BLOCK_M, "BLOCK_N": m.BLOCK_N, "BLOCK_K": m.BLOCK_K,
              "DOT_PRECISION": _precision(dtype), "UPCAST": False, **quant}
    scales = {"ws": t if w == t else "*fp32", "wz": t if w == t else "*fp32",
              "stride_se": I32, "stride_sn": I32, "num_pairs": I32}
    yield Launch(m._gate_up_kernel,
                 {"x": t, "w": w, "sorted_pairs": "*i32", "block_experts": "*i32",
                  "act": t, "stride_x": I32, "stride_we": I32, "stride_wn": I32,
                  "stride_a": I32, **scales}, {**common, "TOP_K": top_k}, 4, 3)
    yield Launch(m._down_kernel,
                 {"act": t, "w": w, "weights": t, "sorted_pairs": "*i32",
                  "block_experts": "*i32", "out": t, "stride_a": I32, "stride_we": I32,
                  "stride_wn": I32, "stride_o": I32, **scales}, common, 4, 3)


def moe_launches() -> Iterator[tuple[Launch, str]]:
    """fused_moe's two kernels: (dtype, hidden, inter, top-k) of Qwen3-MoE in bf16,
    Mixtral in fp16, and odd fp32 sizes (every tile edge masked); and on quantized experts
    (fused_moe_quant.py): W4A16 groups of 128 (Qwen3-MoE) and 32, W8A16 and FP8 per channel,
    FP8 blocks of 128 (DeepSeek / Qwen3-FP8). The pair count is a runtime argument: one
    compile serves every batch size."""
    q = fused_moe_quant
    for dtype, hidden, inter, top_k in ((BF16, 2048, 768, 8), (F16, 4096, 14336, 2),
                                        (F32, 96, 80, 3)):
        label = f"{_name(dtype):<9} hidden={hidden} inter={inter} top_k={top_k}"
        for launch in _moe_pair(dtype, hidden, inter, top_k, PTR[dtype],
                                {"KIND": q.FLOAT, "GROUP": 1}):
            yield launch, label
    for dtype, kind, w, group in ((BF16, q.INT4, "*u8", 128), (F16, q.INT4, "*u8", 32),
                                  (BF16, q.INT8, "*u8", 2048), (BF16, q.FP8, "*fp8e4nv", 2048),
                                  (BF16, q.FP8, "*fp8e4nv", 128)):
        name = {q.INT4: "int4", q.INT8: "int8", q.FP8: "fp8"}[kind]
        for launch in _moe_pair(dtype, 2048, 768, 8, w, {"KIND": kind, "GROUP": group}):
            yield launch, f"{_name(dtype):<9} moe {name} group={group}"


def quant_launches() -> Iterator[tuple[Launch, str]]:
    """W4A16 per activation dtype (groups of 128, 32, and one group per row of a 4096-wide
    K); FP8 W8A8 at every K tile fp8_block_k picks (128, 64, 32, and 16, upcast)."""
    q = quant_gemm
    for dtype, group in ((BF16, 128), (F16, 32), (F32, 4096)):
        yield Launch(q._w4a16_kernel,
                     {"x": PTR[dtype], "codes": "*u8", "scale": "*fp32", "zero": "*fp32",
                      "out": "*fp32", "M": I32, "N": I32, "K": I32, "stride_xm": I32,
                      "stride_cn": I32, "stride_sn": I32, "K_PER_SPLIT": I32},
                     {"GROUP": group, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64,
                      "DOT_PRECISION": _precision(dtype), "UPCAST": False},
                     4, 3), f"{_name(dtype):<9} int4 group={group}"
    for k, group in ((7168, 128), (4096, 4096), (48, 48), (4096, 16)):
        block_k = q.fp8_block_k(k, min(group, k))
        yield Launch(q._fp8_kernel,
                     {"xq": "*fp8e4nv", "xs": "*fp32", "wq": "*fp8e4nv", "ws": "*fp32",
                      "out": "*fp32", "M": I32, "N": I32, "K": I32, "G": I32,
                      "stride_xm": I32, "stride_wn": I32},
                     {"GROUP": min(group, k), "BLOCK_M": 16, "BLOCK_N": 64,
                      "BLOCK_K": block_k, "UPCAST": block_k < q.FP8_DOT_MIN_K},
                     4, 3), f"fp8 w8a8  group={group} block_k={block_k}"


def lora_launches() -> Iterator[tuple[Launch, str]]:
    """Shrink and expand, SGMV and BGMV, per dtype: the rank bound (parts * --max-lora-rank)
    of rank 1 (BGMV's smallest tile), 16 (the default) and qkv's 3 * 64."""
    s, e = lora_shrink, lora_expand
    seg = {"seg_start": "*i32", "seg_len": "*i32", "seg_slot": "*i32"}
    for dtype, rank in ((BF16, 1), (F16, 16), (F32, 3 * 64)):
        t, label = PTR[dtype], f"{_name(dtype):<9} rank_bound={rank}"
        sgmv_r, bgmv_r = max(16, next_pow2(rank)), next_pow2(rank)
        yield Launch(s._sgmv_shrink_kernel,
                     {"x": t, "a": t, "out": "*fp32", **seg, "stride_x": I32,
                      "stride_as": I32, "stride_ar": I32, "stride_o": I32, "K": I32, "R": I32},
                     {"BLOCK_M": s.BLOCK_M, "BLOCK_R": sgmv_r, "BLOCK_K": s.BLOCK_K},
                     4, 3), label
        yield Launch(s._bgmv_shrink_kernel,
                     {"x": t, "a": t, "out": "*fp32", "token_slot": "*i32", "stride_x": I32,
                      "stride_as": I32, "stride_ar": I32, "stride_o": I32, "K": I32, "R": I32},
                     {"BLOCK_R": bgmv_r, "BLOCK_K": s.BLOCK_K}, 4, 3), label
        yield Launch(e._sgmv_expand_kernel,
                     {"t": "*fp32", "b": t, "y": t, **seg, "stride_t": I32, "stride_bs": I32,
                      "stride_bn": I32, "stride_y": I32, "N": I32, "R": I32},
                     {"BLOCK_M": e.BLOCK_M, "BLOCK_N": e.BLOCK_N, "BLOCK_R": sgmv_r},
                     4, 3), label
        yield Launch(e._bgmv_expand_kernel,
                     {"t": "*fp32", "b": t, "y": t, "token_slot": "*i32", "stride_t": I32,
                      "stride_bs": I32, "stride_bn": I32, "stride_y": I32, "N": I32, "R": I32},
                     {"BLOCK_N": e.BLOCK_N, "BLOCK_R": bgmv_r}, 4, 3), label


def gemm_launches() -> list[tuple[Launch, str]]:
    return [*moe_launches(), *quant_launches(), *lora_launches()]

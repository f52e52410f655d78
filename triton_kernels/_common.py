"""Checks and launch parameters shared by the kernel wrappers.

Owns: the argument checks every wrapper runs (shapes, strides, dtypes, devices) and the
compile-time flags derived from the inputs. Does not know: any kernel's algorithm.

NOTE (interpreter): Triton's CPU interpreter (TRITON_INTERPRET=1) computes `tl.dot` on bf16 and
fp16 operands as an integer matmul of their raw bits (seen with triton 3.9), so on CPU tensors
the kernels upcast dot operands to fp32 first. That is exact: a product of two bf16 values fits
in fp32, and the GPU path accumulates in fp32 as well.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from triton.runtime.interpreter import InterpretedFunction

KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # with per-KV-head scales


class KernelDeviceError(RuntimeError):
    """The kernels were compiled for a GPU but got tensors on another device."""


def is_interpreted(kernel: object) -> bool:
    """Whether `kernel` was decorated while TRITON_INTERPRET=1 (so it runs on CPU tensors)."""
    return isinstance(kernel, InterpretedFunction)


def check_launchable(kernel: object, device: torch.device) -> None:
    if device.type == "cuda" or is_interpreted(kernel):
        return
    raise KernelDeviceError(
        f"Triton kernels need CUDA tensors, got {device}; to run them on CPU set "
        "TRITON_INTERPRET=1 before triton is first imported"
    )


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The pool layout: two contiguous (num_slots, kv_heads, head_dim) tensors alike."""
    assert k_cache.dim() == 3, f"k_cache must be (num_slots, kv_heads, head_dim), got {k_cache.shape}"
    assert k_cache.shape == v_cache.shape, f"{k_cache.shape} != {v_cache.shape}"
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in KV_DTYPES + FP8_KV_DTYPES, (
        f"unsupported KV dtypes {k_cache.dtype}, {v_cache.dtype}"
    )
    assert k_cache.device == v_cache.device
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "KV caches must be contiguous"


def check_kv_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None, dtype: torch.dtype) -> bool:
    """Whether the caches are 8-bit (then k_scale, v_scale are their (kv_heads,) float32
    scales, and the other operands are in `dtype`); else the caches are in `dtype` itself."""
    quant = k_cache.dtype in FP8_KV_DTYPES
    assert quant == (k_scale is not None and v_scale is not None), (
        "k_scale and v_scale: given exactly when the KV cache is 8-bit")
    assert quant or k_cache.dtype == dtype, (
        f"the KV cache dtype {k_cache.dtype} differs from the operands' dtype {dtype}")
    if k_scale is not None and v_scale is not None:
        for s in (k_scale, v_scale):
            assert s.shape == (k_cache.shape[1],) and s.dtype == torch.float32, (
                f"scales must be ({k_cache.shape[1]},) float32, got {tuple(s.shape)} {s.dtype}")
            assert s.device == k_cache.device and s.stride(0) == 1
    return quant


def check_heads_last_contiguous(name: str, x: torch.Tensor, heads: int, head_dim: int) -> None:
    """(tokens, heads, head_dim) with any token stride (a view into a fused qkv is fine)."""
    assert x.dim() == 3 and x.shape[1:] == (heads, head_dim), (
        f"{name} must be (tokens, {heads}, {head_dim}), got {tuple(x.shape)}"
    )
    assert x.stride(2) == 1, f"{name} must be contiguous in head_dim, strides {x.stride()}"


def check_index(name: str, x: torch.Tensor, length: int, device: torch.device) -> None:
    assert x.dim() == 1 and x.shape[0] == length, f"{name} must be ({length},), got {x.shape}"
    assert x.dtype in (torch.int32, torch.int64), f"{name} must be an integer tensor"
    assert x.device == device, f"{name} is on {x.device}, expected {device}"
    assert x.stride(0) == 1, f"{name} must be contiguous"


class PagedShape(NamedTuple):
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    quant: bool  # an 8-bit pool, read with per-KV-head scales


def check_paged_operands(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                         slot_table: torch.Tensor, rows: torch.Tensor, batch: int
                         ) -> PagedShape:
    """What both paged attention wrappers check: the pool, q's heads against it (q is
    (tokens, q_heads, head_dim)), an 8-bit pool's scales, the slot table, the table rows."""
    check_kv_cache(k_cache, v_cache)
    _, num_kv_heads, head_dim = k_cache.shape
    num_q_heads = q.shape[1]
    assert num_q_heads % num_kv_heads == 0, f"{num_q_heads} q heads, {num_kv_heads} kv heads"
    check_heads_last_contiguous("q", q, num_q_heads, head_dim)
    assert q.device == k_cache.device
    quant = check_kv_scales(k_cache, k_scale, v_scale, q.dtype)
    check_slot_table(slot_table, q.device)
    check_index("rows", rows, batch, q.device)
    return PagedShape(num_q_heads, num_kv_heads, head_dim, quant)


def check_slot_table(slot_table: torch.Tensor, device: torch.device) -> None:
    assert slot_table.dim() == 2, f"slot_table must be (max_reqs, max_model_len), got {slot_table.shape}"
    assert slot_table.dtype in (torch.int32, torch.int64), "slot_table must be an integer tensor"
    assert slot_table.device == device, f"slot_table is on {slot_table.device}, expected {device}"
    assert slot_table.stride(1) == 1, "slot_table rows must be contiguous"


def check_out(out: torch.Tensor, shape: tuple[int, ...], like: torch.Tensor) -> None:
    assert tuple(out.shape) == shape, f"out must be {shape}, got {tuple(out.shape)}"
    assert out.dtype == like.dtype and out.device == like.device
    assert out.stride(2) == 1, "out must be contiguous in head_dim"


def check_lora_operands(x: torch.Tensor, stack: torch.Tensor, y: torch.Tensor, *,
                        fp32: torch.Tensor, token_slot: torch.Tensor | None = None) -> None:
    """Either half of a LoRA delta, as one shape: y (T, N) from x (T, K) and each slot's
    weight in stack (S, N, K) (shrink: x, A, t; expand: t, B, y). `fp32`: whichever of x and y
    is the rank-wide buffer t, which is float32; `token_slot` (T,): the per-token (BGMV) form."""
    assert x.dim() == 2 and stack.dim() == 3 and y.dim() == 2, (
        f"x (T, K), stack (S, N, K), y (T, N): got {tuple(x.shape)}, {tuple(stack.shape)}, "
        f"{tuple(y.shape)}")
    tokens, k = x.shape
    assert stack.shape[2] == k, f"stack {tuple(stack.shape)} vs x {tuple(x.shape)}"
    want = (tokens, stack.shape[1])
    assert tuple(y.shape) == want, f"y must be {want}, got {tuple(y.shape)}"
    assert fp32.dtype == torch.float32, f"t (T, R) must be float32, got {fp32.dtype}"
    assert x.stride(1) == 1 and stack.stride(2) == 1 and y.stride(1) == 1, (
        "x, stack and y must be contiguous in their last dimension")
    assert x.device == stack.device == y.device, (x.device, stack.device, y.device)
    if token_slot is not None:
        assert tuple(token_slot.shape) == (tokens,), (
            f"token_slot must be ({tokens},), got {tuple(token_slot.shape)}")


def dot_flags(device: torch.device, dtype: torch.dtype) -> tuple[str, bool]:
    """(input_precision for tl.dot, whether to upcast dot operands to fp32).

    fp32 inputs use "ieee": the default "tf32" keeps only 10 mantissa bits (~1e-3 error).
    """
    precision = "ieee" if dtype == torch.float32 else "tf32"
    return precision, device.type == "cpu"


def next_pow2(n: int) -> int:
    """triton.next_power_of_2 on the host: the same values, without its ~2 us call (it is a
    ConstexprFunction, callable from kernels, and pays for that wrapper on every host call)."""
    return 0 if n == 0 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """triton.cdiv on the host, without its ConstexprFunction wrapper (see next_pow2)."""
    return -(-a // b)


def block_d(head_dim: int) -> int:
    assert head_dim >= 16, f"head_dim {head_dim} < 16 is not supported by tl.dot"
    return next_pow2(head_dim)

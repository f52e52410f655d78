"""Fused mixture-of-experts: grouped GEMMs over blocks of expert-sorted (token, expert) pairs.

Owns: the device-side alignment of the routed pairs into expert blocks (`moe_align`), the two
kernels and the wrapper `fused_moe`. Does not know: routing (the caller passes top-k weights
and ids), checkpoints, parallel collectives.

Design (as vLLM's fused_moe and SGLang's, written anew):
1. `moe_align` (torch ops on the device, no host sync, so CUDA-graph capturable): the T * k
   pairs sorted by local expert (stable), each expert's run padded to a multiple of BLOCK_M,
   giving `sorted_pairs` (padding = the sentinel T * k) and `block_experts`, the local expert
   of each BLOCK_M block (-1: a block past the used length, or pairs of another rank's
   experts under expert parallelism). Every buffer has a size fixed by (T, k, E_local,
   BLOCK_M): the bound T * k + min(E_local, T * k) * (BLOCK_M - 1).
2. `_gate_up_kernel`: per (block, F tile): the block's token rows gathered from x, times the
   expert's gate rows and up rows (two fp32 accumulators over the same loads of x), then
   silu(gate) * up stored to the pair's row of `act` (T * k, F): gate/up and SiLU-mul fused.
3. `_down_kernel`: per (block, hidden tile): act rows times the expert's down weight, scaled
   by the pair's top-k weight, stored to the pair's row of `pair_out` (T * k, hidden).
4. torch sums each token's k rows (pairs of other ranks' experts stay zero).
Quantized experts (W4A16, W8A16, FP8 weight-only): both kernels load their B tile through
fused_moe_quant.weight_tile, which dequantizes the codes to the activations' dtype in
registers (a float weight's tile it loads as it is).
Numerics: fp32 accumulation; the GEMM outputs, silu, the product and the weighted output are
rounded to the activation dtype as torch's chain of ops rounds them (fp32: within 1e-5 of
torch's; bf16: within a bf16 step or two, the sums run in another order).
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (triton is untyped, and @triton.jit kernel parameters carry no Python types.)

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from triton_kernels._common import KV_DTYPES, cdiv, check_launchable, dot_flags
from triton_kernels._rounding import round_to
from triton_kernels.fused_moe_quant import MoEQuantWeight, expert_shape, kernel_args, weight_tile

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64
Experts = torch.Tensor | MoEQuantWeight  # float in x's dtype, or quantized


class Aligned(NamedTuple):
    sorted_pairs: torch.Tensor  # (max_padded,) int32 pair index (token * k + slot), sentinel T*k
    block_experts: torch.Tensor  # (max_padded / BLOCK_M,) int32 local expert, -1: skip


def max_padded_len(num_pairs: int, num_local: int, block_m: int) -> int:
    return cdiv(num_pairs + min(num_local, num_pairs) * (block_m - 1), block_m) * block_m


def moe_align(expert_ids: torch.Tensor, first_expert: int, num_local: int,
              block_m: int = BLOCK_M) -> Aligned:
    """The pairs routed to experts [first_expert, first_expert + num_local) in expert blocks
    of `block_m` (see the module docstring); device ops only, shapes fixed by the inputs'."""
    num_pairs, dev = expert_ids.numel(), expert_ids.device
    key = expert_ids.reshape(-1).to(torch.int64) - first_expert  # (P,) local expert
    key = torch.where((key >= 0) & (key < num_local), key, num_local)  # others: a last bucket
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))  # not bincount: no host sync
    counts = counts[:num_local]  # (E_local,)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)  # (E_local,) end of each expert's padded run
    starts, run_starts = ends - padded, torch.cumsum(counts, 0) - counts
    sorted_key, order = torch.sort(key, stable=True)  # (P,) each
    local = sorted_key < num_local
    e = sorted_key.clamp(max=num_local - 1)
    rank = torch.arange(num_pairs, device=dev) - run_starts[e]  # place within its expert
    total = max_padded_len(num_pairs, num_local, block_m)
    dest = torch.where(local, starts[e] + rank, total)  # another rank's pairs: a trash slot
    sorted_pairs = torch.full((total + 1,), num_pairs, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, total, block_m, device=dev)  # (blocks,)
    block_experts = torch.searchsorted(ends, block_starts, right=True)  # E_local: none
    block_experts = torch.where(block_experts < num_local, block_experts, -1)
    return Aligned(sorted_pairs[:total], block_experts.to(torch.int32))


@triton.jit
def _load_rows(base, rows, stride, offs_k, mask_rows, K: tl.constexpr, UPCAST: tl.constexpr):
    tile = tl.load(base + rows[:, None] * stride + offs_k[None, :],
                   mask=mask_rows[:, None] & (offs_k[None, :] < K), other=0.0)
    return tile.to(tl.float32) if UPCAST else tile


# NOTE: the pair count (tokens * top-k) is a runtime argument, never specialized: it follows
# the batch size, and as a constexpr (or specialized, as Triton does an int equal to 1 or a
# multiple of 16) an eager server would compile new variants while serving. Everything else
# the kernels specialize on is fixed by the model's shapes.
@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(x, w, sorted_pairs, block_experts, act, stride_x, stride_we, stride_wn,
                    stride_a, num_pairs, TOP_K: tl.constexpr,
                    HIDDEN: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                    ws, wz, stride_se, stride_sn, KIND: tl.constexpr, GROUP: tl.constexpr):
    # grid (blocks, F tiles): act[pair, n] = silu(x[tok] @ w[e, n].T) * (x[tok] @ w[e, F+n].T)
    expert = tl.load(block_experts + tl.program_id(0))
    if expert < 0:
        return
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs + offs_m)  # (BM,)
    valid = pair < num_pairs
    tok = pair // TOP_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < INTER
    w_e = w + expert.to(tl.int64) * stride_we
    s_e, z_e = ws + expert.to(tl.int64) * stride_se, wz + expert.to(tl.int64) * stride_se
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = _load_rows(x, tok, stride_x, offs_k, valid, HIDDEN, UPCAST)  # (BM, BK)
        g = weight_tile(w_e, s_e, z_e, offs_n, mask_n, k0, stride_wn, stride_sn, HIDDEN,
                        BLOCK_K, KIND, GROUP, x.dtype.element_ty, UPCAST)
        u = weight_tile(w_e, s_e, z_e, INTER + offs_n, mask_n, k0, stride_wn, stride_sn,
                        HIDDEN, BLOCK_K, KIND, GROUP, x.dtype.element_ty, UPCAST)  # (BK, BN)
        acc_g = tl.dot(a, g, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=DOT_PRECISION)
    dtype = act.dtype.element_ty
    gate = round_to(acc_g, dtype).to(tl.float32)
    up = round_to(acc_u, dtype).to(tl.float32)
    silu = round_to(tl.div_rn(gate, 1.0 + tl.exp(-gate)), dtype).to(tl.float32)
    tl.store(act + pair[:, None].to(tl.int64) * stride_a + offs_n[None, :],
             round_to(silu * up, dtype), mask=valid[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(act, w, weights, sorted_pairs, block_experts, out, stride_a, stride_we,
                 stride_wn, stride_o, num_pairs, HIDDEN: tl.constexpr,
                 INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                 ws, wz, stride_se, stride_sn, KIND: tl.constexpr, GROUP: tl.constexpr):
    # grid (blocks, hidden tiles): out[pair, n] = (act[pair] @ w[e, n].T) * weights[pair]
    expert = tl.load(block_experts + tl.program_id(0))
    if expert < 0:
        return
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs + offs_m)  # (BM,)
    valid = pair < num_pairs
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < HIDDEN
    w_e = w + expert.to(tl.int64) * stride_we
    s_e, z_e = ws + expert.to(tl.int64) * stride_se, wz + expert.to(tl.int64) * stride_se
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = _load_rows(act, pair.to(tl.int64), stride_a, offs_k, valid, INTER, UPCAST)
        d = weight_tile(w_e, s_e, z_e, offs_n, mask_n, k0, stride_wn, stride_sn, INTER,
                        BLOCK_K, KIND, GROUP, act.dtype.element_ty, UPCAST)
        acc = tl.dot(a, d, acc, input_precision=DOT_PRECISION)  # (BM, BN)
    dtype = out.dtype.element_ty
    scale = tl.load(weights + pair, mask=valid, other=0.0).to(tl.float32)  # (BM,)
    y = round_to(acc, dtype).to(tl.float32) * scale[:, None]
    tl.store(out + pair[:, None].to(tl.int64) * stride_o + offs_n[None, :], round_to(y, dtype),
             mask=valid[:, None] & mask_n[None, :])


def _check(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: Experts,
           down: Experts) -> None:
    assert x.dim() == 2 and x.stride(1) == 1, f"x must be (T, hidden) rows, got {x.shape}"
    assert x.dtype in KV_DTYPES, f"unsupported dtype {x.dtype}"
    assert weights.shape == ids.shape and ids.shape[0] == x.shape[0], (weights.shape, ids.shape)
    num_local, two_f, hidden = expert_shape(gate_up)
    assert hidden == x.shape[1], (hidden, x.shape)
    assert expert_shape(down) == (num_local, hidden, two_f // 2), expert_shape(down)
    for w in (gate_up, down):
        t, _ = kernel_args(w)
        assert t.is_contiguous() and t.device == x.device
        assert not isinstance(w, torch.Tensor) or t.dtype == x.dtype


def fused_moe(
    x: torch.Tensor,  # (T, hidden)
    topk_weights: torch.Tensor,  # (T, k)
    topk_ids: torch.Tensor,  # (T, k) global expert indices
    gate_up: Experts,  # (E_local, 2F, hidden): gate rows, then up rows
    down: Experts,  # (E_local, hidden, F)
    *,
    first_expert: int = 0,  # global index of gate_up[0] (expert parallelism)
) -> torch.Tensor:  # (T, hidden): sum over the local experts of weight * expert(x)
    """Each token's weighted sum over its top-k experts held here (others contribute 0);
    the experts float in x's dtype or quantized (fused_moe_quant.py: dequantized in the
    B tile)."""
    _check(x, topk_weights, topk_ids, gate_up, down)
    num_tokens, top_k = topk_ids.shape
    num_local, hidden, inter = expert_shape(down)
    (gu, gu_args), (dn, dn_args) = kernel_args(gate_up), kernel_args(down)
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    check_launchable(_gate_up_kernel, x.device)
    aligned = moe_align(topk_ids, first_expert, num_local)
    blocks = aligned.block_experts.shape[0]
    precision, upcast = dot_flags(x.device, x.dtype)
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # (P, F)
    pair_out = torch.zeros(num_pairs, hidden, dtype=x.dtype, device=x.device)  # (P, hidden)
    common = {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "BLOCK_K": BLOCK_K,
              "DOT_PRECISION": precision, "UPCAST": upcast, "HIDDEN": hidden, "INTER": inter}
    _gate_up_kernel[(blocks, cdiv(inter, BLOCK_N))](
        x, gu, aligned.sorted_pairs, aligned.block_experts, act, x.stride(0),
        gu.stride(0), gu.stride(1), act.stride(0), num_pairs, TOP_K=top_k, **common, **gu_args)
    w = topk_weights.to(x.dtype).reshape(-1).contiguous()  # (P,)
    _down_kernel[(blocks, cdiv(hidden, BLOCK_N))](
        act, dn, w, aligned.sorted_pairs, aligned.block_experts, pair_out, act.stride(0),
        dn.stride(0), dn.stride(1), pair_out.stride(0), num_pairs, **common, **dn_args)
    return pair_out.view(num_tokens, top_k, hidden).sum(dim=1)  # (T, hidden)

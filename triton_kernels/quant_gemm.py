"""GEMMs on quantized weights for GPUs: W4A16 (split-K for small M) and FP8 W8A8 with block
scales and dynamic per-token activation scales.

Owns: the GPU weight layouts (`GpuQuantWeight`, made once at load by `prepare_weight`), the
two kernels, the per-token FP8 activation quantizer, and `quant_matmul`, which picks one.
Does not know: checkpoint formats or the model (radixserve/model/quantization/ hands over
codes, scales and zero points in its canonical form: W[n, k] = (code - zero[n, g]) *
scale[n, g], g = k // group; FP8 codes are e4m3 bit patterns).

- W4A16: codes (N, ceil(K / 2)) uint8, input 2i in the low nibble and 2i + 1 in the high
  one; each (BLOCK_K, BLOCK_N) tile is dequantized to the activations' dtype in registers and
  multiplied with tl.dot (fp32 accumulation). Split-K: for few rows (decode) the K range is
  cut into SPLIT_K slices, one program each, whose fp32 partial sums are added at the end, so
  that a batch of 1 still fills the GPU. Exactly `x @ dequantize(W).to(x.dtype).T`.
- FP8 W8A8: x quantized per token and per weight group (amax / 448, the per-token scale of
  DeepSeek's 1 x 128 activation blocks, `quantize_act_fp8`); tl.dot on the fp8 operands
  (sm_89+ hardware; upcast to fp32 elsewhere, exact since e4m3 products fit fp32); each
  group's partial product scaled by its activation and weight scales. Exactly
  `dequant(xq) @ dequantize(W).T` up to fp32 summation order.
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (triton is untyped, and @triton.jit kernel parameters carry no Python types.)

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from triton_kernels._common import cdiv, check_launchable, dot_flags

INT4, INT8, FP8 = 0, 1, 2  # the canonical kinds (radixserve.model.quantization.qweight.Kind)
FP8_MAX = 448.0
FP8_DOT_MIN_K = 32  # the shallowest fp8 x fp8 tl.dot the GPU compiler accepts
SPLIT_K_MAX_ROWS = 16  # at or below: split-K (the rows alone fill too few programs)


@dataclass(frozen=True)
class GpuQuantWeight:
    kind: int
    n: int
    k: int
    group_size: int
    codes: torch.Tensor  # INT4: (N, ceil(K / 2)) uint8; FP8: (N, K) float8_e4m3fn
    scale: torch.Tensor  # (N, G) float32
    zero: torch.Tensor | None  # (N, G) float32 (INT4); None (FP8)

    @property
    def nbytes(self) -> int:
        ts = [self.codes, self.scale] + ([] if self.zero is None else [self.zero])
        return sum(t.numel() * t.element_size() for t in ts)


def prepare_weight(kind: int, codes: torch.Tensor, scale: torch.Tensor,
                   zero: torch.Tensor | None, group_size: int, device: torch.device
                   ) -> GpuQuantWeight:
    """The canonical (N, K) uint8 codes in this module's layout, on `device`."""
    n, k = codes.shape
    if kind == INT4:
        padded = torch.nn.functional.pad(codes, (0, k % 2))  # (N, 2 * ceil(K / 2))
        packed = padded[:, 0::2] | (padded[:, 1::2] << 4)  # (N, ceil(K / 2))
        assert zero is not None
        return GpuQuantWeight(kind, n, k, group_size, packed.contiguous().to(device),
                              scale.float().contiguous().to(device),
                              zero.float().contiguous().to(device))
    assert kind == FP8, "int8 weights have no GPU kernel here"
    return GpuQuantWeight(kind, n, k, group_size,
                          codes.view(torch.float8_e4m3fn).contiguous().to(device),
                          scale.float().contiguous().to(device), None)


@triton.jit
def _w4a16_kernel(x, codes, scale, zero, out, M, N, K, stride_xm, stride_cn, stride_sn,
                  K_PER_SPLIT, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  UPCAST: tl.constexpr):
    # grid (row blocks, channel blocks, K splits); out: (SPLIT_K, M, N) fp32 partial sums
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    dtype = x.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_s * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        a = tl.load(x + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # (BM, BK)
        wmask = mask_k[:, None] & mask_n[None, :]
        byte = tl.load(codes + offs_n[None, :] * stride_cn + (offs_k // 2)[:, None],
                       mask=wmask, other=0).to(tl.int32)  # (BK, BN)
        q = (byte >> ((offs_k % 2) * 4)[:, None]) & 0xF
        g = (offs_k // GROUP)[:, None]
        s = tl.load(scale + offs_n[None, :] * stride_sn + g, mask=wmask, other=0.0)
        z = tl.load(zero + offs_n[None, :] * stride_sn + g, mask=wmask, other=0.0)
        w = ((q.to(tl.float32) - z) * s).to(dtype)  # (BK, BN), rounded as the reference's
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision=DOT_PRECISION)
        else:
            acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    tl.store(out + pid_s * M * N + offs_m[:, None] * N + offs_n[None, :], acc,
             mask=mask_m[:, None] & mask_n[None, :])


def w4a16_matmul(x: torch.Tensor, w: GpuQuantWeight, split_k: int | None = None
                 ) -> torch.Tensor:
    """x (M, K) @ dequantize(w).T -> (M, N) in x's dtype; `split_k` None: chosen by M."""
    assert w.kind == INT4 and x.dim() == 2 and x.shape[1] == w.k, (x.shape, w.k)
    x = x.contiguous()
    m = x.shape[0]
    check_launchable(_w4a16_kernel, x.device)
    block_m, block_n, block_k = 16, 64, 64
    if split_k is None:
        split_k = max(1, min(8, w.k // 512)) if m <= SPLIT_K_MAX_ROWS else 1
    per_split = cdiv(cdiv(w.k, split_k), block_k) * block_k
    split_k = cdiv(w.k, per_split)
    partial = torch.empty(split_k, m, w.n, dtype=torch.float32, device=x.device)
    precision, upcast = dot_flags(x.device, x.dtype)
    grid = (cdiv(m, block_m), cdiv(w.n, block_n), split_k)
    _w4a16_kernel[grid](x, w.codes, w.scale, w.zero, partial, m, w.n, w.k, x.stride(0),
                        w.codes.stride(0), w.scale.stride(0), per_split, GROUP=w.group_size,
                        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                        DOT_PRECISION=precision, UPCAST=upcast)
    return (partial[0] if split_k == 1 else partial.sum(0)).to(x.dtype)


def quantize_act_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq (M, K) float8_e4m3fn, xs (M, G) fp32): x ~= xq * xs per token and group of
    `group` inputs (dynamic: from this batch's own amax)."""
    m, k = x.shape
    groups = cdiv(k, group)
    xf = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    xs = (xf.abs().amax(dim=2) / FP8_MAX).clamp_min(1e-12)  # (M, G)
    xq = (xf / xs[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return xq.view(m, -1)[:, :k].contiguous(), xs


@triton.jit
def _fp8_kernel(xq, xs, wq, ws, out, M, N, K, G, stride_xm, stride_wn, GROUP: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                UPCAST: tl.constexpr):
    # grid (row blocks, channel blocks); BLOCK_K divides GROUP (or there is one group)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(xq + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # (BM, BK) fp8
        b = tl.load(wq + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # (BK, BN) fp8
        if UPCAST:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, b)  # fp8 x fp8 -> fp32 on the tensor cores
        g = k0 // GROUP
        sa = tl.load(xs + offs_m * G + g, mask=mask_m, other=0.0)  # (BM,)
        sb = tl.load(ws + offs_n * G + g, mask=mask_n, other=0.0)  # (BN,)
        acc += part * sa[:, None] * sb[None, :]
    tl.store(out + offs_m[:, None] * N + offs_n[None, :], acc,
             mask=mask_m[:, None] & mask_n[None, :])


def fp8_block_k(k: int, group: int) -> int:
    """The K tile: at most 128, dividing the group (so a tile has one scale); any with one
    group."""
    if group >= k:
        return 64 if k >= 64 else 32
    for bk in (128, 64, 32, 16):
        if group % bk == 0:
            return bk
    raise ValueError(f"FP8 weight groups of {group} inputs: not a multiple of 16")


def fp8_w8a8_matmul(x: torch.Tensor, w: GpuQuantWeight) -> torch.Tensor:
    """x (M, K), quantized per token and group on the fly, @ the FP8 weight -> (M, N) in x's
    dtype."""
    assert w.kind == FP8 and x.dim() == 2 and x.shape[1] == w.k, (x.shape, w.k)
    check_launchable(_fp8_kernel, x.device)
    m = x.shape[0]
    group = min(w.group_size, w.k)
    xq, xs = quantize_act_fp8(x, group)
    out = torch.empty(m, w.n, dtype=torch.float32, device=x.device)
    block_m, block_n = 16, 64
    block_k = fp8_block_k(w.k, group)
    _, upcast = dot_flags(x.device, x.dtype)
    grid = (cdiv(m, block_m), cdiv(w.n, block_n))
    # An fp8 tl.dot needs K >= 32 (sm_90 does not compile a 16-deep one: aot_check):
    # 16-wide tiles multiply upcast to fp32 (exact, as on CPU).
    _fp8_kernel[grid](xq, xs, w.codes, w.scale, out, m, w.n, w.k, xs.shape[1], xq.stride(0),
                      w.codes.stride(0), GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n,
                      BLOCK_K=block_k, UPCAST=upcast or block_k < FP8_DOT_MIN_K)
    return out.to(x.dtype)


def quant_matmul(x: torch.Tensor, w: GpuQuantWeight) -> torch.Tensor:
    return w4a16_matmul(x, w) if w.kind == INT4 else fp8_w8a8_matmul(x, w)

"""Quantized experts for the fused MoE (fused_moe.py): their GPU layout and the B-tile dequant.

Owns: `MoEQuantWeight` (one projection of every local expert, made once at load by
`prepare_experts` from the canonical stacked form radixserve/model/quantization/experts.py
hands over: codes (E, N, K) uint8, scale and zero (E, N, G) float32, W[e, n, k] = (code -
zero[e, n, g]) * scale[e, n, g], g = k // group; FP8 codes are e4m3 bit patterns), its torch
dequantization (`dequantize_expert`: the reference, and the unfused path's weights), and
`weight_tile`, the jit helper fused_moe's kernels load their B tile with: a float weight's
tile as it is, or a quantized one's codes dequantized to the activations' dtype in
registers (W4A16, W8A16, FP8 weight-only), rounded to nearest even as
`dequantize_expert(...).to(dtype)` rounds them (round_to: the interpreter truncates casts), so the kernel is exactly the float fused MoE on the dequantized weights.
Does not know: routing, checkpoints, the model.

Layout: INT4 codes (E, N, ceil(K / 2)) uint8, input 2i in the low nibble and 2i + 1 in the
high one (quant_gemm.py's W4A16 layout per expert); INT8 codes (E, N, K) uint8; FP8 codes
(E, N, K) float8_e4m3fn; scale (E, N, G) float32; zero (E, N, G) float32 (None for FP8).
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (triton is untyped, and @triton.jit kernel parameters carry no Python types.)

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from triton_kernels._rounding import round_to

INT4, INT8, FP8 = 0, 1, 2  # the canonical kinds (radixserve.model.quantization.qweight.Kind)
FLOAT = -1  # weight_tile's KIND for a float weight


@dataclass(frozen=True)
class MoEQuantWeight:
    kind: int
    n: int  # output channels per expert
    k: int  # inputs per output channel
    group_size: int
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None

    @property
    def num_experts(self) -> int:
        return int(self.codes.shape[0])

    @property
    def nbytes(self) -> int:
        ts = [self.codes, self.scale] + ([] if self.zero is None else [self.zero])
        return sum(t.numel() * t.element_size() for t in ts)


def prepare_experts(kind: int, codes: torch.Tensor, scale: torch.Tensor,
                    zero: torch.Tensor | None, group_size: int, device: torch.device
                    ) -> MoEQuantWeight:
    """The canonical (E, N, K) uint8 codes in this module's layout, on `device`."""
    _, n, k = codes.shape
    if kind == INT4:
        padded = torch.nn.functional.pad(codes, (0, k % 2))  # (E, N, 2 * ceil(K / 2))
        codes = padded[:, :, 0::2] | (padded[:, :, 1::2] << 4)  # (E, N, ceil(K / 2))
    elif kind == FP8:
        codes = codes.view(torch.float8_e4m3fn)
    assert (zero is None) == (kind == FP8), "zero points for INT4 / INT8 only"
    return MoEQuantWeight(kind, n, k, group_size, codes.contiguous().to(device),
                          scale.float().contiguous().to(device),
                          None if zero is None else zero.float().contiguous().to(device))


def dequantize_expert(w: MoEQuantWeight, e: int) -> torch.Tensor:
    """Expert e's weight (N, K) float32."""
    codes = w.codes[e]
    if w.kind == INT4:
        pairs = torch.stack([codes & 0xF, codes >> 4], dim=-1)  # (N, ceil(K / 2), 2)
        values = pairs.reshape(w.n, -1)[:, : w.k].float()
    else:
        values = codes.float()
    g = torch.arange(w.k, device=codes.device) // w.group_size  # (K,)
    if w.zero is not None:
        values = values - w.zero[e][:, g]
    return values * w.scale[e][:, g]


@triton.jit
def _group_values(t_e, rows, mask_rows, mask, offs_k, k0, stride_sn, K: tl.constexpr,
                  BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """A scale or zero point per element of the (BK, BN) tile: one (BN,) row where the whole
    K tile lies in one group (a group a multiple of BLOCK_K, or one group per row)."""
    if GROUP >= K:  # (separate constexpr tests: the compiler folds each, not an `or`)
        return tl.load(t_e + rows * stride_sn, mask=mask_rows, other=0.0)[None, :]
    elif GROUP % BLOCK_K == 0:
        return tl.load(t_e + rows * stride_sn + k0 // GROUP, mask=mask_rows, other=0.0)[None, :]
    else:
        g = (offs_k // GROUP)[:, None]
        return tl.load(t_e + rows[None, :] * stride_sn + g, mask=mask, other=0.0)


@triton.jit
def weight_tile(w_e, s_e, z_e, rows, mask_rows, k0, stride_wn, stride_sn, K: tl.constexpr,
                BLOCK_K: tl.constexpr, KIND: tl.constexpr, GROUP: tl.constexpr,
                DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """The (BK, BN) B tile W[e, rows, k0 : k0 + BK].T of expert e (w_e, s_e, z_e: its codes,
    scale and zero point), in DTYPE (fp32 where UPCAST)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = mask_rows[None, :] & (offs_k[:, None] < K)
    if KIND == -1:
        w = tl.load(w_e + rows[None, :] * stride_wn + offs_k[:, None], mask=mask, other=0.0)
    else:
        s = _group_values(s_e, rows, mask_rows, mask, offs_k, k0, stride_sn, K, BLOCK_K, GROUP)
        if KIND == 0:  # int4: two inputs per byte, the even one in the low nibble
            byte = tl.load(w_e + rows[None, :] * stride_wn + (offs_k // 2)[:, None], mask=mask,
                           other=0).to(tl.int32)
            q = ((byte >> ((offs_k % 2) * 4)[:, None]) & 0xF).to(tl.float32)
        else:  # int8 codes, or fp8 e4m3 values
            q = tl.load(w_e + rows[None, :] * stride_wn + offs_k[:, None], mask=mask
                        ).to(tl.float32)
            q = tl.where(mask, q, 0.0)
        if KIND == 2:
            w = round_to(q * s, DTYPE)
        else:
            z = _group_values(z_e, rows, mask_rows, mask, offs_k, k0, stride_sn, K, BLOCK_K,
                              GROUP)
            w = round_to((q - z) * s, DTYPE)
    return w.to(tl.float32) if UPCAST else w


def kernel_args(w: torch.Tensor | MoEQuantWeight) -> tuple[torch.Tensor, dict[str, object]]:
    """The kernels' B operand (`w`) and its extra arguments: a float weight passes itself as
    the (unread) scale and zero."""
    if isinstance(w, torch.Tensor):
        return w, {"ws": w, "wz": w, "stride_se": 0, "stride_sn": 0, "KIND": FLOAT, "GROUP": 1}
    zero = w.scale if w.zero is None else w.zero
    return w.codes, {"ws": w.scale, "wz": zero, "stride_se": w.scale.stride(0),
                     "stride_sn": w.scale.stride(1), "KIND": w.kind,
                     "GROUP": min(w.group_size, w.k)}


def expert_shape(w: torch.Tensor | MoEQuantWeight) -> tuple[int, int, int]:
    """(E, N, K) of a float stack or a quantized one."""
    if isinstance(w, torch.Tensor):
        e, n, k = w.shape
        return int(e), int(n), int(k)
    return w.num_experts, w.n, w.k


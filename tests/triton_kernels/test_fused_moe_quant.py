"""The Triton fused MoE on quantized experts (W4A16 with group scales and zero points, W8A16,
FP8 per channel and in blocks) against a dequantize-then-torch reference, and bit for bit
against the float fused MoE on the dequantized weights (the B tile is dequantized in
registers to exactly those values). Runs on CUDA when present, else under Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported)."""

from __future__ import annotations

import pytest
import torch

from triton_kernels.fused_moe import fused_moe
from triton_kernels.fused_moe_quant import (
    FP8,
    INT4,
    INT8,
    MoEQuantWeight,
    dequantize_expert,
    prepare_experts,
)
from triton_kernels.reference import fused_moe_ref
from triton_kernels.testing import device_or_error

DEVICE, DEVICE_ERROR = device_or_error()
FP8_MAX = 448.0


@pytest.fixture
def runnable_kernels() -> None:
    if DEVICE_ERROR:
        pytest.fail(DEVICE_ERROR, pytrace=False)


def quantize(w: torch.Tensor, kind: int, group: int) -> MoEQuantWeight:
    """(E, N, K) float -> round-to-nearest codes with (E, N, G) scales (asymmetric ints)."""
    e, n, k = w.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(w, (0, groups * group - k)).view(e, n, groups, group)
    idx = torch.arange(k) // group
    if kind == FP8:
        scale = (padded.abs().amax(-1) / FP8_MAX).clamp_min(1e-12)  # (E, N, G)
        codes = (w / scale[:, :, idx]).to(torch.float8_e4m3fn).view(torch.uint8)
        return prepare_experts(FP8, codes, scale, None, group, DEVICE)
    top = 15 if kind == INT4 else 255
    lo, hi = padded.amin(-1).clamp(max=0), padded.amax(-1).clamp(min=0)
    scale = ((hi - lo) / top).clamp_min(1e-12)
    zero = torch.round(-lo / scale).clamp(0, top)
    codes = torch.round(w / scale[:, :, idx] + zero[:, :, idx]).clamp(0, top).to(torch.uint8)
    return prepare_experts(kind, codes, scale, zero, group, DEVICE)


def dequantized(w: MoEQuantWeight, dtype: torch.dtype) -> torch.Tensor:
    return torch.stack([dequantize_expert(w, e) for e in range(w.num_experts)]).to(dtype)


def case(tokens: int, hidden: int, inter: int, experts: int, top_k: int, kind: int,
         group: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    scores = torch.randn(tokens, experts, generator=g) + torch.linspace(2, -2, experts)
    weights, ids = torch.softmax(scores, -1).topk(top_k, dim=-1)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
    return (x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE),
            quantize(gate_up, kind, group), quantize(down, kind, min(group, inter)))


# (kind, group): int4 groups of 32 and 64 (partial at hidden 80; 64: one group per K tile,
# its scales loaded as one row), int8 and FP8 per
# channel, FP8 blocks of 48 inputs (DeepSeek-style block scales, partial at the edges)
KINDS = [(INT4, 32), (INT4, 64), (INT8, 10**6), (FP8, 10**6), (FP8, 48)]


@pytest.mark.usefixtures("runnable_kernels")
@pytest.mark.parametrize(("kind", "group"), KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_experts_match_the_dequantized_reference(kind: int, group: int,
                                                           dtype: torch.dtype) -> None:
    x, w, ids, gu, dn = case(13, 80, 48, 8, 3, kind, min(group, 80), seed=kind)
    x, w = x.to(dtype), w.to(dtype)
    got = fused_moe(x, w, ids, gu, dn)
    gu_f, dn_f = dequantized(gu, dtype), dequantized(dn, dtype)
    assert torch.equal(got, fused_moe(x, w, ids, gu_f, dn_f))  # the same B tile values
    ref = fused_moe_ref(x.float(), w.float(), ids, gu_f.float(), dn_f.float())
    tol = 1e-5 if dtype == torch.float32 else 2**-6
    torch.testing.assert_close(got.float(), ref, rtol=tol, atol=tol)


@pytest.mark.usefixtures("runnable_kernels")
def test_quantized_expert_parallel_part_and_decode() -> None:
    x, w, ids, gu, dn = case(1, 64, 32, 8, 2, INT4, 32, seed=4)  # batch 1
    ref = fused_moe_ref(x, w, ids, dequantized(gu, x.dtype), dequantized(dn, x.dtype))
    torch.testing.assert_close(fused_moe(x, w, ids, gu, dn), ref, rtol=1e-5, atol=1e-5)
    x, w, ids, gu, dn = case(21, 64, 32, 8, 3, FP8, 64, seed=5)
    half = [MoEQuantWeight(t.kind, t.n, t.k, t.group_size, t.codes[4:], t.scale[4:], None)
            for t in (gu, dn)]
    ref = fused_moe_ref(x, w, ids, dequantized(gu, x.dtype)[4:], dequantized(dn, x.dtype)[4:],
                        4)
    torch.testing.assert_close(fused_moe(x, w, ids, *half, first_expert=4), ref, rtol=1e-5,
                               atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [INT4, FP8])
def test_quantized_fused_moe_captures_in_a_cuda_graph(kind: int) -> None:
    """No host sync with quantized experts either: capture, replay on new routing."""
    x, w, ids, gu, dn = case(8, 128, 64, 16, 4, kind, 64, seed=6)
    x, w = x.bfloat16(), w.bfloat16()
    fused_moe(x, w, ids, gu, dn)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w, ids, gu, dn)
    ids.copy_(torch.randint(0, 16, ids.shape, device=ids.device))
    graph.replay()
    ref = fused_moe_ref(x.float(), w.float(), ids, dequantized(gu, torch.bfloat16).float(),
                        dequantized(dn, torch.bfloat16).float())
    torch.testing.assert_close(out.float(), ref, rtol=2**-6, atol=2**-6)

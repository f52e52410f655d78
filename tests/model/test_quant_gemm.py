"""The native CPU GEMM on quantized weights (csrc/quant_gemm.cpp) and QuantLinear's paths
against dequantize-then-matmul in float64: int4 / int8 / fp8, group and per-channel scales,
partial groups and channel blocks at the edges, odd K and odd groups, every row-count path,
fp32 and bf16 activations, act-order; under each CPU tier this host executes."""

from __future__ import annotations

import pytest
import torch

from radixserve.model.quantization.cpu_kernel import (
    load_quant_gemm,
    pack_for_cpu,
    quant_gemm_reference,
)
from radixserve.model.quantization.linear import FALLBACK_ROWS, PANEL_MIN_ROWS, QuantLinear
from radixserve.model.quantization.qweight import QWeight, quantize_fp8, quantize_int

CPU = torch.device("cpu")

# every test under each CPU tier this host executes (tests/conftest.py's cpu_tier)
pytestmark = pytest.mark.usefixtures("cpu_tier")


def _weights(n: int, k: int, group: int, seed: int) -> list[QWeight]:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    return [quantize_int(w, 4, group), quantize_int(w, 4, group, symmetric=False),
            quantize_int(w, 8, k), quantize_int(w, 8, group, symmetric=False),
            quantize_fp8(w), quantize_fp8(w, group)]


@pytest.fixture
def gemm() -> object:
    """The op at the test's tier (cpu_tier set $RADIXSERVE_CPU_ISA before this runs)."""
    op = load_quant_gemm()
    if op is None:
        pytest.skip("the native CPU kernels are unavailable here")
    return op


@pytest.mark.parametrize(("m", "n", "k", "group"), [
    (1, 48, 64, 32), (5, 33, 70, 32), (70, 16, 128, 128), (3, 20, 100, 48), (4, 40, 96, 96)])
def test_kernel_matches_dequantize_then_matmul(gemm: object, m: int, n: int, k: int,
                                               group: int) -> None:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    for q in _weights(n, k, group, seed=n):
        p = pack_for_cpu(q)
        y = gemm(x, p.codes, p.scale, p.zero, int(p.kind), p.n, p.group_size)  # type: ignore[operator]
        ref = quant_gemm_reference(x, q)
        assert y.shape == (m, n) and y.dtype == torch.float32
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4, msg=q.kind.name)


# N off the 16-channel block; K odd (int4's padded pair) and off the group; an odd group
# (int4 pairs straddle groups: the plain loops); rows through the decode blocks (1-5: a
# partial row tile), the L1-scratch path (17: a partial micro tile) and whole 64-row blocks.
@pytest.mark.parametrize(("n", "k", "group"), [(33, 99, 32), (20, 70, 25), (50, 64, 64)])
def test_odd_shapes_on_every_row_path(gemm: object, n: int, k: int, group: int) -> None:
    for q in _weights(n, k, group, seed=k):
        p = pack_for_cpu(q)
        for m in (1, 2, 3, 4, 5, 17, 64):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            y = gemm(x, p.codes, p.scale, p.zero, int(p.kind), p.n, p.group_size)  # type: ignore[operator]
            torch.testing.assert_close(y, quant_gemm_reference(x, q), rtol=1e-5, atol=1e-4,
                                       msg=f"{q.kind.name} rows {m}")
            xb = x.bfloat16()  # bf16 rows: widened exactly, so the same sums up to rounding
            yb = gemm(xb, p.codes, p.scale, p.zero, int(p.kind), p.n, p.group_size)  # type: ignore[operator]
            assert yb.dtype == torch.bfloat16
            torch.testing.assert_close(yb, quant_gemm_reference(xb.float(), q).bfloat16(),
                                       rtol=1e-2, atol=2e-2, msg=f"{q.kind.name} bf16 {m}")


def test_bf16_activations_stay_bf16(gemm: object) -> None:
    x = torch.randn(4, 64).to(torch.bfloat16)
    for q in _weights(40, 64, 32, seed=3):
        y = QuantLinear([q], None, CPU, gemm)(x)  # type: ignore[arg-type]
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y, quant_gemm_reference(x.float(), q).bfloat16(),
                                   rtol=1e-2, atol=2e-2)


def test_without_the_kernel_slices_are_dequantized(gemm: object) -> None:
    """No native build: dequantize-then-matmul FALLBACK_ROWS output channels at a time."""
    x = torch.randn(3, 64)
    n = FALLBACK_ROWS + 40
    for q in _weights(n, 64, 32, seed=4):
        native = QuantLinear([q], None, CPU, gemm)(x)  # type: ignore[arg-type]
        plain = QuantLinear([q], None, CPU, None)(x)
        torch.testing.assert_close(native, plain, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(plain, quant_gemm_reference(x, q), rtol=1e-5, atol=1e-4)


def test_projections_stack_or_stay_separate(gemm: object) -> None:
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(5))
    a, b = quantize_int(w[:32], 4, 32), quantize_int(w[32:], 4, 32)
    stacked = QuantLinear([a, b], torch.ones(96), CPU, gemm)  # type: ignore[arg-type]
    assert len(stacked.parts) == 1
    # act-order: each projection its own input order -> two GEMMs, outputs concatenated
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(6))
    a_perm = QWeight(a.kind, a.codes, a.scale, a.zero, a.group_size, perm)
    split = QuantLinear([a_perm, b], None, CPU, gemm)  # type: ignore[arg-type]
    assert len(split.parts) == 2
    x = torch.randn(2, 64)
    ref = torch.cat([quant_gemm_reference(x, a_perm), quant_gemm_reference(x, b)], dim=1)
    torch.testing.assert_close(split(x), ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(stacked(x), x @ torch.cat([a.dequantize(), b.dequantize()]).t()
                               + 1, rtol=1e-5, atol=1e-4)


def test_every_row_count_path(gemm: object) -> None:
    """Decode rows (the scratch-free path), the tiled path and prefill panels all agree."""
    w = torch.randn(300, 160, generator=torch.Generator().manual_seed(7))
    for q in (quantize_int(w, 4, 32, symmetric=False), quantize_fp8(w, 32)):
        lin = QuantLinear([q], None, CPU, gemm)  # type: ignore[arg-type]
        for m in (1, 4, 5, PANEL_MIN_ROWS - 1, PANEL_MIN_ROWS, 2 * PANEL_MIN_ROWS + 3):
            x = torch.randn(m, 160, generator=torch.Generator().manual_seed(m))
            torch.testing.assert_close(lin(x), quant_gemm_reference(x, q), rtol=1e-5,
                                       atol=1e-4, msg=f"{q.kind.name} rows {m}")

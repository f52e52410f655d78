"""The native weight-only int8 GEMM (model/int8_kernel.py) against a float64 reference, its
packed layout, its checks, the fallback when it cannot be built, and Int8Linear's choice of
kernel."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from radixserve.model import int8_kernel, quant
from radixserve.model.int8_kernel import (
    int8_gemm_reference,
    load_int8_gemm,
    pack_int8_weight,
    unpack_int8_weight,
)
from radixserve.model.quant import Int8Linear, Int8Weight, quantize_per_channel
from radixserve.platform.cpu_isa import CpuIsa
from radixserve.platform.kernels import INT8_GEMM, load_extension

# every test under each CPU tier this host executes (tests/conftest.py's cpu_tier)
pytestmark = pytest.mark.usefixtures("cpu_tier")


def int8_weight(lin: Int8Linear) -> Int8Weight:
    """The plain (N, K) int8 weight and its scales, whichever layout the layer holds."""
    if lin.qweight is not None:
        return Int8Weight(lin.qweight, lin.scale)
    assert lin.packed is not None
    return Int8Weight(unpack_int8_weight(lin.packed, lin.out_features, lin.in_features),
                      lin.scale)


def kernel() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The op on a plain (N, K) weight: packs it, then calls the kernel."""
    op = load_int8_gemm()
    assert op is not None, "the kernel must build where the tests run (gcc + ninja)"

    def call(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return op(x, pack_int8_weight(q), scale, q.shape[0])
    return call


def uses_bf16() -> bool:
    loaded = load_extension(INT8_GEMM)
    assert loaded is not None
    return bool(loaded.op("int8_packed_gemm_uses_bf16")())


def test_the_bf16_path_runs_on_the_avx512_bf16_tiers_only(cpu_tier: CpuIsa) -> None:
    assert uses_bf16() == (cpu_tier.rank >= CpuIsa.AVX512_BF16.rank)


# M, N, K: rows off the 8-row micro tile, one tile (registers) vs several (widened panel) and
# the 128-row block; channels off the 16-channel block and the 3-block panel; odd K (padded
# pair); SmolLM2-135M's own shapes (QKV, down).
SHAPES = [(1, 1, 1), (1, 5, 7), (2, 3, 31), (3, 9, 33), (5, 17, 64), (7, 13, 100), (8, 49, 3),
          (9, 48, 2), (13, 6, 65), (97, 11, 40), (200, 37, 70), (129, 100, 9), (4, 960, 576),
          (33, 576, 1536)]


def test_pack_round_trip_and_layout() -> None:
    q = torch.randint(-127, 128, (37, 11), dtype=torch.int8)
    packed = pack_int8_weight(q)
    assert packed.shape == (3, 6, 16, 2)  # ceil(37 / 16) blocks, ceil(11 / 2) pairs
    assert packed[1, 2, 5, 1] == q[16 + 5, 2 * 2 + 1]  # block, pair, channel, pair half
    assert (packed[2, :, 5:] == 0).all() and (packed[:, 5, :, 1] == 0).all()  # padding
    assert torch.equal(unpack_int8_weight(packed, 37, 11), q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_kernel_matches_float64_reference(dtype: torch.dtype, m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    w = quantize_per_channel(torch.randn(n, k, generator=gen) * 0.05)
    x = torch.randn(m, k, generator=gen).to(dtype)
    y = kernel()(x, w.qweight, w.scale)
    assert y.shape == (m, n) and y.dtype == dtype
    ref = int8_gemm_reference(x.float(), w.qweight, w.scale).double()
    # x rounded to bf16 (8 bits of mantissa) on an AVX512-BF16 CPU, fp32 elsewhere; the
    # weights are exact in either; a bf16 output adds its own rounding.
    x_err = 2.0**-8 if uses_bf16() or dtype == torch.bfloat16 else 1e-6
    bound = (x.double().abs() @ (w.qweight.double().abs() * w.scale.double()[:, None]).t())
    tol = bound * x_err + ref.abs() * (2.0**-8 if dtype == torch.bfloat16 else 1e-6) + 1e-6
    assert ((y.double() - ref).abs() <= tol).all(), (y.double() - ref).abs().max()


def test_kernel_on_bf16_rounded_input_is_exact_up_to_fp32_sums() -> None:
    """With x already bf16 the kernel's products are exact: only fp32 summation is left."""
    gen = torch.Generator().manual_seed(3)
    w = quantize_per_channel(torch.randn(70, 300, generator=gen))
    x = torch.randn(9, 300, generator=gen).bfloat16().float()
    y = kernel()(x, w.qweight, w.scale).double()
    ref = int8_gemm_reference(x.double(), w.qweight, w.scale)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-4)


def test_kernel_is_far_from_a_wrong_weight() -> None:
    gen = torch.Generator().manual_seed(1)
    w = quantize_per_channel(torch.randn(24, 40, generator=gen))
    x = torch.randn(5, 40, generator=gen)
    y = kernel()(x, w.qweight, w.scale)
    for wrong_scale in (torch.ones_like(w.scale), w.scale.flip(0)):
        ref = int8_gemm_reference(x, w.qweight, wrong_scale)
        assert (y - ref).abs().max() > 0.1 * ref.abs().max()


def test_kernel_strided_input_and_empty_rows() -> None:
    gen = torch.Generator().manual_seed(2)
    w = quantize_per_channel(torch.randn(8, 16, generator=gen))
    wide = torch.randn(6, 32, generator=gen)
    x = wide[:, ::2]  # not contiguous
    ref = int8_gemm_reference(x.contiguous(), w.qweight, w.scale)
    assert torch.allclose(kernel()(x, w.qweight, w.scale), ref, rtol=1e-2, atol=1e-2)
    assert kernel()(torch.empty(0, 16), w.qweight, w.scale).shape == (0, 8)


def test_kernel_rejects_bad_inputs() -> None:
    w = quantize_per_channel(torch.randn(8, 16))
    op = load_int8_gemm()
    assert op is not None
    packed = pack_int8_weight(w.qweight)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(torch.randn(2, 16).double(), packed, w.scale, 8)
    with pytest.raises(RuntimeError, match="int8"):
        op(torch.randn(2, 16), packed.int(), w.scale, 8)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        op(torch.randn(2, 13), packed, w.scale, 8)  # K 13 -> 7 pairs, packed has 8
    with pytest.raises(RuntimeError, match="shape mismatch"):
        op(torch.randn(2, 16), packed, w.scale, 17)  # 17 channels need two blocks


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(int8_kernel.ENV_DISABLE, "1")
    assert load_int8_gemm() is None
    assert Int8Linear(torch.randn(8, 16)).native is None


@pytest.mark.usefixtures("broken_native_build")
def test_build_failure_falls_back_to_torch(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert load_int8_gemm() is None
        lin = Int8Linear(torch.randn(8, 16) * 0.1)
    assert "int8 GEMM kernel unavailable at " in caplog.text
    assert "error: no compiler here); using torch's kernels" in caplog.text
    assert lin.native is None and lin.packed is None and lin.qweight is not None
    # torch's kernels still compute the layer (the weight widened in the call at 8 rows)
    x = torch.randn(8, 16)
    ref = int8_gemm_reference(x, lin.qweight, lin.scale)
    assert torch.allclose(lin(x), ref, rtol=1e-4, atol=1e-5)


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Which kernel Int8Linear calls: torch's weight-only one, or a float matmul."""
    calls: list[str] = []
    wonly, linear = torch.ops.aten._weight_int8pack_mm, F.linear

    def spy_wonly(*a: torch.Tensor) -> torch.Tensor:
        calls.append("wonly")
        return wonly(*a)

    def spy_linear(*a: torch.Tensor) -> torch.Tensor:
        calls.append("linear")
        return linear(*a)

    monkeypatch.setattr(torch.ops.aten, "_weight_int8pack_mm", spy_wonly)
    monkeypatch.setattr(quant.F, "linear", spy_linear)
    return calls


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 16, 64, 300])
def test_int8_linear_runs_the_native_kernel_at_every_row_count(monkeypatch: pytest.MonkeyPatch,
                                                               rows: int) -> None:
    """Weight-only everywhere: the packed weight, the native kernel, activations unquantized."""
    calls = _spy(monkeypatch)
    gen = torch.Generator().manual_seed(rows)
    lin = Int8Linear(torch.randn(40, 24, generator=gen) * 0.1)
    assert lin.native is not None and lin.packed is not None and lin.qweight is None
    x = torch.randn(rows, 24, generator=gen)
    y = lin(x)
    assert calls == []
    w = int8_weight(lin)
    assert isinstance(w, Int8Weight) and w.qweight.shape == (40, 24)
    assert torch.equal(y, kernel()(x, w.qweight, lin.scale))
    assert lin.nbytes == lin.packed.numel() + 40 * 4


@pytest.mark.parametrize(("rows", "expected"), [(1, "wonly"), (2, "wonly"), (3, "linear"),
                                                (64, "linear")])
def test_int8_linear_without_the_native_kernel(monkeypatch: pytest.MonkeyPatch, rows: int,
                                               expected: str) -> None:
    calls = _spy(monkeypatch)
    lin = Int8Linear(torch.randn(48, 64) * 0.1, native=None)  # K = 24 crashes torch's w-only
    x = torch.randn(rows, 64)
    y = lin(x)
    assert calls == [expected]
    ref = int8_gemm_reference(x, int8_weight(lin).qweight, lin.scale)
    assert torch.allclose(y, ref, rtol=0.02, atol=0.02)  # bf16 activations in torch's w-only

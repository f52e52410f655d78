"""The native weight-only int8 GEMM (model/int8_kernel.py) against a float64 reference, its
checks, the fallback when it cannot be built, and Int8Linear's choice of kernel."""

from __future__ import annotations

import logging

import pytest
import torch

from radixserve.model import int8_kernel, quant
from radixserve.model.int8_kernel import int8_weight_gemm_reference, load_int8_gemm
from radixserve.model.quant import Int8Linear, quantize_per_channel


def kernel() -> int8_kernel.Int8Gemm:
    op = load_int8_gemm()
    assert op is not None, "the kernel must build where the tests run (gcc + ninja)"
    return op


def uses_bf16() -> bool:
    return bool(torch.ops.radixserve.int8_weight_gemm_uses_bf16())


# M, N, K: row and channel counts off the 6 x 4 micro tile and the 96-row block, K off the
# 32-wide step, and SmolLM2-135M's own shapes (QKV, down).
SHAPES = [(1, 1, 1), (1, 5, 7), (2, 3, 31), (3, 9, 33), (5, 17, 64), (7, 13, 100),
          (13, 6, 65), (97, 11, 40), (200, 37, 70), (4, 960, 576), (33, 576, 1536)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_kernel_matches_float64_reference(dtype: torch.dtype, m: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    w = quantize_per_channel(torch.randn(n, k, generator=gen) * 0.05)
    x = torch.randn(m, k, generator=gen).to(dtype)
    y = kernel()(x, w.qweight, w.scale)
    assert y.shape == (m, n) and y.dtype == dtype
    ref = int8_weight_gemm_reference(x.float(), w.qweight, w.scale).double()
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
    ref = int8_weight_gemm_reference(x.double(), w.qweight, w.scale)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-4)


def test_kernel_is_far_from_a_wrong_weight() -> None:
    gen = torch.Generator().manual_seed(1)
    w = quantize_per_channel(torch.randn(24, 40, generator=gen))
    x = torch.randn(5, 40, generator=gen)
    y = kernel()(x, w.qweight, w.scale)
    for wrong_scale in (torch.ones_like(w.scale), w.scale.flip(0)):
        ref = int8_weight_gemm_reference(x, w.qweight, wrong_scale)
        assert (y - ref).abs().max() > 0.1 * ref.abs().max()


def test_kernel_strided_input_and_empty_rows() -> None:
    gen = torch.Generator().manual_seed(2)
    w = quantize_per_channel(torch.randn(8, 16, generator=gen))
    wide = torch.randn(6, 32, generator=gen)
    x = wide[:, ::2]  # not contiguous
    ref = int8_weight_gemm_reference(x.contiguous(), w.qweight, w.scale)
    assert torch.allclose(kernel()(x, w.qweight, w.scale), ref, rtol=1e-2, atol=1e-2)
    assert kernel()(torch.empty(0, 16), w.qweight, w.scale).shape == (0, 8)


def test_kernel_rejects_bad_inputs() -> None:
    w = quantize_per_channel(torch.randn(8, 16))
    op = kernel()
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(torch.randn(2, 16).double(), w.qweight, w.scale)
    with pytest.raises(RuntimeError, match="int8"):
        op(torch.randn(2, 16), w.qweight.int(), w.scale)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        op(torch.randn(2, 15), w.qweight, w.scale)


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(int8_kernel.ENV_DISABLE, "1")
    assert load_int8_gemm() is None
    assert Int8Linear(torch.randn(8, 16)).native is None


def test_build_failure_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    def broken(**kwargs: object) -> None:
        raise RuntimeError("Error building extension 'x': no compiler")

    monkeypatch.setattr(int8_kernel, "_registered", lambda: False)
    monkeypatch.setattr("torch.utils.cpp_extension.load", broken)
    with caplog.at_level(logging.WARNING, logger=int8_kernel.__name__):
        assert load_int8_gemm() is None
        lin = Int8Linear(torch.randn(8, 16) * 0.1)
    assert "int8 GEMM kernel unavailable (RuntimeError: Error building extension 'x'" \
        in caplog.text
    assert lin.native is None
    # torch's kernels still compute the layer (int8 x int8 at 8 rows)
    x = torch.randn(8, 16)
    ref = int8_weight_gemm_reference(x, lin.qweight, lin.scale)
    assert torch.allclose(lin(x), ref, rtol=0.05, atol=0.05)


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Which kernel Int8Linear calls: native, weight-only (torch) or int_mm."""
    calls: list[str] = []
    wonly, int_mm = torch.ops.aten._weight_int8pack_mm, torch._int_mm

    def spy_wonly(*a: torch.Tensor) -> torch.Tensor:
        calls.append("wonly")
        return wonly(*a)

    def spy_int_mm(*a: torch.Tensor) -> torch.Tensor:
        calls.append("int_mm")
        return int_mm(*a)

    monkeypatch.setattr(torch.ops.aten, "_weight_int8pack_mm", spy_wonly)
    monkeypatch.setattr(torch, "_int_mm", spy_int_mm)
    return calls


@pytest.mark.parametrize(("rows", "all_weight_only", "native"),
                         [(1, False, True), (3, False, True), (16, False, True),
                          (17, False, False), (64, False, False), (64, True, True),
                          (300, True, True)])
def test_int8_linear_dispatch(monkeypatch: pytest.MonkeyPatch, rows: int,
                              all_weight_only: bool, native: bool) -> None:
    """The native kernel up to NATIVE_MAX_ROWS (16) rows, int8 x int8 above; every row count
    with RADIXSERVE_INT8_WEIGHT_ONLY=1."""
    if all_weight_only:
        monkeypatch.setenv(quant.ENV_ALL_WEIGHT_ONLY, "1")
    calls = _spy(monkeypatch)
    gen = torch.Generator().manual_seed(rows)
    lin = Int8Linear(torch.randn(40, 24, generator=gen) * 0.1)
    assert lin.native is not None and quant.NATIVE_MAX_ROWS == 16
    x = torch.randn(rows, 24, generator=gen)
    y = lin(x)
    assert calls == ([] if native else ["int_mm"])
    if native:
        assert torch.equal(y, kernel()(x, lin.qweight, lin.scale))


@pytest.mark.parametrize(("rows", "expected"), [(1, "wonly"), (2, "wonly"), (3, "int_mm"),
                                                (64, "int_mm")])
def test_int8_linear_without_the_native_kernel(monkeypatch: pytest.MonkeyPatch, rows: int,
                                               expected: str) -> None:
    calls = _spy(monkeypatch)
    lin = Int8Linear(torch.randn(48, 64) * 0.1)  # K = 24 crashes torch's w-only kernel
    lin.native_max_rows = 0  # as bench/quant.py's int8-intmm config: torch's kernels only
    lin(torch.randn(rows, 64))
    assert calls == [expected]


PORTABLE_CHECK = """
import torch
from torch.utils.cpp_extension import load
from radixserve.attention.cpu_kernels import ninja_on_path
from radixserve.model import int8_kernel
from radixserve.model.quant import quantize_per_channel
ninja_on_path()
load(name=int8_kernel.EXT_BASE + "_haswell", sources=[str(int8_kernel.SOURCE)],
     extra_cflags=["-O3", "-march=haswell", "-ffast-math"], is_python_module=False)
assert not torch.ops.radixserve.int8_weight_gemm_uses_bf16()
gen = torch.Generator().manual_seed(0)
for m, n, k in [(1, 5, 7), (13, 6, 65), (200, 37, 70)]:
    w = quantize_per_channel(torch.randn(n, k, generator=gen))
    x = torch.randn(m, k, generator=gen)
    y = torch.ops.radixserve.int8_weight_gemm(x, w.qweight, w.scale).double()
    ref = int8_kernel.int8_weight_gemm_reference(x.double(), w.qweight, w.scale)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-4), (y - ref).abs().max()
print("portable ok")
"""


def test_portable_build_without_avx512_bf16() -> None:
    """Compiled for an AVX2-only CPU (haswell): the fp32 fallback path builds and is exact up
    to fp32 sums. In a subprocess: the op names are already registered in this one."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", PORTABLE_CHECK], capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "portable ok" in done.stdout

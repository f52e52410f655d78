"""The Triton GEMMs on quantized weights (triton_kernels/quant_gemm.py) against
dequantize-then-matmul, under the interpreter on CPU (CUDA when present): W4A16 with and
without split-K, FP8 W8A8 with block and per-channel weight scales and dynamic per-token
activation scales."""

from __future__ import annotations

import pytest
import torch

from radixserve.model.quantization.qweight import QWeight, quantize_fp8, quantize_int
from tests.triton_kernels.test_kernels import (
    DEVICE,
    runnable_kernels,  # noqa: F401  (the fixture, used by name)
)
from triton_kernels.quant_gemm import (
    fp8_w8a8_matmul,
    prepare_weight,
    quantize_act_fp8,
    w4a16_matmul,
)

F32, BF16 = torch.float32, torch.bfloat16


def assert_matches(y: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: to summation order; bf16: to one rounding of the output (2^-8 of its largest
    magnitude: an fp32 sum in another order may round to the neighbouring bf16)."""
    assert y.dtype == ref.dtype and y.shape == ref.shape
    if y.dtype == F32:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
    else:
        atol = ref.float().abs().max().item() * 2**-8
        torch.testing.assert_close(y.float(), ref.float(), rtol=2**-7, atol=atol)


def _gpu(w: QWeight) -> object:
    return prepare_weight(int(w.kind), w.codes, w.scale, w.zero, w.group_size, DEVICE)


@pytest.mark.usefixtures("runnable_kernels")
@pytest.mark.parametrize(("m", "n", "k", "group", "split_k", "dtype"), [
    (1, 80, 256, 32, None, F32), (1, 64, 200, 40, 3, F32), (19, 70, 128, 64, 1, BF16),
    (3, 16, 96, 32, 2, BF16)])
def test_w4a16_matches_dequantize_then_matmul(m: int, n: int, k: int, group: int,
                                              split_k: int | None, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(m + n)
    w = quantize_int(torch.randn(n, k, generator=gen), 4, group, symmetric=m % 2 == 0)
    x = torch.randn(m, k, generator=gen).to(dtype)
    y = w4a16_matmul(x.to(DEVICE), _gpu(w), split_k).cpu()  # type: ignore[arg-type]
    ref = (x.float() @ w.dequantize().to(dtype).float().t()).to(dtype)
    assert_matches(y, ref)


@pytest.mark.usefixtures("runnable_kernels")
@pytest.mark.parametrize(("m", "n", "k", "group", "dtype"), [
    (1, 72, 256, 64, F32), (17, 48, 128, None, F32), (5, 40, 96, 32, BF16)])
def test_fp8_w8a8_matches_dequantize_then_matmul(m: int, n: int, k: int, group: int | None,
                                                 dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(m + k)
    w = quantize_fp8(torch.randn(n, k, generator=gen), group)
    x = torch.randn(m, k, generator=gen).to(dtype)
    y = fp8_w8a8_matmul(x.to(DEVICE), _gpu(w)).cpu()  # type: ignore[arg-type]
    xq, xs = quantize_act_fp8(x, group or k)
    idx = torch.arange(k) // (group or k)
    x_deq = xq.float() * xs[:, idx]  # the per-token (per-group) activations it multiplied
    ref = (x_deq @ w.dequantize().t()).to(dtype)
    assert_matches(y, ref)
    # and close to the unquantized product (the activation rounding is fp8's ~6%)
    assert (y.float() - x.float() @ w.dequantize().t()).abs().max() < 0.1 * k ** 0.5

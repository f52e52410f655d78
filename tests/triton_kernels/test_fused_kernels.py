"""The fused elementwise kernels (RMSNorm +- residual, RoPE +- KV store, SiLU * up) against
their torch references over a grid of shapes.

Runs on CUDA when present, else on CPU through Triton's interpreter (TRITON_INTERPRET=1 set
before triton is first imported; see triton_kernels.testing). Tolerances, as each kernel's
docstring states them: the new residual and RoPE (products rounded one by one, FP contraction
off) are bit-identical in every dtype; RMSNorm's output (its sum of squares runs in another
order) and SiLU (exp) are within rtol = atol = 1e-6 in fp32 and 2**-7 (one bf16 rounding
step) in bf16. Rows are views into wider buffers where the model passes views, caches start
NaN: a slot written that should not be, or an element left unwritten, shows.
"""

from __future__ import annotations

import pytest
import torch

from radixserve.model.arch import RopeSpec
from radixserve.model.rope import RotaryTable
from triton_kernels.fused_add_rmsnorm import fused_add_rmsnorm, rms_norm
from triton_kernels.reference import fused_add_rmsnorm_ref, rope_qk_store_ref, silu_mul_ref
from triton_kernels.rope import rope_qk, rope_qk_store
from triton_kernels.silu_mul import silu_mul
from triton_kernels.testing import device_or_error

DEVICE, DEVICE_ERROR = device_or_error()
F32, BF16 = torch.float32, torch.bfloat16
TOL = {F32: 1e-6, BF16: 2**-7}


@pytest.fixture
def runnable_kernels() -> None:
    if DEVICE_ERROR:
        pytest.fail(DEVICE_ERROR, pytrace=False)


def randn(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype=dtype, device=DEVICE)


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.isfinite(out).all(), "NaN/inf in the kernel output"
    tol = TOL[out.dtype]
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def wide_rows(rows: int, cols: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """(rows, cols) as a view into a (rows, cols + 8) buffer: a row stride != cols."""
    return randn((rows, cols + 8), dtype, gen)[:, 3 : 3 + cols]


# --- RMSNorm, with and without the residual add ------------------------------------------

NORM_SHAPES = [(1, 64), (7, 96), (33, 576), (5, 2048), (2, 4100)]  # 96, 4100: not powers of 2


@pytest.mark.usefixtures("runnable_kernels")
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize(("rows", "hidden"), NORM_SHAPES)
def test_fused_add_rmsnorm_matches_reference(rows: int, hidden: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows * hidden)
    x, residual = wide_rows(rows, hidden, dtype, gen), randn((rows, hidden), dtype, gen) * 4
    weight = randn((hidden,), dtype, gen)
    x_ref, residual_ref = x.clone(), residual.clone()
    before = x.data_ptr()
    out = fused_add_rmsnorm(x, residual, weight, 1e-6)
    fused_add_rmsnorm_ref(x_ref, residual_ref, weight, 1e-6)
    assert out.data_ptr() == before, "the output is written in place"
    assert torch.equal(residual, residual_ref), "the new residual rounds as torch's add"
    assert_close(x, x_ref)


@pytest.mark.usefixtures("runnable_kernels")
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize(("rows", "hidden"), NORM_SHAPES[:3])
def test_rms_norm_matches_reference(rows: int, hidden: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(hidden)
    x, weight = wide_rows(rows, hidden, dtype, gen), randn((hidden,), dtype, gen)
    x_before = x.clone()
    out = rms_norm(x, weight, 1e-5)
    assert torch.equal(x, x_before), "rms_norm without `out` leaves x alone"
    assert_close(out, fused_add_rmsnorm_ref(x_before.clone(), None, weight, 1e-5))


@pytest.mark.usefixtures("runnable_kernels")
def test_rms_norm_of_rows_with_very_different_scales() -> None:
    """Each row is normalized by its own statistics: scaling a row leaves its output alone."""
    gen = torch.Generator().manual_seed(1)
    x = randn((4, 128), F32, gen)
    scaled = x * torch.tensor([[1.0], [1e-3], [1e3], [7.0]], device=DEVICE)
    weight = torch.ones(128, device=DEVICE)
    assert_close(rms_norm(scaled, weight, 0.0), rms_norm(x, weight, 0.0))


def test_norm_rejects_a_weight_of_another_dtype() -> None:
    x = torch.zeros(2, 64, device=DEVICE)
    with pytest.raises(AssertionError, match="weight"):
        rms_norm(x, torch.ones(64, dtype=BF16, device=DEVICE), 1e-6)
    with pytest.raises(AssertionError, match="residual"):
        fused_add_rmsnorm(x, torch.zeros(3, 64, device=DEVICE), torch.ones(64, device=DEVICE),
                          1e-6)


# --- RoPE on q and k, with and without the KV store --------------------------------------

ROPE_CASES = [
    # tokens, q_heads, kv_heads, head_dim, dtype
    pytest.param(1, 4, 2, 16, F32, id="t1-d16-f32"),
    pytest.param(9, 9, 3, 64, BF16, id="t9-smollm2-bf16"),
    pytest.param(17, 32, 8, 128, F32, id="t17-d128-g4-f32"),
    pytest.param(5, 6, 6, 96, BF16, id="t5-d96-mha-bf16"),  # half of 96 is no power of 2
]


def rope_inputs(tokens: int, q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
                ) -> tuple[torch.Tensor, RotaryTable, torch.Tensor]:
    """(qkv as a view with a bias-like row stride, a Llama-3-scaled table, positions)."""
    gen = torch.Generator().manual_seed(tokens + head_dim)
    rope = RopeSpec(theta=500000.0, kind="llama3", factor=8.0, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position=64)
    table = RotaryTable(rope, head_dim, 300, dtype, DEVICE)
    qkv = wide_rows(tokens, (q_heads + 2 * kv_heads) * head_dim, dtype, gen)
    positions = torch.randint(0, 300, (tokens,), generator=gen).to(DEVICE)
    return qkv, table, positions


@pytest.mark.usefixtures("runnable_kernels")
@pytest.mark.parametrize(("tokens", "q_heads", "kv_heads", "head_dim", "dtype"), ROPE_CASES)
def test_rope_qk_matches_reference(tokens: int, q_heads: int, kv_heads: int, head_dim: int,
                                   dtype: torch.dtype) -> None:
    qkv, table, positions = rope_inputs(tokens, q_heads, kv_heads, head_dim, dtype)
    ref = qkv.clone()
    rope_qk(qkv, table.cos, table.sin, positions, q_heads, kv_heads)
    rope_qk_store_ref(ref, table.cos, table.sin, positions, q_heads, kv_heads, None, None)
    assert torch.equal(qkv, ref)  # v's columns included: untouched by both


@pytest.mark.usefixtures("runnable_kernels")
@pytest.mark.parametrize(("tokens", "q_heads", "kv_heads", "head_dim", "dtype"), ROPE_CASES)
def test_rope_qk_store_matches_reference(tokens: int, q_heads: int, kv_heads: int,
                                         head_dim: int, dtype: torch.dtype) -> None:
    qkv, table, positions = rope_inputs(tokens, q_heads, kv_heads, head_dim, dtype)
    num_slots = 2 * tokens + 3
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(0))[:tokens]
    slots = slots.to(DEVICE)
    shape = (num_slots, kv_heads, head_dim)
    caches = (torch.full(shape, float("nan"), dtype=dtype, device=DEVICE),
              torch.full(shape, float("nan"), dtype=dtype, device=DEVICE))
    ref_caches = (caches[0].clone(), caches[1].clone())
    ref = qkv.clone()
    rope_qk_store(qkv, table.cos, table.sin, positions, q_heads, *caches, slots)
    rope_qk_store_ref(ref, table.cos, table.sin, positions, q_heads, kv_heads, ref_caches, slots)
    assert torch.equal(qkv, ref), "q rotated in place, k and v columns left as they were"
    for cache, ref_cache in zip(caches, ref_caches, strict=True):
        assert torch.equal(cache[slots], ref_cache[slots])
        unused = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
        unused[slots] = False
        assert torch.isnan(cache[unused]).all(), "a slot outside `slots` was written"


@pytest.mark.usefixtures("runnable_kernels")
def test_rope_at_position_zero_is_the_identity() -> None:
    qkv, table, _ = rope_inputs(3, 4, 2, 32, F32)
    before = qkv.clone()
    rope_qk(qkv, table.cos, table.sin, torch.zeros(3, dtype=torch.int64, device=DEVICE), 4, 2)
    assert torch.equal(qkv, before)


def test_rope_rejects_a_table_of_another_dtype() -> None:
    qkv, table, positions = rope_inputs(2, 4, 2, 32, F32)
    with pytest.raises(AssertionError, match="cos/sin dtypes"):
        rope_qk(qkv, table.cos.to(BF16), table.sin.to(BF16), positions, 4, 2)


# --- SiLU(gate) * up ---------------------------------------------------------------------

@pytest.mark.usefixtures("runnable_kernels")
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize(("rows", "inter"), [(1, 64), (13, 1536), (3, 2500), (2, 8192)])
def test_silu_mul_matches_reference(rows: int, inter: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(inter)
    gate_up = wide_rows(rows, 2 * inter, dtype, gen) * 3  # silu's curved part and both tails
    out = torch.full((rows, inter), float("nan"), dtype=dtype, device=DEVICE)
    assert silu_mul(gate_up, out=out) is out
    assert_close(out, silu_mul_ref(gate_up))


def test_silu_mul_rejects_an_odd_width() -> None:
    with pytest.raises(AssertionError, match="2 \\* inter"):
        silu_mul(torch.zeros(2, 7, device=DEVICE))


# --- host cost: the unchecked path and the host-side block sizes ----------------------------

def test_host_block_sizes_are_tritons() -> None:
    import triton

    from triton_kernels._common import cdiv, next_pow2

    for n in [*range(0, 4200), 65535, 65536, 65537, 1 << 40]:
        assert next_pow2(n) == triton.next_power_of_2(n), n
    for a in range(0, 300):
        for b in (1, 2, 3, 7, 64, 1024):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


@pytest.mark.usefixtures("runnable_kernels")
def test_unchecked_calls_compute_the_same() -> None:
    """check=False (the fused path's layers after the first) skips only the checks."""
    gen = torch.Generator().manual_seed(5)
    x, residual = wide_rows(3, 64, F32, gen), randn((3, 64), F32, gen)
    weight = randn((64,), F32, gen)
    x2, residual2 = x.clone(), residual.clone()
    fused_add_rmsnorm(x, residual, weight, 1e-6)
    fused_add_rmsnorm(x2, residual2, weight, 1e-6, check=False)
    assert torch.equal(x, x2) and torch.equal(residual, residual2)
    assert torch.equal(rms_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6, check=False))
    gate_up = randn((3, 2 * 96), F32, gen)
    assert torch.equal(silu_mul(gate_up), silu_mul(gate_up, check=False))
    qkv, table, positions = rope_inputs(4, 4, 2, 32, F32)
    caches = [torch.zeros(8, 2, 32, device=DEVICE) for _ in range(4)]
    slots = torch.tensor([5, 0, 7, 2], device=DEVICE)
    qkv2 = qkv.clone()
    rope_qk_store(qkv, table.cos, table.sin, positions, 4, caches[0], caches[1], slots)
    rope_qk_store(qkv2, table.cos, table.sin, positions, 4, caches[2], caches[3], slots,
                  check=False)
    assert torch.equal(qkv, qkv2)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    rope_qk(qkv, table.cos, table.sin, positions, 4, 2)
    rope_qk(qkv2, table.cos, table.sin, positions, 4, 2, check=False)
    assert torch.equal(qkv, qkv2)

"""The native RMSNorm and RoPE ops against the torch code they replace (their references),
their input checks, the fallbacks, and the model using them."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from radixserve.model import norm_rope
from radixserve.model.arch import RopeSpec
from radixserve.model.norm_rope import (
    REFERENCE,
    NormRope,
    load_norm_rope,
    rms_norm_reference,
    rope_qk_reference,
    rope_store_reference,
)
from radixserve.model.rope import RotaryTable
from radixserve.platform.kernels import NORM_ROPE, load_extension

# every test under each CPU tier this host executes (tests/conftest.py's cpu_tier)
pytestmark = pytest.mark.usefixtures("cpu_tier")

CPU = torch.device("cpu")


def native() -> NormRope:
    ops = load_norm_rope(CPU)
    assert ops.native, "the ops must build where the tests run (gcc + ninja)"
    return ops


def native_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The op itself at the test's tier (NormRope keeps torch's form in fp32)."""
    loaded = load_extension(NORM_ROPE)
    assert loaded is not None
    out: torch.Tensor = loaded.op("rms_norm")(x, w, eps)
    return out


@pytest.mark.parametrize("rows", [1, 17, 300])
@pytest.mark.parametrize("hidden", [64, 576, 4096])
def test_rms_norm_fp32_matches_hf_order_to_a_few_ulps(rows: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(rows + hidden)
    x = torch.randn(rows, hidden, generator=gen) * 3
    w = torch.rand(hidden, generator=gen) + 0.5
    native()  # built and registered
    out = native_rms_norm(x, w, 1e-5)
    ref = rms_norm_reference(x, w, 1e-5)
    assert out.dtype == torch.float32 and out.shape == (rows, hidden)
    # the model's fp32 norm adds the squares in torch's order: its exact result
    assert torch.equal(native().rms_norm(x, w, 1e-5), ref)
    # the op's own order (lanes=0): only the sum of squares is added in another order, a few
    # ulps at most (the portable tier's 4-lane SSE2 sum drifts further over 4096 squares)
    portable = os.environ.get("RADIXSERVE_CPU_ISA") == "portable"
    assert torch.allclose(out, ref, rtol=4e-6 if portable else 5e-7, atol=0)
    exact = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)) * w
    assert (out.double() - exact).abs().max() < 1e-5


@pytest.mark.parametrize("hidden", [16, 64, 100, 576, 2048, 5120])
def test_fp32_rms_norm_is_native_and_bit_identical_to_torch(hidden: int,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """fp32 runs the native op with torch's order of the sum of squares (the lanes found
    against the reference at the first call), not the torch ops: equal bit for bit, on
    contiguous and strided rows, at 1 row and many."""
    ops = native()
    gen = torch.Generator().manual_seed(hidden)
    big = torch.randn(300, hidden + 8, generator=gen) * (torch.rand(300, 1, generator=gen) * 20)
    w = torch.rand(hidden, generator=gen) + 0.5
    cases = [big[:, :hidden].contiguous(), big[:, 8:], big[:1, :hidden].contiguous()]
    refs = [rms_norm_reference(x, w, 1e-6) for x in cases]
    ops.rms_norm(cases[0], w, 1e-6)  # finds the lanes (it runs the reference to compare)

    def no_torch_form(*args: object) -> torch.Tensor:
        raise AssertionError("fp32 RMSNorm ran the torch ops")

    monkeypatch.setattr(norm_rope, "rms_norm_reference", no_torch_form)
    for x, ref in zip(cases, refs, strict=True):
        assert torch.equal(ops.rms_norm(x, w, 1e-6), ref)


def test_fp32_rms_norm_keeps_torch_when_no_order_matches(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setattr(norm_rope, "LANE_CANDIDATES", (4,))  # not torch's order here
    ops = load_norm_rope(CPU)
    x, w = torch.randn(5, 64), torch.rand(64) + 0.5
    assert torch.equal(ops.rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5))
    assert isinstance(ops.rms_norm, norm_rope.NativeRmsNorm)
    assert ops.rms_norm._lanes == {64: None}


def test_rms_norm_bf16_matches_its_reference() -> None:
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(40, 576, generator=gen) * 4).bfloat16()
    w = (torch.rand(576, generator=gen) + 0.5).bfloat16()
    out = native().rms_norm(x, w, 1e-6)
    ref = rms_norm_reference(x, w, 1e-6)
    assert out.dtype == torch.bfloat16
    # the same roundings; the fp32 scale can differ in its last bits, moving a rare value
    # across a bf16 rounding boundary: one bf16 step at most
    assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2**-7).all()
    assert (out != ref).float().mean() < 0.01


def test_rms_norm_strided_rows_and_nan() -> None:
    gen = torch.Generator().manual_seed(4)
    big = torch.randn(10, 200, generator=gen)
    x = big[:, 8:72]  # rows 200 apart
    w = torch.rand(64, generator=gen) + 0.5
    x[3, 5] = float("nan")
    native()  # built and registered
    out = native_rms_norm(x, w, 1e-5)
    ref = rms_norm_reference(x.contiguous(), w, 1e-5)
    assert torch.isnan(out[3]).all()
    keep = torch.arange(10) != 3
    assert torch.allclose(out[keep], ref[keep], rtol=5e-7, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_bit_identical_to_the_torch_code(dtype: torch.dtype) -> None:
    table = RotaryTable(RopeSpec(theta=10000.0), 64, 4096, dtype, CPU)
    gen = torch.Generator().manual_seed(5)
    pos = torch.randint(0, 4096, (257,), generator=gen)
    cos, sin = table.lookup(pos)
    # SmolLM2's layout: 9 q heads + 3 k heads rotated, 3 v heads after them untouched
    qkv = torch.randn(257, 15 * 64, generator=gen).to(dtype)
    out = native().rope_qk(qkv, cos, sin, 12)
    assert out.shape == (257, 12, 64) and out.is_contiguous() and out.dtype == dtype
    assert torch.equal(out, rope_qk_reference(qkv, cos, sin, 12))


def test_rope_head_dim_128_and_strided_rows() -> None:
    table = RotaryTable(RopeSpec(theta=500000.0), 128, 64, torch.float32, CPU)
    pos = torch.arange(64).flip(0)
    cos, sin = table.lookup(pos)
    qkv = torch.randn(64, 2 * 6 * 128)[:, 128:]  # rows 1536 apart, 10 heads wide
    out = native().rope_qk(qkv, cos, sin, 4)
    assert torch.equal(out, rope_qk_reference(qkv, cos, sin, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 37])
def test_rope_store_is_bit_identical_to_rope_qk_and_index_copy(dtype: torch.dtype,
                                                               rows: int) -> None:
    """SmolLM2's layout (9 q, 3 k, 3 v heads of 64), qkv rows wider than the heads (rows
    1000 apart), slots in any order: q and k rotated in place as rope_qk, the rotated k and
    the v written to the pools' slots, nothing else touched."""
    table = RotaryTable(RopeSpec(theta=10000.0), 64, 4096, dtype, CPU)
    gen = torch.Generator().manual_seed(rows)
    cos, sin = table.lookup(torch.randint(0, 4096, (rows,), generator=gen))
    qkv = torch.randn(rows, 1000, generator=gen).to(dtype)
    caches = [torch.randn(100, 3, 64, generator=gen).to(dtype) for _ in range(2)]
    slots = torch.randperm(100, generator=gen)[:rows]
    ops = native()
    assert ops.rope_store is not None
    got = [qkv.clone(), *(c.clone() for c in caches)]
    q = ops.rope_store(got[0], cos, sin, 9, got[1], got[2], slots)
    want = [qkv.clone(), *(c.clone() for c in caches)]
    want_q = rope_store_reference(want[0], cos, sin, 9, want[1], want[2], slots)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert torch.equal(q, want_q) and q.shape == (rows, 9, 64)
    assert q.data_ptr() == got[0].data_ptr()  # a view of qkv
    assert torch.equal(want_q, rope_qk_reference(qkv, cos, sin, 12)[:, :9])
    assert torch.equal(got[0][:, 15 * 64 :], qkv[:, 15 * 64 :])  # v and past it untouched


def test_rope_store_input_checks() -> None:
    store = native().rope_store
    assert store is not None
    cos = torch.ones(2, 16)
    qkv, cache, slots = torch.randn(2, 96), torch.zeros(8, 2, 16), torch.tensor([0, 7])
    store(qkv, cos, cos, 2, cache, cache.clone(), slots)  # fits: 2 q + 2 k + 2 v heads
    with pytest.raises(RuntimeError, match="too narrow"):
        store(qkv, cos, cos, 3, cache, cache.clone(), slots)
    with pytest.raises(RuntimeError, match="slot out of range"):
        store(qkv, cos, cos, 2, cache, cache.clone(), torch.tensor([0, 8]))
    with pytest.raises(RuntimeError, match="share a dtype"):
        store(qkv, cos, cos, 2, cache.bfloat16(), cache.bfloat16(), slots)
    with pytest.raises(RuntimeError, match="int64"):
        store(qkv, cos, cos, 2, cache, cache.clone(), slots.int())
    with pytest.raises(RuntimeError, match="contiguous"):
        store(qkv, cos, cos, 2, torch.zeros(8, 2, 32)[:, :, :16], cache, slots)


def test_input_checks() -> None:
    ops = native()
    rms = native_rms_norm
    with pytest.raises(RuntimeError, match="share a dtype"):
        rms(torch.randn(2, 8), torch.ones(8).bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="x \\(T, H\\)"):
        rms(torch.randn(2, 8), torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        rms(torch.randn(2, 8).half(), torch.ones(8).half(), 1e-5)
    loaded = load_extension(NORM_ROPE)
    assert loaded is not None
    with pytest.raises(RuntimeError, match="lanes"):
        loaded.op("rms_norm")(torch.randn(2, 8).bfloat16(), torch.ones(8).bfloat16(), 1e-5, 8)
    with pytest.raises(RuntimeError, match="lanes"):
        loaded.op("rms_norm")(torch.randn(2, 8), torch.ones(8), 1e-5, 5)
    cos = torch.ones(3, 64)
    with pytest.raises(RuntimeError, match="too narrow"):
        ops.rope_qk(torch.randn(3, 128), cos, cos, 3)
    with pytest.raises(RuntimeError, match="D even"):
        ops.rope_qk(torch.randn(3, 128), torch.ones(3, 63), torch.ones(3, 63), 1)


def test_disabled_by_environment_and_off_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_norm_rope(torch.device("cuda")) is REFERENCE
    monkeypatch.setenv(norm_rope.ENV_DISABLE, "1")
    assert load_norm_rope(CPU) is REFERENCE


@pytest.mark.usefixtures("broken_native_build")
def test_build_failure_falls_back_to_torch(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        assert load_norm_rope(CPU) is REFERENCE
    assert "CPU RMSNorm/RoPE kernels unavailable at " in caplog.text
    assert "error: no compiler here); using torch's kernels" in caplog.text

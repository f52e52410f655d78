"""An 8-bit KV pool on CPU: the native decode kernel reads fp8 rows exactly as the dequantizing
reference does (every byte code, both head-dim paths), and the torch backend (cascade, groups,
varlen, native kernels) over an 8-bit pool equals the same backend over the dequantized pool."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from radixserve.attention.cpu_kernels import (
    ENV_NO_AMX,
    load_paged_decode,
    load_prefill_attention,
    paged_decode_reference,
    prefill_attention_reference,
)
from radixserve.attention.kv_quant import (
    KVScale,
    dequantize,
    quantize,
    scales_from_amax,
    storage_dtype,
    store,
)
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.platform.cpu_isa import CpuIsa
from tests.attention.test_torch_backend import (
    CASES,
    HKV,
    NUM_SLOTS,
    D,
    G,
    build_meta,
    make_table,
    reference,
)

# every test under each CPU tier this host executes (tests/conftest.py's cpu_tier)
pytestmark = pytest.mark.usefixtures("cpu_tier")

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


def test_storage_dtype_names_are_vllms() -> None:
    assert storage_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert storage_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert storage_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert storage_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2


@pytest.mark.parametrize("fmt", FORMATS)
def test_store_saturates_and_round_trips_within_the_formats_precision(fmt: torch.dtype) -> None:
    cache = torch.zeros(10, 2, 8, dtype=fmt)
    x = torch.randn(3, 2, 8)
    scale = torch.tensor([0.01, 1.0])
    x[0, 0, 0] = 1e6  # far past the format's range at scale 0.01
    store(cache, torch.tensor([7, 2, 5]), x, scale)
    back = dequantize(cache[[7, 2, 5]], scale, torch.float32)
    assert torch.isfinite(back).all()
    assert back[0, 0, 0] == torch.finfo(fmt).max * 0.01  # saturated, not inf / NaN
    rel = 2.0 ** -(3 if fmt == torch.float8_e4m3fn else 2)  # half a mantissa step, and margin
    close = (back - x).abs() <= rel * x.abs() + 2 ** -9 * scale[None, :, None]
    close[0, 0, 0] = True
    assert close.all()


def all_codes_cache(fmt: torch.dtype, hkv: int, d: int) -> torch.Tensor:
    """(S, hkv, d) holding every finite byte code of the format at least once."""
    codes = torch.arange(256, dtype=torch.uint8).view(fmt)
    codes = codes[torch.isfinite(codes.float())]
    row = hkv * d
    reps = -(-row * 8 // codes.numel())
    return codes.repeat(reps)[: row * 8].view(8, hkv, d)


@pytest.mark.parametrize("d", [64, 40])  # 64: the vector / tile paths; 40: the generic one
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_kernel_reads_every_byte_code_exactly(fmt: torch.dtype, qdtype: torch.dtype,
                                                     d: int) -> None:
    """One key per request: the output is that slot's V row times its scale, exactly (rounded
    to q's dtype once)."""
    op = load_paged_decode()
    assert op is not None
    hkv, g = 3, 2
    v8 = all_codes_cache(fmt, hkv, d)
    k8 = torch.zeros_like(v8)
    ks, vs = torch.tensor([1.0, 2.0, 0.5]), torch.tensor([0.25, 1.0, 3.0])
    table = torch.arange(8, dtype=torch.int32).view(8, 1)
    q = torch.randn(8, hkv * g, d).to(qdtype)
    out, _ = op(q, k8, v8, table, torch.arange(8), torch.zeros(8, dtype=torch.int64),
                torch.ones(8, dtype=torch.int64), 0.1, ks, vs)
    want = dequantize(v8, vs, torch.float32).repeat_interleave(g, dim=1)  # (8, hq, d)
    assert torch.equal(out, want.to(qdtype))


@pytest.mark.parametrize("d", [64, 128, 256, 40])  # the vector / dot-product paths; generic
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_kernel_scores_every_byte_code_exactly(fmt: torch.dtype, qdtype: torch.dtype,
                                                      d: int) -> None:
    """One key per request, every code in K: the lse is that key's scaled score, q . k summed
    in fp32 from exact products (to fp32's rounding of the sum, not bf16's)."""
    op = load_paged_decode()
    assert op is not None
    hkv, g = 3, 3
    k8 = all_codes_cache(fmt, hkv, d)
    v8 = torch.zeros_like(k8)
    ks, vs = torch.tensor([1.0, 2.0, 0.5]), torch.tensor([1.0, 1.0, 1.0])
    table = torch.arange(8, dtype=torch.int32).view(8, 1)
    q = torch.randn(8, hkv * g, d, generator=torch.Generator().manual_seed(d)).to(qdtype)
    _, lse = op(q, k8, v8, table, torch.arange(8), torch.zeros(8, dtype=torch.int64),
                torch.ones(8, dtype=torch.int64), 0.1, ks, vs)
    kd = dequantize(k8, ks, torch.float32).double().repeat_interleave(g, dim=1)  # (8, hq, d)
    prod = q.double() * kd
    want = prod.sum(-1) * 0.1
    bound = prod.abs().sum(-1) * 0.1 * 2.0**-20  # fp32 summation of d exact products
    assert ((lse.double() - want).abs() <= bound).all()


# (KV heads, query heads per KV head, head_dim): SmolLM2's; the generic head_dim; 24 query
# heads (two lane groups in the tile path's softmax) at head_dim 128; 17 per KV head (more
# than a tile's rows: the AVX512-BF16 path)
# (KV heads, group, head_dim): the AVX-512 path takes up to 16 / (head_dim / 16) heads of a
# group at once (17 and 5: a partial last batch of heads; 32 and 256: its other instances)
SHAPES = [(3, 3, 64), (3, 3, 40), (2, 12, 128), (1, 17, 64), (2, 5, 32), (1, 2, 256)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_kernel_matches_dequantizing_reference(fmt: torch.dtype, qdtype: torch.dtype,
                                                      shape: tuple[int, int, int]) -> None:
    op = load_paged_decode()
    assert op is not None
    hkv, g, d = shape
    gen = torch.Generator().manual_seed(d + g)
    S = 700
    spread = torch.tensor([0.5, 2.0, 8.0])[:hkv]
    k = torch.randn(S, hkv, d, generator=gen) * spread[None, :, None]
    v = torch.randn(S, hkv, d, generator=gen)
    ks = scales_from_amax(k.abs().amax(dim=(0, 2)), fmt)
    vs = scales_from_amax(v.abs().amax(dim=(0, 2)), fmt)
    k8, v8 = quantize(k, ks, fmt), quantize(v, vs, fmt)
    lens = [1, 15, 16, 17, 300, 650]
    starts = [0, 3, 0, 16, 100, 0]
    table = torch.stack([torch.randperm(S, generator=gen)[:650].int() for _ in lens])
    q = torch.randn(len(lens), hkv * g, d, generator=gen).to(qdtype)
    args = (table, torch.arange(len(lens)), torch.tensor(starts), torch.tensor(lens), 0.125)
    out, lse = op(q, k8, v8, *args, ks, vs)
    ref, ref_lse = paged_decode_reference(q, dequantize(k8, ks, torch.float32),
                                          dequantize(v8, vs, torch.float32), *args)
    tol = 1e-5 if qdtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_decode_kernel_avx512_bf16_path_without_amx(cpu_tier: CpuIsa) -> None:
    """On a CPU with AMX the bf16 tests above run the tile path; RADIXSERVE_NO_AMX=1 (read once
    per process) makes them run the AVX-512 path instead: the same tests, in a child."""
    if cpu_tier is not CpuIsa.AMX:
        pytest.skip("the tile path exists at the amx tier only")
    env = {**os.environ, ENV_NO_AMX: "1"}
    tests = "decode_kernel_reads_every_byte_code or decode_kernel_matches_dequantizing"
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)),
         "-k", tests], env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
    assert " passed" in child.stdout and "failed" not in child.stdout


def test_decode_kernel_refuses_an_8bit_pool_without_scales() -> None:
    op = load_paged_decode()
    assert op is not None
    cache = torch.zeros(4, 1, 64, dtype=torch.float8_e4m3fn)
    one = torch.ones(1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="k_scale and v_scale"):
        op(torch.zeros(1, 2, 64), cache, cache, torch.zeros(1, 4, dtype=torch.int32),
           torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), one, 0.1)


@pytest.mark.parametrize("prefix", [0, 1, 77, 300])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_kernel_reads_8bit_prefix_in_place(fmt: torch.dtype, qdtype: torch.dtype, d: int,
                                                  prefix: int) -> None:
    """The native prefill kernel over an 8-bit pool (scales given) equals the same kernel over
    the pool dequantized to q's dtype, bit for bit, and the float64 reference."""
    op = load_prefill_attention()
    assert op is not None
    gen = torch.Generator().manual_seed(prefix + d)
    S, hkv, g, m = 400, 2, 3, 45
    k_raw = torch.randn(S, hkv, d, generator=gen) * torch.tensor([1.0, 6.0])[None, :, None]
    v_raw = torch.randn(S, hkv, d, generator=gen)
    ks = scales_from_amax(k_raw.abs().amax(dim=(0, 2)), fmt)
    vs = scales_from_amax(v_raw.abs().amax(dim=(0, 2)), fmt)
    k8, v8 = quantize(k_raw, ks, fmt), quantize(v_raw, vs, fmt)
    slots = torch.randperm(S, generator=gen)[:prefix].int()
    q = torch.randn(m, hkv * g, d, generator=gen).to(qdtype)
    k = torch.randn(m, hkv, d, generator=gen).to(qdtype)
    v = torch.randn(m, hkv, d, generator=gen).to(qdtype)
    out, lse = op(q, k, v, k8, v8, slots, 0.125, ks, vs)
    k_full, v_full = dequantize(k8, ks, qdtype), dequantize(v8, vs, qdtype)
    want, want_lse = op(q, k, v, k_full, v_full, slots, 0.125)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    ref, ref_lse = prefill_attention_reference(q, k, v, k_full, v_full, slots, 0.125)
    tol = 3e-5 if qdtype == torch.float32 else 1e-2  # the K (scale 6) makes scores of ~10
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-4)


def test_prefill_kernel_refuses_an_8bit_pool_without_scales() -> None:
    op = load_prefill_attention()
    assert op is not None
    cache = torch.zeros(4, 1, 64, dtype=torch.float8_e4m3fn)
    x = torch.zeros(2, 1, 64)
    with pytest.raises(RuntimeError, match="k_scale and v_scale"):
        op(x, x, x, cache, cache, torch.zeros(1, dtype=torch.int32), 0.1)


def on_grid(x: torch.Tensor, scale: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """x moved onto the 8-bit grid (what the pool will hold), in fp32."""
    return dequantize(quantize(x, scale, fmt), scale, torch.float32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_backend_over_8bit_pool_equals_backend_over_dequantized_pool(case: str, kernel: str,
                                                                     fmt: torch.dtype) -> None:
    phase, prefix_lens, extend_lens, groups = CASES[case]
    gen = torch.Generator().manual_seed(len(case) + 1)
    seq = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
    table = make_table(seq, groups, False, gen)
    meta = build_meta(phase, prefix_lens, extend_lens, table, groups)
    T = sum(extend_lens)
    spread = torch.tensor([1.0, 5.0])[None, :, None]
    k_raw = torch.randn(NUM_SLOTS, HKV, D, generator=gen) * spread
    v_raw = torch.randn(NUM_SLOTS, HKV, D, generator=gen)
    ks = scales_from_amax(k_raw.abs().amax(dim=(0, 2)), fmt)
    vs = scales_from_amax(v_raw.abs().amax(dim=(0, 2)), fmt)
    k8, v8 = quantize(k_raw, ks, fmt), quantize(v_raw, vs, fmt)
    q = torch.randn(T, HKV * G, D, generator=gen)
    # the new tokens' K/V already on the grid: the long-prefill path attends to them as given,
    # every other path as stored; on the grid both are the same values
    k = on_grid(torch.randn(T, HKV, D, generator=gen) * spread, ks, fmt)
    v = on_grid(torch.randn(T, HKV, D, generator=gen), vs, fmt)
    backend = TorchAttentionBackend()
    if kernel == "native":
        backend = TorchAttentionBackend(load_paged_decode(), load_prefill_attention())
    out = backend.forward(q, k, v, k8, v8, meta, D**-0.5, KVScale(ks, vs))
    k_full, v_full = dequantize(k8, ks, torch.float32), dequantize(v8, vs, torch.float32)
    assert torch.equal(k_full[meta.out_slots], k) and torch.equal(v_full[meta.out_slots], v)
    ref = reference(q, k_full, v_full, meta, D**-0.5)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)

"""The native skinny GEMM (csrc/skinny_gemm.cpp) against its float64 reference, its batch
invariance (a row's bits do not depend on the other rows), and the float linears' use of it:
decode steps (at most MAX_ROWS rows) take it when RADIXSERVE_CPU_SKINNY_GEMM=1 opts in, prefill
keeps oneDNN; under each CPU tier this host executes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve import LLM
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.model.cpu_linear import GateUp, Linear, can_prepack
from radixserve.model.families.registry import load_model, read_model_spec
from radixserve.model.layers.linear import FloatMethod, linear_method
from radixserve.model.skinny_kernel import (
    ENV_SKINNY,
    MAX_ROWS,
    SkinnyLinear,
    load_skinny_linear,
    skinny_reference,
)
from tests.model.test_families import engine_tokens, hf_greedy
from tests.model.test_parity import random_prompts

pytestmark = pytest.mark.usefixtures("cpu_tier")

DTYPES = (torch.float32, torch.bfloat16)
# N off the 4-row tile, K off every vector width (1, 8, 16 inputs), a K below one vector
SHAPES = ((1, 1), (5, 17), (33, 99), (67, 130), (130, 577))


@pytest.fixture
def op() -> SkinnyLinear:
    """The op at the test's tier (cpu_tier set $RADIXSERVE_CPU_ISA before this runs)."""
    loaded = load_skinny_linear()
    if loaded is None:
        pytest.skip("the native CPU kernels are unavailable here")
    return loaded


def _operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int
              ) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x, w, up = (torch.randn(*s, generator=g).to(dtype) for s in ((m, k), (n, k), (n, k)))
    bias, res = torch.randn(n, generator=g).to(dtype), torch.randn(m, n, generator=g).to(dtype)
    return x, w, up, bias, res


def _check(y: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor, k: int) -> None:
    """|y - ref| within fp32 accumulation over k terms of |x| . |w| (`scale`) plus the
    rounding to y's dtype (half an ulp; bf16 8 bits)."""
    out_eps = 2.0**-8 if y.dtype == torch.bfloat16 else 2.0**-23
    bound = (k + 2) * 2.0**-23 * scale + out_eps * ref.abs() + 1e-30
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), f"max error {err.max().item()} over {(err / bound).max()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_op_matches_float64(op: SkinnyLinear, dtype: torch.dtype, n: int, k: int) -> None:
    for m in (*range(1, MAX_ROWS + 1), MAX_ROWS + 3):
        x, w, up, bias, res = _operands(m, n, k, dtype, seed=m * n + k)
        scale = x.double().abs() @ w.double().abs().T  # (m, n)
        y = op(x, w, None, None, None)
        assert y.shape == (m, n) and y.dtype == dtype
        _check(y, skinny_reference(x, w), scale, k)
        _check(op(x, w, bias, res, None), skinny_reference(x, w, bias, res),
               scale + bias.double().abs() + res.double().abs(), k)
        # silu(g) * u: g's error times |u| (silu' <= 1.1), u's error times |silu(g)| <= |g|
        g, u = x.double() @ w.double().T, x.double() @ up.double().T
        uscale = x.double().abs() @ up.double().abs().T
        _check(op(x, w, None, None, up), skinny_reference(x, w, up=up),
               1.1 * scale * u.abs() + g.abs() * uscale + scale * uscale * 2.0**-20, k)


def test_mixed_dtypes_and_empty_rows(op: SkinnyLinear) -> None:
    x, w, _, bias, _ = _operands(3, 20, 40, torch.float32, seed=1)
    y = op(x, w.bfloat16(), bias.bfloat16(), None, None)  # fp32 activations, bf16 weight
    assert y.dtype == torch.float32
    _check(y, skinny_reference(x, w.bfloat16(), bias.bfloat16()),
           x.abs().double() @ w.bfloat16().abs().double().T + bias.abs().double(), 40)
    assert op(x[:0], w, None, None, None).shape == (0, 20)
    with pytest.raises(RuntimeError, match="residual"):
        op(x, w, None, torch.zeros(2, 20), None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_row_is_the_same_bits_at_any_row_count(op: SkinnyLinear,
                                                     dtype: torch.dtype) -> None:
    """Batch invariance: row i of an M-row call equals the 1-row call of that row."""
    x, w, up, bias, res = _operands(2 * MAX_ROWS + 1, 70, 333, dtype, seed=7)
    alone = [(op(x[i:i + 1], w, bias, res[i:i + 1], None), op(x[i:i + 1], w, None, None, up))
             for i in range(x.shape[0])]
    for m in range(1, x.shape[0] + 1):
        y, gated = op(x[:m], w, bias, res[:m], None), op(x[:m], w, None, None, up)
        for i in range(m):
            assert torch.equal(y[i:i + 1], alone[i][0]), (m, i)
            assert torch.equal(gated[i:i + 1], alone[i][1]), (m, i)


class Spy:
    """The op, counting its calls."""

    def __init__(self, op: SkinnyLinear) -> None:
        self.op, self.calls = op, 0

    def __call__(self, *args: torch.Tensor | None) -> torch.Tensor:
        self.calls += 1
        return self.op(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_rows_take_the_op_and_prefill_keeps_onednn(op: SkinnyLinear,
                                                         dtype: torch.dtype) -> None:
    spy = Spy(op)
    x, w, up, bias, res = _operands(MAX_ROWS + 24, 64, 96, dtype, seed=3)
    lin, gu = Linear(w, bias, skinny=spy), GateUp.make(torch.cat([w, up]), skinny=spy)
    assert gu is not None and lin.packed is None and lin.weight is not None
    assert lin.nbytes == (w.numel() + bias.numel()) * w.element_size()  # one copy
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for m, calls in ((1, 3), (MAX_ROWS, 3), (MAX_ROWS + 1, 0), (MAX_ROWS + 24, 0)):
        spy.calls = 0
        ref = skinny_reference(x[:m], w, bias)
        torch.testing.assert_close(lin(x[:m]).double(), ref, rtol=tol, atol=tol)
        torch.testing.assert_close(lin.add_to(res[:m], x[:m]).double(),
                                   ref + res[:m].double(), rtol=tol, atol=tol)
        torch.testing.assert_close(gu(x[:m]).double(), skinny_reference(x[:m], w, up=up),
                                   rtol=2 * tol, atol=2 * tol)
        assert spy.calls == calls, m


@pytest.fixture
def opted_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_SKINNY, "1")


def test_off_by_default_the_float_linears_keep_onednn_prepacked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_SKINNY, raising=False)
    method = linear_method(None, torch.device("cpu"))
    assert isinstance(method, FloatMethod) and method.skinny is None
    lin = Linear(torch.randn(16, 8))
    assert lin.skinny is None
    if can_prepack(torch.device("cpu"), torch.float32):
        assert lin.packed is not None and lin.weight is None


@pytest.mark.usefixtures("opted_in")
def test_the_float_method_loads_the_op_once_for_cpu() -> None:
    method = linear_method(None, torch.device("cpu"))
    assert isinstance(method, FloatMethod) and method.skinny is not None
    w = torch.randn(16, 8)
    assert Linear(w, skinny=method.skinny).skinny is method.skinny
    # prepacked=False (the fused path) keeps F.linear; no op, no oneDNN
    plain = Linear(w, prepacked=False, skinny=method.skinny)
    assert plain.skinny is None and plain.packed is None and plain.weight is w


@pytest.mark.usefixtures("opted_in")
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_loaded_models_float_linears_run_the_op(op: SkinnyLinear, tiny_llama_tied: Path,
                                                  dtype: torch.dtype) -> None:
    """Every projection (QKV, O, the SwiGLU pair, down) and the LM head hold the plain weight
    and the op; the tied LM head is the embedding's own tensor (no second copy)."""
    model = load_model(tiny_llama_tied, read_model_spec(tiny_llama_tied),
                       TorchAttentionBackend(), 64, dtype, torch.device("cpu"))
    layers: list[Any] = list(model.layers)  # Llama-order layers: qkv, o_proj, mlp
    for layer in layers:
        for kernel in (layer.qkv.kernel, layer.o_proj.kernel, layer.mlp.down.kernel):
            assert isinstance(kernel, Linear) and kernel.skinny is not None
            assert kernel.packed is None and kernel.weight is not None
        assert isinstance(layer.mlp.packed, GateUp) and layer.mlp.packed.skinny is not None
    head = model.lm_head.kernel
    assert isinstance(head, Linear) and head.skinny is not None and head.weight is not None
    assert head.weight.data_ptr() == model.embed.data_ptr()


@pytest.mark.usefixtures("opted_in")
def test_opted_in_greedy_fp32_tokens_equal_hf(op: SkinnyLinear, tiny_llama_tied: Path) -> None:
    """The engine on the op (decode) and oneDNN on the plain weight (prefill), cache on: HF's
    greedy tokens, batch of 3 (rows 1-3 through the op) and the same prompts from the tree."""
    prompts = random_prompts([5, 17, 40], 200, seed=3)
    llm = LLM(model=str(tiny_llama_tied), dtype="float32", kv_cache_tokens=2048)
    want = hf_greedy(tiny_llama_tied, prompts, 6)  # engine_tokens: 6 new tokens
    assert engine_tokens(llm, prompts) == want
    assert engine_tokens(llm, prompts) == want

"""The native panel GEMM (csrc/panel_gemm.cpp) against its float64 reference, its packing, its
batch invariance (a row's bits do not depend on the other rows), and the float linears' use of
it by default (RADIXSERVE_CPU_PANEL_GEMM=0: oneDNN's prepacked weights); under each CPU tier
this host executes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve import LLM
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.model.cpu_linear import ENV_PANEL, GateUp, Linear, can_prepack
from radixserve.model.families.registry import load_model, read_model_spec
from radixserve.model.layers.linear import FloatMethod, linear_method
from radixserve.model.panel_kernel import (
    PanelOp,
    load_panel_op,
    pack,
    pack_gated,
    panel_reference,
    unpack,
)
from tests.model.test_families import engine_tokens, hf_greedy
from tests.model.test_parity import random_prompts

pytestmark = pytest.mark.usefixtures("cpu_tier")

DTYPES = (torch.float32, torch.bfloat16)
# N off the panel width (1, 16, 32 channels), K odd and off every vector width, K below one
SHAPES = ((1, 1), (5, 17), (33, 99), (67, 130), (130, 577))
ROWS = (1, 2, 3, 5, 8, 13, 25, 50)  # every tile height, several tiles and row chunks


@pytest.fixture
def op() -> PanelOp:
    """The op at the test's tier (cpu_tier set $RADIXSERVE_CPU_ISA before this runs)."""
    loaded = load_panel_op()
    if loaded is None:
        pytest.skip("the native CPU kernels are unavailable here")
    return loaded


def _operands(m: int, n: int, k: int, dtype: torch.dtype, seed: int
              ) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x, w, up = (torch.randn(*s, generator=g).to(dtype) for s in ((m, k), (n, k), (n, k)))
    bias, res = torch.randn(n, generator=g), torch.randn(m, n, generator=g).to(dtype)
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
def test_pack_is_a_layout_of_the_same_weight(op: PanelOp, dtype: torch.dtype, n: int,
                                             k: int) -> None:
    w = torch.randn(n, k).to(dtype)
    packed = pack(w, op.width)
    panels = -(-n // op.width)
    assert packed.dtype == dtype and packed.is_contiguous()
    assert packed.shape == ((panels, k, op.width) if dtype == torch.float32
                            else (panels, (k + 1) // 2, op.width, 2))
    assert torch.equal(unpack(packed, n, k), w)
    assert op.width in (16, 32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_op_matches_float64(op: PanelOp, dtype: torch.dtype, n: int, k: int) -> None:
    for m in ROWS:
        x, w, up, bias, res = _operands(m, n, k, dtype, seed=m * n + k)
        packed, gated = pack(w, op.width), pack_gated(w, up, op.width)
        scale = x.double().abs() @ w.double().abs().T  # (m, n)
        y = op.linear(x, packed, n, None, None, False)
        assert y.shape == (m, n) and y.dtype == dtype
        _check(y, panel_reference(x, w), scale, k)
        _check(op.linear(x, packed, n, bias, res, False), panel_reference(x, w, bias, res),
               scale + bias.double().abs() + res.double().abs(), k)
        # silu(g) * u: g's error times |u| (silu' <= 1.1), u's error times |silu(g)| <= |g|
        g, u = x.double() @ w.double().T, x.double() @ up.double().T
        uscale = x.double().abs() @ up.double().abs().T
        _check(op.linear(x, gated, n, None, None, True), panel_reference(x, w, up=up),
               1.1 * scale * u.abs() + g.abs() * uscale + scale * uscale * 2.0**-20, k)


def test_mixed_dtypes_empty_rows_and_bad_operands(op: PanelOp) -> None:
    x, w, _, bias, _ = _operands(3, 20, 41, torch.float32, seed=1)
    wb = w.bfloat16()
    y = op.linear(x, pack(wb, op.width), 20, bias, None, False)  # fp32 x, bf16 weight
    assert y.dtype == torch.float32
    _check(y, panel_reference(x, wb, bias),
           x.abs().double() @ wb.abs().double().T + bias.abs().double(), 41)
    yb = op.linear(x.bfloat16(), pack(w, op.width), 20, None, None, False)  # bf16 x, fp32 w
    assert yb.dtype == torch.bfloat16
    _check(yb, panel_reference(x.bfloat16(), w), x.abs().double() @ w.abs().double().T, 41)
    packed = pack(w, op.width)
    assert op.linear(x[:0], packed, 20, None, None, False).shape == (0, 20)
    with pytest.raises(RuntimeError, match="residual"):
        op.linear(x, packed, 20, None, torch.zeros(2, 20), False)
    with pytest.raises(RuntimeError, match="cover"):
        op.linear(x, packed, 20 + op.width, None, None, False)
    with pytest.raises(RuntimeError, match="panels"):
        op.linear(x[:, :40], packed, 20, None, None, False)  # K does not match the packing


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_row_is_the_same_bits_at_any_row_count(op: PanelOp, dtype: torch.dtype) -> None:
    """Batch invariance: row i of an M-row call equals the 1-row call of that row, for decode
    sizes and prefill chunks alike."""
    x, w, up, bias, res = _operands(53, 70, 333, dtype, seed=7)
    packed, gated = pack(w, op.width), pack_gated(w, up, op.width)
    alone = torch.cat([op.linear(x[i:i + 1], packed, 70, bias, res[i:i + 1], False)
                       for i in range(53)])
    alone_gated = torch.cat([op.linear(x[i:i + 1], gated, 70, None, None, True)
                             for i in range(53)])
    for m in (2, 7, 12, 13, 25, 53):
        assert torch.equal(op.linear(x[:m], packed, 70, bias, res[:m], False), alone[:m]), m
        assert torch.equal(op.linear(x[:m], gated, 70, None, None, True), alone_gated[:m]), m


class Spy:
    """The op, counting its calls."""

    def __init__(self, op: PanelOp) -> None:
        self.inner, self.calls = op, 0
        self.width = op.width

    def linear(self, *args: Any) -> torch.Tensor:
        self.calls += 1
        return self.inner.linear(*args)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_and_gate_up_run_the_op_at_every_row_count(op: PanelOp,
                                                         dtype: torch.dtype) -> None:
    spy: Any = Spy(op)
    x, w, up, bias, res = _operands(40, 64, 96, dtype, seed=3)
    lin, gu = Linear(w, bias.to(dtype), panel=spy), GateUp.make(torch.cat([w, up]), panel=spy)
    assert gu is not None and lin.packed is None and lin.weight is None
    assert lin.panels is not None and lin.nbytes == _bytes(lin.panels) + (4 + w.element_size()) * 64
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for m in (1, 8, 40):
        spy.calls = 0
        ref = panel_reference(x[:m], w, bias.to(dtype))
        torch.testing.assert_close(lin(x[:m]).double(), ref, rtol=tol, atol=tol)
        torch.testing.assert_close(lin.add_to(res[:m], x[:m]).double(),
                                   ref + res[:m].double(), rtol=tol, atol=tol)
        torch.testing.assert_close(gu(x[:m]).double(), panel_reference(x[:m], w, up=up),
                                   rtol=2 * tol, atol=2 * tol)
        assert spy.calls == 3, m
    y3 = lin(x[:6].view(2, 3, 96))  # leading dims flattened and restored
    assert y3.shape == (2, 3, 64) and torch.equal(y3.view(6, 64), lin(x[:6]))


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_the_float_method_loads_the_op_once_for_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_PANEL, raising=False)
    method = linear_method(None, torch.device("cpu"))
    assert isinstance(method, FloatMethod)
    if method.panel is None:
        pytest.skip("the native CPU kernels are unavailable here")
    w = torch.randn(16, 8)
    assert Linear(w, panel=method.panel).panel is method.panel
    # prepacked=False (the fused path) keeps F.linear; no op, no oneDNN
    plain = Linear(w, prepacked=False, panel=method.panel)
    assert plain.panel is None and plain.packed is None and plain.weight is w


def test_opted_out_the_float_linears_keep_onednn_prepacked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_PANEL, "0")
    method = linear_method(None, torch.device("cpu"))
    assert isinstance(method, FloatMethod) and method.panel is None
    lin = Linear(torch.randn(16, 8))
    assert lin.panel is None and lin.panels is None
    if can_prepack(torch.device("cpu"), torch.float32):
        assert lin.packed is not None and lin.weight is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_loaded_models_float_linears_run_the_op(op: PanelOp, tiny_llama_tied: Path,
                                                  dtype: torch.dtype,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Every projection (QKV, O, the SwiGLU pair, down) and the LM head hold panels alone."""
    monkeypatch.delenv(ENV_PANEL, raising=False)
    model = load_model(tiny_llama_tied, read_model_spec(tiny_llama_tied),
                       TorchAttentionBackend(), 64, dtype, torch.device("cpu"))
    layers: list[Any] = list(model.layers)  # Llama-order layers: qkv, o_proj, mlp
    for layer in layers:
        for kernel in (layer.qkv.kernel, layer.o_proj.kernel, layer.mlp.down.kernel):
            assert isinstance(kernel, Linear) and kernel.panels is not None
            assert kernel.packed is None and kernel.weight is None
            assert kernel.panels.dtype == dtype
        assert isinstance(layer.mlp.packed, GateUp) and layer.mlp.packed.panels is not None
    head = model.lm_head.kernel
    assert isinstance(head, Linear) and head.panels is not None


def test_greedy_fp32_tokens_equal_hf(op: PanelOp, tiny_llama_tied: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine on the op (prefill and decode), cache on: HF's greedy tokens, batch of 3 and
    the same prompts again from the tree."""
    monkeypatch.delenv(ENV_PANEL, raising=False)
    prompts = random_prompts([5, 17, 40], 200, seed=3)
    llm = LLM(model=str(tiny_llama_tied), dtype="float32", kv_cache_tokens=2048)
    want = hf_greedy(tiny_llama_tied, prompts, 6)  # engine_tokens: 6 new tokens
    assert engine_tokens(llm, prompts) == want
    assert engine_tokens(llm, prompts) == want

"""The native MoE experts op (model/csrc/moe_experts.cpp) against its specification, the torch
grouped compute of layers/moe.py, under each CPU tier this host executes: uneven expert loads,
an idle expert, top-k 1 to 8, 1 to 64 tokens, widths off every vector length (tails), fp32
within 1e-5, bf16 within bf16's rounding, int8 experts against their dequantized weights,
expert parallelism's local range, bad input refused, and the block choosing the op."""

from __future__ import annotations

import pytest
import torch

from radixserve.model.layers.moe import MoEBlock, MoEWeights, Routing, grouped_experts
from radixserve.model.layers.moe_spec import MoESpec
from radixserve.model.moe_kernel import (
    MoEExpertsOp,
    load_moe_experts,
    native_fits,
    quantize_experts,
)
from radixserve.model_source import ModelLoadError

# every test under each CPU tier this host executes (tests/conftest.py's cpu_tier)
pytestmark = pytest.mark.usefixtures("cpu_tier")

CPU = torch.device("cpu")
EXPERTS, IDLE = 12, 1  # expert IDLE is never routed to


def native() -> MoEExpertsOp:
    op = load_moe_experts(CPU, torch.float32)
    assert op is not None, "the op must build where the tests run (gcc + ninja)"
    return op


def case(tokens: int, top_k: int, hidden: int, inter: int, seed: int
         ) -> tuple[torch.Tensor, Routing, torch.Tensor, torch.Tensor]:
    """x, a skewed routing (low experts take most pairs, IDLE none) and stacked weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    logits = torch.randn(tokens, EXPERTS, generator=g) + torch.linspace(3, -3, EXPERTS)
    logits[:, IDLE] = float("-inf")
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)  # (T, k) each
    gate_up = torch.randn(EXPERTS, 2 * inter, hidden, generator=g) * hidden**-0.5
    down = torch.randn(EXPERTS, hidden, inter, generator=g) * inter**-0.5
    return x, Routing(weights, ids), gate_up, down


# hidden 68 / expert width 38: tails after every vector width (16, 8, vdpbf16ps' 32), after
# the 4-channel tiles, and after the 32- and 64-channel tasks
@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize("top_k", [1, 2, 3, 8])
def test_fp32_matches_the_torch_path(tokens: int, top_k: int) -> None:
    x, routing, gate_up, down = case(tokens, top_k, 68, 38, seed=tokens * 10 + top_k)
    out = native()(x, routing.weights, routing.expert_ids, gate_up, down, 0)
    ref = grouped_experts(x, routing, gate_up, down, EXPERTS)
    assert out.dtype == torch.float32 and out.shape == x.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 64])
def test_bf16_within_bf16_rounding(tokens: int) -> None:
    x, routing, gate_up, down = case(tokens, 4, 96, 80, seed=tokens)
    xb, gub, db = x.bfloat16(), gate_up.bfloat16(), down.bfloat16()
    wb = routing.weights.bfloat16()
    out = native()(xb, wb, routing.expert_ids, gub, db, 0)
    assert out.dtype == torch.bfloat16
    # the exact value of the same bf16 inputs, and torch's bf16 path (which rounds each
    # expert's output, the weighting and every add to bf16) as the yardstick
    exact = grouped_experts(xb.float(), Routing(wb.float(), routing.expert_ids), gub.float(),
                            db.float(), EXPERTS)
    torch_bf16 = grouped_experts(xb, Routing(wb, routing.expert_ids), gub, db, EXPERTS)
    err = (out.float() - exact).abs().max().item()
    assert err <= max((torch_bf16.float() - exact).abs().max().item(), 1e-3) * 1.5
    torch.testing.assert_close(out.float(), exact, rtol=2e-2, atol=2e-2)


def test_expert_parallel_rank_sums_only_its_experts() -> None:
    x, routing, gate_up, down = case(23, 3, 64, 32, seed=5)
    first, local = 4, 4
    part = native()(x, routing.weights, routing.expert_ids, gate_up[first : first + local],
                    down[first : first + local], first)
    ref = grouped_experts(x, routing, gate_up[first : first + local],
                          down[first : first + local], EXPERTS, first_expert=first)
    torch.testing.assert_close(part, ref, rtol=1e-5, atol=1e-6)
    # no pair on this rank (every token routed elsewhere): zeros
    elsewhere = Routing(routing.weights, torch.zeros_like(routing.expert_ids))
    none = native()(x, elsewhere.weights, elsewhere.expert_ids, gate_up[first : first + local],
                    down[first : first + local], first)
    assert torch.equal(none, torch.zeros_like(x))


def test_bad_input_is_refused() -> None:
    x, routing, gate_up, down = case(3, 2, 64, 32, seed=6)
    with pytest.raises(RuntimeError, match="in x's dtype"):
        native()(x, routing.weights, routing.expert_ids, gate_up.bfloat16(), down, 0)
    with pytest.raises(RuntimeError, match="int64"):
        native()(x, routing.weights, routing.expert_ids.int(), gate_up, down, 0)
    with pytest.raises(RuntimeError, match="down must be"):
        native()(x, routing.weights, routing.expert_ids, gate_up, down[:, :, :16].contiguous(), 0)


def test_block_runs_the_op_on_the_stacked_weights() -> None:
    x, _, gate_up, down = case(9, 4, 64, 32, seed=7)
    router = torch.randn(EXPERTS, 64, generator=torch.Generator().manual_seed(8))
    spec = MoESpec(num_experts=EXPERTS, top_k=4, expert_size=32, renormalize=True)
    weights = MoEWeights(router=router, gate_up=gate_up, down=down)
    block, torch_block = MoEBlock(spec, weights), MoEBlock(spec, weights, native=False)
    assert block.native is not None and block.packed is None and block.gate_up is gate_up
    assert torch_block.native is None
    torch.testing.assert_close(block(x, x), torch_block(x, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_experts_match_the_dequantized_weights(dtype: torch.dtype) -> None:
    x, routing, gate_up, down = case(17, 4, 68, 38, seed=9)
    (gq, gs), (dq, ds) = quantize_experts(gate_up), quantize_experts(down)
    assert gq.dtype == torch.int8 and gs.shape == (EXPERTS, 76) and ds.shape == (EXPERTS, 68)
    out = native()(x.to(dtype), routing.weights.to(dtype), routing.expert_ids, gq, dq, 0, gs,
                   ds)
    assert out.dtype == dtype
    ref = grouped_experts(x.to(dtype).float(), routing, gq.float() * gs[..., None],
                          dq.float() * ds[..., None], EXPERTS)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    else:  # h rounded to bf16 as a bf16 layer rounds it, the output once
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    with pytest.raises(RuntimeError, match="gate_up_scale"):
        native()(x, routing.weights, routing.expert_ids, gq, dq, 0)


def test_int8_block_needs_the_native_op() -> None:
    _, _, gate_up, down = case(1, 2, 64, 32, seed=10)
    spec = MoESpec(num_experts=EXPERTS, top_k=2, expert_size=32, renormalize=True)
    weights = MoEWeights(router=torch.randn(EXPERTS, 64), gate_up=gate_up, down=down)
    block = MoEBlock(spec, weights, int8=True)
    assert block.gate_up is not None and block.gate_up.dtype == torch.int8
    assert block.nbytes < weights.nbytes / 3.5
    with pytest.raises(ModelLoadError, match="native CPU MoE kernel"):
        MoEBlock(spec, weights, native=False, int8=True)


def test_bf16_prefill_without_bf16_dot_products_goes_to_onednn() -> None:
    assert native_fits(16, 4, 32, torch.bfloat16, bf16_dot=False)  # ~2 rows per expert
    assert not native_fits(1024, 4, 32, torch.bfloat16, bf16_dot=False)  # 128 per expert
    assert native_fits(1024, 4, 32, torch.bfloat16, bf16_dot=True)
    assert native_fits(1024, 4, 32, torch.float32, bf16_dot=False)


# moe_rows.h streams each weight row alone at up to 8 rows per expert and runs the micro
# tiles above: an expert at 8 and one at 9 rows, widths off every vector length, each dtype
@pytest.mark.parametrize("tokens", [8, 9])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_rows_streamed_and_tiled_match_the_torch_path(tokens: int, dtype: str) -> None:
    x, _, gate_up, down = case(tokens, 2, 100, 70, seed=tokens)
    ids = torch.stack([torch.zeros(tokens, dtype=torch.long),
                       2 + torch.arange(tokens) % 3], dim=1)  # (T, 2): expert 0 takes all
    w = torch.full((tokens, 2), 0.5)
    scales: tuple[torch.Tensor, ...] = ()
    if dtype == "int8":
        (gate_up, gs), (down, ds) = quantize_experts(gate_up), quantize_experts(down)
        scales = (gs, ds)
    xt = x.bfloat16() if dtype == "bf16" else x
    wt = gate_up.bfloat16() if dtype == "bf16" else gate_up
    dt = down.bfloat16() if dtype == "bf16" else down
    out = native()(xt, w.to(xt.dtype), ids, wt, dt, 0, *scales)
    ref_gu = gate_up.float() * scales[0][..., None] if scales else wt.float()
    ref_dn = down.float() * scales[1][..., None] if scales else dt.float()
    ref = grouped_experts(xt.float(), Routing(w, ids), ref_gu, ref_dn, EXPERTS)
    tol = 1e-5 if dtype != "bf16" else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)

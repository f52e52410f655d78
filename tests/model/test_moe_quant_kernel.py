"""The native quantized-experts op (model/csrc/moe/moe_quant.cpp) against its specification,
the torch grouped compute on the dequantized weights, under each CPU tier this host executes:
int4 (group, odd input count, zero points), int8 and FP8 (per channel, blocks with a
partial last group) experts, decode-sized and prefill-sized row counts per expert (the
decode blocks and the dequantized-chunk route), an idle expert, expert parallelism's local
range, bf16 activations; and the torch path on the Triton layout (the fused model's unfused
forward)."""

from __future__ import annotations

import pytest
import torch

from radixserve.model.layers.moe import Routing, grouped_experts
from radixserve.model.layers.moe_quant import QuantExperts
from radixserve.model.quantization.experts import (
    StackedQWeight,
    quantize_experts_fp8,
    quantize_experts_int,
    stack_experts,
)
from radixserve.model.quantization.qweight import quantize_fp8

pytestmark = pytest.mark.usefixtures("cpu_tier")

EXPERTS, IDLE = 6, 2


def _stack(w: torch.Tensor, kind: str, group: int) -> StackedQWeight:
    """(E, N, K) float -> one quantized stack (round to nearest, the tests' formats)."""
    if kind == "fp8-channel":
        return quantize_experts_fp8(w)
    if kind == "fp8":
        return stack_experts([quantize_fp8(w[e], group) for e in range(w.shape[0])], "fp8")
    return quantize_experts_int(w, 4 if kind.startswith("int4") else 8, group,
                                symmetric=kind != "int4-zp")


def _case(tokens: int, top_k: int, hidden: int, inter: int, kind: str, group: int, seed: int
          ) -> tuple[torch.Tensor, Routing, StackedQWeight, StackedQWeight]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    logits = torch.randn(tokens, EXPERTS, generator=g) + torch.linspace(2, -2, EXPERTS)
    logits[:, IDLE] = float("-inf")
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    gate_up = torch.randn(EXPERTS, 2 * inter, hidden, generator=g) * hidden**-0.5
    down = torch.randn(EXPERTS, hidden, inter, generator=g) * inter**-0.5
    return (x, Routing(weights, ids), _stack(gate_up, kind, group),
            _stack(down, kind, min(group, inter)))


def _reference(x: torch.Tensor, routing: Routing, gu: StackedQWeight, dn: StackedQWeight,
               first: int = 0) -> torch.Tensor:
    return grouped_experts(x.double(), Routing(routing.weights.double(), routing.expert_ids),
                           gu.dequantize().double(), dn.dequantize().double(), EXPERTS + first,
                           first).to(x.dtype)


# hidden 67 (odd: int4's padded input), expert width 40 (not a multiple of 16)
KINDS = [("int4", 32), ("int4-zp", 16), ("int8", 67), ("fp8-channel", 67), ("fp8", 48)]


@pytest.mark.parametrize("tokens", [1, 3, 40])  # 40 x top-2: prefill-sized runs per expert
@pytest.mark.parametrize(("kind", "group"), KINDS)
def test_native_op_matches_the_dequantized_reference(tokens: int, kind: str,
                                                     group: int) -> None:
    hidden = 68 if kind.startswith("int4") and group == 16 else 67
    x, routing, gu, dn = _case(tokens, 2, hidden, 40, kind, group, seed=tokens)
    experts = QuantExperts(gu, dn, EXPERTS, 0, fused=False)
    assert experts.op is not None, "the op must build where the tests run (gcc + ninja)"
    torch.testing.assert_close(experts(x, routing), _reference(x, routing, gu, dn),
                               rtol=1e-5, atol=1e-5)


def test_expert_parallel_range_and_bf16() -> None:
    x, routing, gu, dn = _case(9, 3, 64, 32, "int4", 32, seed=5)
    part = QuantExperts(  # experts [2, 6) held here, global ids 0..5 routed
        StackedQWeight(gu.kind, gu.codes[2:], gu.scale[2:], gu.zero[2:], 32),  # type: ignore[index]
        StackedQWeight(dn.kind, dn.codes[2:], dn.scale[2:], dn.zero[2:], 32),  # type: ignore[index]
        EXPERTS, 2, fused=False)
    got = part(x, routing)
    want = grouped_experts(x, routing, gu.dequantize()[2:], dn.dequantize()[2:], EXPERTS, 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    whole = QuantExperts(gu, dn, EXPERTS, 0, fused=False)
    bf16 = whole(x.bfloat16(), Routing(routing.weights.bfloat16(), routing.expert_ids))
    assert bf16.dtype == torch.bfloat16
    ref = _reference(x, routing, gu, dn)
    assert ((bf16.float() - ref).norm() / ref.norm()).item() < 2e-2


def test_torch_path_on_the_triton_layout() -> None:
    """A model built for the fused path runs its unfused forward (KV calibration) on the
    Triton layout's weights, dequantized expert by expert."""
    pytest.importorskip("triton")
    for kind, group in (("int4-zp", 16), ("fp8", 48)):
        x, routing, gu, dn = _case(5, 2, 64, 40, kind, group, seed=3)
        experts = QuantExperts(gu, dn, EXPERTS, 0, fused=True)
        assert experts.gpu is not None and experts.op is None
        torch.testing.assert_close(experts(x, routing, fused=False),
                                   _reference(x, routing, gu, dn), rtol=1e-5, atol=1e-5)

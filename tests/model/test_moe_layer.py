"""The MoE block (model/layers/moe.py) and its loader against HF's own sparse MoE blocks.

Each family's tiny random model is saved in both expert layouts; the block loaded from the
folder must reproduce HF's `mlp` module of each sparse layer on the same input (fp32), top-k
of 1, 2, 3 and 8; expert-parallel and tensor-parallel parts must sum to the whole layer.
The block runs the native op where it builds (tests/model/test_moe_kernel.py), at each tier.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from radixserve.config.parsing import ConfigError
from radixserve.model.layers.moe import MoEBlock, group_by_expert, route
from radixserve.model.layers.moe_spec import MoESpec, read_moe_spec
from radixserve.model.layers.moe_weights import ExpertPart, Take, expert_part, load_moe_weights
from radixserve.model_source import ModelLoadError
from tests.tiny_moe_models import FAMILIES, Layout, build_tiny_moe, save_tiny_moe

# under each CPU tier this host executes (tests/conftest.py's cpu_tier): the native MoE op's
pytestmark = pytest.mark.usefixtures("cpu_tier")


def _take_from(path: Path, stack: ExitStack) -> tuple[Take, set[str]]:
    sf = stack.enter_context(safe_open(str(path / "model.safetensors"), framework="pt"))
    keys = {k.removeprefix("model."): k for k in sf.keys()}

    def take(name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        if rows is None and cols is None:
            return sf.get_tensor(keys[name])
        part = sf.get_slice(keys[name])
        whole = slice(None)
        return part[rows or whole] if cols is None else part[rows or whole, cols]

    return take, set(keys)


def _spec_of(path: Path) -> MoESpec:
    cfg = json.loads((path / "config.json").read_text())
    return read_moe_spec(cfg["architectures"][0], cfg)


def _block(path: Path, layer: int, part: ExpertPart | None = None) -> MoEBlock:
    spec = _spec_of(path)
    with ExitStack() as stack:
        take, names = _take_from(path, stack)
        weights = load_moe_weights(take, names, f"layers.{layer}.", spec,
                                   part or expert_part(spec))
    return MoEBlock(spec, weights)


@pytest.mark.parametrize("layout", ["per_expert", "packed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_block_matches_hf(family: str, layout: Layout, tmp_path: Path) -> None:
    sparse = {"mlp_only_layers": [1]} if family in ("qwen3_moe", "qwen2_moe") else None
    hf = build_tiny_moe(family, num_layers=2, top_k=3, sparse=sparse)
    path = save_tiny_moe(hf, tmp_path / family, layout)
    spec = _spec_of(path)
    assert spec.top_k == 3 and spec.is_sparse(0)
    assert spec.is_sparse(1) == (sparse is None)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1))
    residual = torch.randn(37, 64)
    with torch.no_grad():
        ref = hf.model.layers[0].mlp(x.unsqueeze(0))[0]  # (T, hidden)
    block = _block(path, 0)
    torch.testing.assert_close(block(x, None), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(block(x, residual), residual + ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_top_k_and_batch_one(top_k: int, tmp_path: Path) -> None:
    hf = build_tiny_moe("qwen3_moe", num_layers=1, top_k=top_k)
    block = _block(save_tiny_moe(hf, tmp_path / "m"), 0)
    for rows in (1, 5):
        x = torch.randn(rows, 64)
        with torch.no_grad():
            ref = hf.model.layers[0].mlp(x.unsqueeze(0))[0]
        torch.testing.assert_close(block(x, None), ref, rtol=1e-5, atol=1e-5)


def test_routing_renormalises_only_when_asked() -> None:
    x, router = torch.randn(6, 16), torch.randn(8, 16)
    plain = route(x, router, 3, renormalize=False)
    norm = route(x, router, 3, renormalize=True)
    assert torch.equal(plain.expert_ids, norm.expert_ids)
    probs = torch.softmax(x @ router.T, dim=-1)
    torch.testing.assert_close(plain.weights, probs.topk(3).values)
    torch.testing.assert_close(norm.weights.sum(-1), torch.ones(6))


def test_grouping_sorts_pairs_by_expert_and_keeps_token_order() -> None:
    ids = torch.tensor([[3, 1], [1, 0], [3, 2], [0, 1]])  # (T=4, k=2)
    groups = group_by_expert(ids, num_experts=5, first_expert=0, num_local=5)
    assert groups.counts == [2, 3, 1, 2, 0]
    assert groups.pairs.tolist() == [3, 6, 1, 2, 7, 5, 0, 4]
    assert groups.token_rows.tolist() == [1, 3, 0, 1, 3, 2, 0, 2]
    local = group_by_expert(ids, num_experts=5, first_expert=1, num_local=2)
    assert local.counts == [3, 1] and local.pairs.tolist() == [1, 2, 7, 5]


@pytest.mark.parametrize("expert_parallel", [True, False])
@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_parallel_parts_sum_to_the_layer(family: str, expert_parallel: bool,
                                         tmp_path: Path) -> None:
    hf = build_tiny_moe(family, num_layers=1, top_k=2)
    path = save_tiny_moe(hf, tmp_path / "m", "packed" if expert_parallel else "per_expert")
    spec, x = _spec_of(path), torch.randn(23, 64)
    whole = _block(path, 0)(x, None)
    parts = [_block(path, 0, expert_part(spec, r, 2, expert_parallel)) for r in range(2)]
    if expert_parallel:
        assert [p.first_expert for p in parts] == [0, 4]
        assert all(p.num_local_experts == 4 for p in parts)
    total = parts[0](x, None) + parts[1](x, None)
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-5)


def test_indivisible_expert_parallel_is_refused() -> None:
    spec = MoESpec(num_experts=6, top_k=2, expert_size=32, renormalize=True)
    with pytest.raises(ConfigError, match="6 experts are not divisible by 4"):
        expert_part(spec, 0, 4, expert_parallel=True)
    assert expert_part(spec, 1, 3, expert_parallel=True).first_expert == 2


def test_spec_rejects_bad_configs() -> None:
    with pytest.raises(ModelLoadError, match="num_experts_per_tok 9"):
        MoESpec(num_experts=8, top_k=9, expert_size=4, renormalize=False)
    with pytest.raises(ModelLoadError, match="lacks 'intermediate_size'"):
        read_moe_spec("MixtralForCausalLM", {"num_experts_per_tok": 2})
    # Keys left out take transformers' defaults, as its config classes fill them in.
    qwen3 = read_moe_spec("Qwen3MoeForCausalLM", {"num_local_experts": 16})
    assert (qwen3.num_experts, qwen3.top_k, qwen3.expert_size) == (16, 8, 768)
    olmoe = read_moe_spec("OlmoeForCausalLM", {"intermediate_size": 32})
    assert (olmoe.num_experts, olmoe.top_k, olmoe.renormalize) == (64, 8, False)
    step = MoESpec(num_experts=4, top_k=2, expert_size=4, renormalize=False, sparse_step=2,
                   mlp_only_layers=(3,))
    assert step.sparse_layers(6) == [1, 5]

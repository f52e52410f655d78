"""Quantized MoE experts (issue 40): tiny random Qwen3-MoE / Mixtral checkpoints written in
each format give greedy fp32 tokens identical to HF transformers on the dequantized weights,
on the native CPU op, the torch path and the fused (Triton) path; the experts stay resident
quantized; unsupported combinations are load errors naming the option.

The formats' writers are tests/quant_checkpoints.py's (compressed-tensors' pack_to_int32
order, FP8 block / per-tensor scales); the package compressed-tensors is not installed here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve import LLM, SamplingParams
from radixserve.model.layers.moe import MoEBlock
from radixserve.model.layers.moe_quant import QuantExperts, QuantSharedExpert
from radixserve.model_source import ModelLoadError
from tests.model.test_fused_forward import (
    DEVICE,
    assert_paths_agree,
    runnable_kernels,  # noqa: F401  (a fixture)
)
from tests.model.test_parity import hf_greedy, random_prompts
from tests.quant_checkpoints import write_quantized
from tests.tiny_moe_models import make_tiny_moe

W4_G128 = ("compressed-tensors", {"format": "pack-quantized", "bits": 4, "group": 128})
W4_ZP = ("compressed-tensors", {"format": "pack-quantized", "bits": 4, "group": 32,
                                "symmetric": False})
FP8_CHANNEL = ("compressed-tensors", {"format": "float-quantized"})
CASES: list[tuple[str, dict[str, Any]]] = [
    W4_G128, W4_ZP, FP8_CHANNEL,
    ("compressed-tensors", {"format": "pack-quantized", "bits": 8}),  # W8A16 per channel
    ("fp8", {"block": (32, 48)}),  # weight_scale_inv, partial blocks at the edges
    ("fp8", {}),  # per-tensor weight_scale
    ("awq", {"group": 32}),  # AutoAWQ GEMM experts (its writer: groups dividing K)
    ("gptq", {"bits": 4, "group": 32, "sym": False}),
]
PROMPTS = random_prompts([5, 9, 23], 200)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # hidden and expert width 256: two groups of 128 along every expert's inputs
    return make_tiny_moe(tmp_path_factory.mktemp("moeq") / "qwen3_moe", "qwen3_moe",
                         hidden_size=256, expert_size=256, sparse={"mlp_only_layers": [1]},
                         num_layers=3)


def _greedy(model: Path, **kw: Any) -> tuple[LLM, list[list[int]]]:
    llm = LLM(model=str(model), dtype="float32", kv_cache_tokens=2048, **kw)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    return llm, [o.token_ids for o in outs]


def _blocks(llm: LLM) -> list[MoEBlock]:
    layers = llm.engine.runner.model.layers
    return [layer.mlp.block for layer in layers if hasattr(layer.mlp, "block")]


def _expert_ratio(llm: LLM, float_dtype_bytes: int = 2) -> float:
    """The quantized experts' resident bytes over the same experts in bf16."""
    quant = [b.quant for b in _blocks(llm)]
    assert quant and all(isinstance(q, QuantExperts) for q in quant)
    held = sum(q.nbytes for q in quant if q is not None)
    weights = sum(3 * q.num_local * q.inter * b.router.shape[1]
                  for b, q in zip(_blocks(llm), quant, strict=True) if q is not None)
    return held / (weights * float_dtype_bytes)


@pytest.mark.parametrize(("method", "opts"), CASES,
                         ids=[f"{m}-{i}" for i, (m, _) in enumerate(CASES)])
def test_quantized_experts_match_hf_on_dequantized(qwen3: Path, tmp_path: Path, method: str,
                                                   opts: dict[str, Any]) -> None:
    quant_dir, deq_dir = write_quantized(qwen3, tmp_path, method, **opts)
    llm, ours = _greedy(quant_dir)
    assert ours == hf_greedy(deq_dir, PROMPTS, 10)
    assert all(b.quant is not None and b.quant.op is not None for b in _blocks(llm))


def test_resident_expert_bytes(qwen3: Path, tmp_path: Path) -> None:
    """W4A16 group 128: at most 0.3x of the experts in bf16; FP8 per channel: at most 0.55x."""
    w4, _ = write_quantized(qwen3, tmp_path / "w4", W4_G128[0], **W4_G128[1])
    fp8, _ = write_quantized(qwen3, tmp_path / "fp8", FP8_CHANNEL[0], **FP8_CHANNEL[1])
    w4_ratio = _expert_ratio(LLM(model=str(w4), dtype="float32", kv_cache_tokens=1024))
    fp8_ratio = _expert_ratio(LLM(model=str(fp8), dtype="float32", kv_cache_tokens=1024))
    assert w4_ratio <= 0.3 and fp8_ratio <= 0.55, (w4_ratio, fp8_ratio)


def test_quantization_fp8_flag_on_a_float_moe(qwen3: Path, tmp_path: Path) -> None:
    """--quantization fp8: every linear, the experts included, per-channel FP8 at load (the
    router and the LM head stay float): HF on those dequantized weights."""
    _, deq_dir = write_quantized(qwen3, tmp_path, *FP8_CHANNEL[:1], **FP8_CHANNEL[1])
    llm, ours = _greedy(qwen3, quantization="fp8")
    assert ours == hf_greedy(deq_dir, PROMPTS, 10)
    assert _expert_ratio(llm) <= 0.55


def test_mixtral_w4a16(tmp_path: Path) -> None:
    src = make_tiny_moe(tmp_path / "mixtral", "mixtral", hidden_size=128, expert_size=64)
    quant_dir, deq_dir = write_quantized(src, tmp_path, "compressed-tensors",
                                         format="pack-quantized", bits=4, group=32)
    _, ours = _greedy(quant_dir)
    assert ours == hf_greedy(deq_dir, PROMPTS, 10)


def test_torch_path_without_the_native_op(qwen3: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """RADIXSERVE_NO_CPU_KERNELS=1: each active expert dequantized for its GEMMs."""
    monkeypatch.setenv("RADIXSERVE_NO_CPU_KERNELS", "1")
    quant_dir, deq_dir = write_quantized(qwen3, tmp_path, *W4_ZP[:1], **W4_ZP[1])
    llm, ours = _greedy(quant_dir)
    assert ours == hf_greedy(deq_dir, PROMPTS, 10)
    assert all(b.quant is not None and b.quant.op is None for b in _blocks(llm))


def _config(path: Path) -> dict[str, Any]:
    cfg: dict[str, Any] = json.loads((path / "config.json").read_text())
    return cfg


def test_partly_quantized_experts_are_refused(qwen3: Path, tmp_path: Path) -> None:
    quant_dir, _ = write_quantized(qwen3, tmp_path, *W4_ZP[:1], **W4_ZP[1])
    cfg = _config(quant_dir)
    cfg["quantization_config"]["ignore"].append("re:.*experts\\.3\\.down_proj$")
    (quant_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"experts\.3\.down_proj: stored in float"):
        LLM(model=str(quant_dir), dtype="float32", kv_cache_tokens=1024)


def test_act_order_experts_are_refused(tmp_path: Path) -> None:
    mixtral = make_tiny_moe(tmp_path / "mixtral", "mixtral", hidden_size=64)
    gptq, _ = write_quantized(mixtral, tmp_path, "gptq", bits=4, group=32, desc_act=True)
    with pytest.raises(ModelLoadError, match="act-order"):
        LLM(model=str(gptq), dtype="float32", kv_cache_tokens=1024)


def test_qwen2_moe_quantized_shared_expert(tmp_path: Path) -> None:
    """Qwen2-MoE's shared expert quantized with the experts (the dense layers' kernels), and
    per-channel FP8 under --quantization fp8: HF's tokens on the dequantized weights."""
    src = make_tiny_moe(tmp_path / "qwen2", "qwen2_moe", hidden_size=64,
                        sparse={"decoder_sparse_step": 2})
    quant_dir, deq_dir = write_quantized(src, tmp_path, *W4_ZP[:1], **W4_ZP[1])
    llm, ours = _greedy(quant_dir)
    assert ours == hf_greedy(deq_dir, PROMPTS, 10)
    assert all(isinstance(b.shared, QuantSharedExpert) for b in _blocks(llm))
    _, fp8_deq = write_quantized(src, tmp_path / "fp8", *FP8_CHANNEL[:1], **FP8_CHANNEL[1])
    _, ours = _greedy(src, quantization="fp8")
    assert ours == hf_greedy(fp8_deq, PROMPTS, 10)


def test_fp32_and_bf16_activations_agree(qwen3: Path, tmp_path: Path) -> None:
    """bf16 activations on the quantized experts: the same weights, tokens close to fp32's."""
    quant_dir, _ = write_quantized(qwen3, tmp_path, *W4_G128[:1], **W4_G128[1])
    _, fp32 = _greedy(quant_dir)
    llm = LLM(model=str(quant_dir), dtype="bfloat16", kv_cache_tokens=2048)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    first = [o.token_ids[0] for o in outs]
    assert sum(a == b[0] for a, b in zip(first, fp32, strict=True)) >= 2
    assert torch.bfloat16 == llm.engine.runner.model.embed.dtype


@pytest.mark.usefixtures("runnable_kernels")
@pytest.mark.parametrize(("method", "opts"), [W4_ZP, ("fp8", {"block": (32, 48)})],
                         ids=["w4a16-zp", "fp8-block"])
def test_fused_forward_with_quantized_experts(tmp_path: Path, method: str,
                                              opts: dict[str, Any]) -> None:
    """The model's fused path (the Triton fused MoE dequantizing its B tiles, under the
    interpreter on CPU) and the Triton backend's unfused loop (the torch path on the Triton
    layout) give the default CPU path's (the native op's) tokens and logits."""
    if DEVICE.type != "cpu":
        pytest.skip("the interpreter run")
    src = make_tiny_moe(tmp_path / "qwen3", "qwen3_moe", sparse={"mlp_only_layers": [1]})
    quant_dir, _ = write_quantized(src, tmp_path, method, **opts)
    assert_paths_agree(quant_dir, 5, None)


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "ep2"])
def test_tensor_and_expert_parallel_quantized_experts(tmp_path: Path, ep: bool) -> None:
    """TP 2 slices each expert's codes, scales and zero points (gate/up rows, down input
    columns with their groups); EP 2 places 4 whole quantized experts on each rank. The
    tokens stay HF's on the dequantized weights."""
    src = make_tiny_moe(tmp_path / "qwen3", "qwen3_moe", sparse={"mlp_only_layers": [1]})
    quant_dir, deq_dir = write_quantized(src, tmp_path, "compressed-tensors",
                                         format="pack-quantized", bits=4, group=16,
                                         symmetric=False)
    llm = LLM(model=str(quant_dir), dtype="float32", kv_cache_tokens=4096,
              tensor_parallel_size=2, enable_expert_parallel=ep)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10,
                                                    ignore_eos=True))
    finally:
        llm.close()
    assert [o.token_ids for o in outs] == hf_greedy(deq_dir, PROMPTS, 10)

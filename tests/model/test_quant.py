"""Int8 weights (model/quant.py): the quantizer, the matmul against a dequantized reference,
engine runs with quantization int8, and bad settings rejected at the edge."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from radixserve import LLM, SamplingParams
from radixserve.cli import build_config, build_parser
from radixserve.config import ConfigError, EngineConfig
from radixserve.model.quant import (
    WEIGHT_ONLY_MAX_ROWS,
    Int8Linear,
    Int8Weight,
    quantize_per_channel,
)
from radixserve.tokenizer import encode_chat


def dequantize(w: Int8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight (N, K) the int8 one stands for."""
    return (w.qweight.float() * w.scale[:, None]).to(dtype)


def test_per_channel_scales_and_round_trip() -> None:
    w = torch.tensor([[0.5, -1.27, 0.0, 0.01],
                      [2.54, 1.0, -2.0, 0.02],
                      [0.0, 0.0, 0.0, 0.0]])
    q = quantize_per_channel(w)
    assert q.qweight.dtype == torch.int8 and q.qweight.shape == (3, 4)
    assert q.scale.dtype == torch.float32 and q.scale.shape == (3,)
    assert torch.allclose(q.scale[:2], torch.tensor([0.01, 0.02]))
    assert q.qweight[0].tolist() == [50, -127, 0, 1]
    assert q.qweight[1].tolist() == [127, 50, -100, 1]
    assert q.qweight[2].tolist() == [0, 0, 0, 0]  # an all-zero row stays zero, finite scale
    assert torch.isfinite(q.scale).all()
    assert torch.allclose(dequantize(q), w, atol=1e-6)


def test_round_trip_error_is_at_most_half_a_step() -> None:
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 0.05
    q = quantize_per_channel(w)
    assert q.qweight.abs().max().item() == 127
    assert (q.qweight.abs().amax(dim=1) == 127).all()  # every row uses its full range
    err = (dequantize(q) - w).abs()
    assert (err <= q.scale[:, None] / 2 + 1e-7).all()
    assert dequantize(q, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("rows", [1, WEIGHT_ONLY_MAX_ROWS, WEIGHT_ONLY_MAX_ROWS + 1, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device_path", ["native", "torch"])
def test_int8_linear_matches_dequantized_reference(rows: int, dtype: torch.dtype,
                                                   device_path: str) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(80, 96, generator=gen) * 0.05
    bias = (torch.randn(80, generator=gen) * 0.1).to(dtype)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    # torch: the kernels where the native one did not build (and the CUDA path's math)
    lin = Int8Linear(w.to(dtype), bias, native="load" if device_path == "native" else None)
    assert (lin.native is None) == (device_path == "torch")
    ref = F.linear(x.float(), dequantize(quantize_per_channel(w.to(dtype))), bias.float())
    y = lin(x)
    assert y.shape == (rows, 80) and y.dtype == dtype
    rel = ((y.float() - ref).abs().max() / ref.abs().max()).item()
    assert rel < 0.01, rel  # weight-only: activations at most rounded to bf16
    residual = torch.randn(rows, 80, generator=gen).to(dtype)
    assert torch.allclose(lin.add_to(residual, x).float(), residual.float() + y.float(),
                          atol=0.05)


def test_int8_linear_is_far_from_a_wrong_weight() -> None:
    """The tolerance above is tight enough to catch a transposed or unscaled weight."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 64, generator=gen) * 0.05
    x = torch.randn(8, 64, generator=gen)
    y = Int8Linear(w)(x)
    for wrong in (w.t(), w * 2):
        ref = F.linear(x, wrong)
        assert ((y - ref).abs().max() / ref.abs().max()).item() > 0.1


def test_bad_quantization_is_a_clear_error(tiny_llama: Path) -> None:
    with pytest.raises(ConfigError, match="unsupported quantization 'int4'.*int8"):
        EngineConfig(quantization="int4")
    with pytest.raises(ConfigError, match="quantization"):
        LLM(model=str(tiny_llama), quantization="fp4")
    args = build_parser().parse_args(["serve", "--quantization", "int8"])
    assert build_config(args, {}).engine.quantization == "int8"
    args = build_parser().parse_args(["serve", "--quantization", "marlin"])
    with pytest.raises(ConfigError, match="quantization"):
        build_config(args, {})
    assert EngineConfig().quantization is None


def _greedy(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [o.token_ids for o in outs]


def _prefix_agreement(ref: list[list[int]], got: list[list[int]]) -> float:
    same = 0
    for r, g in zip(ref, got, strict=True):
        k = 0
        while k < len(r) and r[k] == g[k]:
            k += 1
        same += k
    return same / sum(map(len, ref))


def test_engine_int8_on_a_tiny_model(tiny_llama: Path) -> None:
    prompts = [[5 + i, 17, 42 + i, 9] for i in range(6)]
    ref = _greedy(LLM(model=str(tiny_llama), dtype="float32"), prompts, 8)
    llm = LLM(model=str(tiny_llama), dtype="float32", quantization="int8")
    assert llm.engine.info["quantization"] == "int8"
    got = _greedy(llm, prompts, 8)
    assert [len(g) for g in got] == [8] * 6
    assert _prefix_agreement(ref, got) >= 0.8
    # the model really runs int8: its linear weights are a quarter of fp32's (plus scales)
    q_layers, q_head = llm.engine.runner.model.linear_weight_bytes()
    f_layers, _ = LLM(model=str(tiny_llama), dtype="float32").engine.runner.model \
        .linear_weight_bytes()
    assert f_layers / 4 < q_layers < f_layers / 3.5


@pytest.mark.smollm2
def test_engine_int8_on_smollm2_agrees_with_fp32() -> None:
    topics = ["photosynthesis", "black holes", "volcanoes", "the water cycle", "honey bees",
              "rainbows", "tides", "sleep"]
    fp32 = LLM(model="smollm2-135m", dtype="float32", kv_cache_tokens=4096, max_model_len=2048)
    prompts = [encode_chat(fp32.tokenizer, [{"role": "user", "content": f"What is {t}?"}])
               for t in topics]
    ref = _greedy(fp32, prompts, 8)
    del fp32
    int8 = LLM(model="smollm2-135m", dtype="float32", quantization="int8",
               kv_cache_tokens=4096, max_model_len=2048)
    batched = _greedy(int8, prompts, 8)  # prefill and 8-row decode
    alone = [_greedy(int8, [p], 8)[0] for p in prompts[:2]]  # 1-row decode
    assert sum(r[0] == g[0] for r, g in zip(ref, batched, strict=True)) >= 6
    # Measured with int8 x int8 prefill: 0.72 batched, 0.81 alone (8 tokens); a wrong kernel
    # scores ~0. Greedy agreement of a 135M model is fragile: bf16 alone scores 0.82 over 32.
    assert _prefix_agreement(ref, batched) >= 0.5
    assert _prefix_agreement(ref[:2], alone) >= 0.5
    text = int8.tokenizer.decode(batched[0])
    assert sum(c.isalpha() or c == " " for c in text) >= 0.7 * len(text), text

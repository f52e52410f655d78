"""Pre-quantized checkpoints (FP8, AWQ, GPTQ, compressed-tensors) and `--quantization fp8`:
greedy fp32 tokens identical to HF transformers on the dequantized weights, every
unsupported option a load error naming it, the format unpackers against the formats' own
layouts, tensor-parallel slices of quantized weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixserve import LLM, SamplingParams
from radixserve.cli import build_config, build_parser
from radixserve.model.quantization.config import (
    parse_quant_config,
    read_quant_config,
    resolve_quantization,
)
from radixserve.model.quantization.formats import unpack_int32
from radixserve.model.quantization.qweight import quantize_fp8, quantize_int
from radixserve.model_source import ModelLoadError
from tests.model.test_parity import hf_greedy, random_prompts
from tests.quant_checkpoints import AWQ_ORDER, pack_words, write_quantized
from tests.tiny_models import make_tiny_model

CASES: list[tuple[str, dict[str, Any]]] = [
    ("fp8", {"block": (32, 48)}),  # 64 x 128 / 128 x 64 weights: partial blocks at the edges
    ("fp8", {"activation": "static"}),  # per-tensor weight_scale + input_scale
    ("awq", {"group": 32, "skip": ["down_proj"]}),  # modules_to_not_convert
    ("gptq", {"bits": 4, "group": 32}),
    ("gptq", {"bits": 8, "group": 32, "desc_act": True}),  # act-order g_idx, per projection
    ("gptq", {"bits": 4, "group": 16, "sym": False}),
    ("compressed-tensors", {"format": "pack-quantized", "bits": 4, "group": 32}),
    ("compressed-tensors", {"format": "pack-quantized", "bits": 4, "group": 32,
                            "symmetric": False}),  # packed weight_zero_point
    ("compressed-tensors", {"format": "pack-quantized", "bits": 8}),  # channel strategy
    ("compressed-tensors", {"format": "naive-quantized", "bits": 8}),
    ("compressed-tensors", {"format": "float-quantized", "skip": ["o_proj"]}),  # FP8-dynamic
]
PROMPTS = random_prompts([5, 9, 17], 200)


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("quant_src"), "llama")


@pytest.fixture(scope="module")
def float_bytes(src: Path) -> int:
    n: int = LLM(model=str(src), dtype="float32").engine.info["linear_weight_bytes"]
    return n


def _greedy(model: Path, **kw: Any) -> tuple[LLM, list[list[int]]]:
    llm = LLM(model=str(model), dtype="float32", **kw)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    return llm, [o.token_ids for o in outs]


@pytest.mark.parametrize(("method", "opts"), CASES, ids=[f"{m}-{i}" for i, (m, _) in
                                                          enumerate(CASES)])
def test_checkpoint_matches_hf_on_dequantized_weights(src: Path, float_bytes: int,
                                                      tmp_path: Path, method: str,
                                                      opts: dict[str, Any]) -> None:
    quant_dir, deq_dir = write_quantized(src, tmp_path, method, **opts)
    llm, ours = _greedy(quant_dir)  # no flag: quantization_config says it all
    assert ours == hf_greedy(deq_dir, PROMPTS, 12)
    info = llm.engine.info
    assert info["quantization"] == method
    assert info["linear_weight_bytes"] < float_bytes  # really resident quantized


def test_quantization_fp8_flag_is_per_channel_fp8(src: Path, float_bytes: int, tmp_path: Path
                                                  ) -> None:
    args = build_parser().parse_args(["serve", "--model", str(src), "--quantization", "fp8"])
    assert build_config(args, {}).engine.quantization == "fp8"
    state = load_file(str(src / "model.safetensors"))
    deq = {k: (quantize_fp8(v).dequantize() if k.endswith("proj.weight") else v)
           for k, v in state.items()}
    deq_dir = tmp_path / "deq"
    deq_dir.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (deq_dir / f.name).write_bytes(f.read_bytes())
    save_file(deq, str(deq_dir / "model.safetensors"), metadata={"format": "pt"})
    llm, ours = _greedy(src, quantization="fp8")
    assert ours == hf_greedy(deq_dir, PROMPTS, 12)
    assert llm.engine.info["quantization"] == "fp8"
    layers, head = llm.engine.runner.model.linear_weight_bytes()  # the LM head stays float
    assert (float_bytes - head) / 4 < layers < (float_bytes - head) / 3.5  # 1 byte + scales


def test_flag_against_the_checkpoint(src: Path, tmp_path: Path) -> None:
    quant_dir, _ = write_quantized(src, tmp_path, "awq", group=32)
    cfg = read_quant_config(quant_dir)
    assert cfg is not None and cfg.method == "awq"
    assert resolve_quantization("awq", cfg) is None  # the checkpoint's own name: a no-op
    with pytest.raises(ModelLoadError, match="already quantized .awq"):
        LLM(model=str(quant_dir), dtype="float32", quantization="int8")
    with pytest.raises(ModelLoadError, match="no quantization_config"):
        resolve_quantization("gptq", None)


def test_quantized_tensors_without_a_config_are_an_error(src: Path, tmp_path: Path) -> None:
    """The silent mis-load of issue 40: FP8 codes cast to float with their scales ignored."""
    quant_dir, _ = write_quantized(src, tmp_path, "fp8", block=(32, 32))
    cfg_file = quant_dir / "config.json"
    cfg_file.write_text(cfg_file.read_text().replace('"quantization_config"', '"other"'))
    with pytest.raises(ModelLoadError, match="stored quantized .torch.float8_e4m3fn"):
        LLM(model=str(quant_dir), dtype="float32")


@pytest.mark.parametrize(("config", "named"), [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"quant_method": "fp8", "activation_scheme": "per-tensor"}, "activation_scheme"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version 'gemv'"),
    ({"quant_method": "awq", "bits": 3}, "bits 3"),
    ({"quant_method": "gptq", "bits": 3}, "bits 3"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format"),
    ({"quant_method": "compressed-tensors", "sparsity_config": {"format": "sparse-24"},
      "config_groups": {}}, "sparsity_config"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
                                                 "strategy": "group", "group_size": 128,
                                                 "actorder": "group"}}}}, "actorder"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {
        "g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int",
                                                 "strategy": "channel"},
              "input_activations": {"num_bits": 8, "type": "int"}}}}, "W8A8"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {
        "g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float",
                                                 "strategy": "tensor_group"}}}},
     "strategy 'tensor_group'"),
])
def test_unsupported_options_are_named(config: dict[str, Any], named: str) -> None:
    with pytest.raises(ModelLoadError, match="not supported") as e:
        parse_quant_config(config)
    assert named in str(e.value)


def test_compressed_tensors_targets_and_ignore() -> None:
    cfg = parse_quant_config({
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "ignore": ["lm_head", "re:.*layers\\.1\\..*"],
        "config_groups": {
            "attn": {"targets": ["re:.*self_attn.*"], "weights": {
                "num_bits": 8, "type": "int", "strategy": "channel"}},
            "mlp": {"targets": ["re:.*mlp.*"], "weights": {
                "num_bits": 4, "type": "int", "strategy": "group", "group_size": 64}}}})
    q, down = cfg.scheme_for("layers.0.self_attn.q_proj"), cfg.scheme_for("layers.0.mlp.down_proj")
    assert q is not None and q.bits == 8 and q.group_size == -1
    assert down is not None and down.bits == 4 and down.group_size == 64
    assert cfg.scheme_for("layers.1.mlp.up_proj") is None
    assert cfg.scheme_for("lm_head") is None


def test_awq_nibble_order() -> None:
    """AutoAWQ packs columns 0..7 of a run into nibbles in the order 0 2 4 6 1 3 5 7."""
    codes = torch.arange(8)[None]  # (1, 8): column j holds j
    word = pack_words(codes, 4, 1, AWQ_ORDER)
    assert word.item() == 0x75316420
    nibbles = unpack_int32(word, 4, dim=1)[0].tolist()  # by nibble
    assert nibbles == list(AWQ_ORDER)


def test_pack_to_int32_layout() -> None:
    """compressed-tensors' pack_to_int32: value + 8, the first column in the lowest bits."""
    signed = torch.tensor([[-8, -1, 0, 7, 1, 2, 3, 4]])
    word = pack_words(signed + 8, 4, 1)
    assert word.item() == int("".join(f"{v + 8:x}" for v in reversed(signed[0].tolist())),
                              16) - (1 << 32)
    assert (unpack_int32(word, 4, dim=1) - 8).tolist() == signed.tolist()


def test_tensor_parallel_slices() -> None:
    w = torch.randn(48, 96, generator=torch.Generator().manual_seed(1))
    for q in (quantize_int(w, 4, 32), quantize_fp8(w), quantize_fp8(w, 32)):
        full = q.dequantize()
        assert torch.equal(q.rows(slice(16, 40)).dequantize(), full[16:40])
        assert torch.equal(q.cols(slice(32, 96)).dequantize(), full[:, 32:96])
    with pytest.raises(ModelLoadError, match="quantization groups of 32"):
        quantize_int(w, 4, 32).cols(slice(0, 40))


@pytest.mark.parametrize(("method", "opts"), [
    ("fp8", {"block": (32, 32)}),
    ("compressed-tensors", {"format": "pack-quantized", "bits": 4, "group": 32,
                            "symmetric": False})])
def test_tensor_parallel_slices_scales_with_the_weights(src: Path, tmp_path: Path, method: str,
                                                        opts: dict[str, Any]) -> None:
    """TP 2: q/k/v, gate/up rows and o_proj/down input columns (with their groups' scales and
    zero points) split across the ranks; the tokens stay HF's on the dequantized weights."""
    quant_dir, deq_dir = write_quantized(src, tmp_path, method, **opts)
    llm = LLM(model=str(quant_dir), dtype="float32", tensor_parallel_size=2,
              kv_cache_tokens=8192)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12,
                                                    ignore_eos=True))
    finally:
        llm.close()
    assert [o.token_ids for o in outs] == hf_greedy(deq_dir, PROMPTS, 12)


def test_qwen2_gptq_with_qkv_bias(tmp_path: Path) -> None:
    qwen = make_tiny_model(tmp_path / "qwen2", "qwen2")
    quant_dir, deq_dir = write_quantized(qwen, tmp_path, "gptq", bits=4, group=32)
    _, ours = _greedy(quant_dir)
    assert ours == hf_greedy(deq_dir, PROMPTS, 12)


def test_server_info_reports_method_and_bytes(src: Path, tmp_path: Path) -> None:
    """`radixserve serve --model <fp8 folder> --quantization fp8` as a user runs it."""
    from tests.server_proc import running_server

    quant_dir, _ = write_quantized(src, tmp_path, "fp8", block=(32, 32))
    with running_server(quant_dir, tmp_path / "log", ["--quantization", "fp8"]) as server:
        status, info = server.get("/server_info")
    assert status == 200
    engine = info["engine_info"]
    assert engine["quantization"] == "fp8" and engine["linear_weight_bytes"] > 0


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "phi3"])
def test_every_family_takes_quantized_weights(family: str, tmp_path: Path) -> None:
    """The linear method plugs into every family's linear layers: Qwen3 (QK-norm, one KV
    head), Gemma 2 (soft-caps, sliding layers), Phi-3 (qkv_proj / gate_up_proj quantized
    fused in the checkpoint)."""
    from tests.family_models import make_family_model

    model = make_family_model(tmp_path / family, family)
    quant_dir, deq_dir = write_quantized(model, tmp_path, "compressed-tensors",
                                         format="pack-quantized", bits=4, group=32)
    _, ours = _greedy(quant_dir)
    assert ours == hf_greedy(deq_dir, PROMPTS, 12)

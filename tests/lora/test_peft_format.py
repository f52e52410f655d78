"""The PEFT reader: what is served is read and fused exactly; what is not is a clear error at
load (DoRA, embedding / LM-head targets, rank above --max-lora-rank, ...)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixserve.config import ConfigError, LoRAConfig, LoRAModule
from radixserve.lora.peft_format import LoRALoadError, load_peft_adapter
from radixserve.model.families.registry import read_model_spec
from radixserve.model.lora_delta import LoRABatch
from tests.lora.conftest import LoRASet
from tests.lora_adapters import make_peft_adapter


def _load(path: Path, base: Path, max_rank: int = 16):  # type: ignore[no-untyped-def]
    return load_peft_adapter("x", path, read_model_spec(base), max_rank, torch.float32)


@pytest.mark.parametrize(("extra", "message"), [
    ({"use_dora": True}, "DoRA"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "embedding"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
    ({"bias": "all"}, "biases"),
    ({"peft_type": "IA3"}, "not LORA"),
])
def test_unserved_configs_fail_at_load(lora_set: LoRASet, tmp_path: Path,
                                       extra: dict[str, object], message: str) -> None:
    path = make_peft_adapter(tmp_path / "a", lora_set.base, ("q_proj",), extra_config=extra)
    with pytest.raises(LoRALoadError, match=message):
        _load(path, lora_set.base)


def test_rank_above_max_and_bad_files_fail(lora_set: LoRASet, tmp_path: Path) -> None:
    path = make_peft_adapter(tmp_path / "a", lora_set.base, ("q_proj",), r=8)
    with pytest.raises(LoRALoadError, match="rank 8 exceeds --max-lora-rank 4"):
        _load(path, lora_set.base, max_rank=4)
    with pytest.raises(LoRALoadError, match="adapter_config.json"):
        _load(lora_set.base, lora_set.base)
    with pytest.raises(LoRALoadError, match="not a directory"):
        _load(tmp_path / "missing", lora_set.base)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(8, 4)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    with pytest.raises(LoRALoadError, match="embedding"):
        _load(path, lora_set.base)
    other = make_peft_adapter(tmp_path / "b", lora_set.base, ("q_proj",), r=8)
    cfg = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**cfg, "r": 4}))
    with pytest.raises(LoRALoadError, match="expected"):  # shapes disagree with r
        _load(other, lora_set.base)


def test_fused_qkv_adapter_equals_its_parts(lora_set: LoRASet, tmp_path: Path) -> None:
    """An adapter saved for a fused checkpoint (`qkv_proj`: one A, B over q|k|v) gives the
    delta of per-projection adapters sharing that A."""
    parts = make_peft_adapter(tmp_path / "parts", lora_set.base, ("q_proj", "k_proj", "v_proj"))
    t = load_file(str(parts / "adapter_model.safetensors"))
    fused_t = {}
    for i in range(2):
        p = f"base_model.model.model.layers.{i}.self_attn."
        shared_a = t[p + "q_proj.lora_A.weight"]
        for m in ("k_proj", "v_proj"):
            t[p + f"{m}.lora_A.weight"] = shared_a.clone()
        fused_t[p + "qkv_proj.lora_A.weight"] = shared_a
        fused_t[p + "qkv_proj.lora_B.weight"] = torch.cat(
            [t[p + f"{m}.lora_B.weight"] for m in ("q_proj", "k_proj", "v_proj")])
    save_file(t, str(parts / "adapter_model.safetensors"))
    fused = tmp_path / "fused"
    fused.mkdir()
    save_file(fused_t, str(fused / "adapter_model.safetensors"))
    cfg = json.loads((parts / "adapter_config.json").read_text())
    (fused / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["qkv_proj"]}))
    x = torch.randn(5, 64)
    outs = []
    for folder in (parts, fused):
        batch = LoRABatch.from_runs([(None, 1), (_load(folder, lora_set.base).layers, 4)])
        assert batch is not None
        y = torch.zeros(5, 128)  # q 64 + k 32 + v 32
        batch.add_delta(1, "qkv_proj", x, y)
        assert not y[0].any()  # the base row gets no delta
        outs.append(y)
    torch.testing.assert_close(outs[0], outs[1])


def test_segments_merge_runs_of_one_adapter(lora_set: LoRASet) -> None:
    a, b = [{}], [{}]  # two adapters' (empty) layer lists
    batch = LoRABatch.from_runs([(a, 2), (a, 1), (None, 3), (b, 2), (a, 1)])
    assert batch is not None
    assert [(s.start, s.end, s.layers is a) for s in batch.segments] == [
        (0, 3, True), (6, 8, False), (8, 9, True)]
    assert LoRABatch.from_runs([(None, 4)]) is None


def test_lora_module_flag_forms() -> None:
    assert LoRAModule.parse("sql=/ad/sql") == LoRAModule("sql", "/ad/sql")
    assert LoRAModule.parse('{"name": "sql", "path": "/ad/sql", "base_model_name": "m"}') == \
        LoRAModule("sql", "/ad/sql", "m")
    for bad in ("sql", "{\"name\": 1}", "a b=/x", "{bad"):
        with pytest.raises(ConfigError):
            LoRAModule.parse(bad)
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        LoRAConfig(max_loras=4, max_cpu_loras=2)

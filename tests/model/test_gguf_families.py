"""GGUF of every family transformers' GGUF reader knows: a tiny fp32 GGUF per family
(tests/gguf_models.py: llama.cpp's names and keys), served through radixserve's GGUF path
(model_source.convert_gguf: transformers reads the file once into an HF folder), gives greedy
fp32 tokens equal to HF's own `from_pretrained(..., gguf_file=...)` on the same file; and that
equals the HF model the file was written from (the file holds the model). What the reader
cannot read back is refused at load with a clear error.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from radixserve import LLM
from radixserve.model.families.registry import read_model_spec
from radixserve.model_source import ModelLoadError, resolve_model
from tests.gguf_models import CASES, make_hf_model, write_gguf
from tests.model.test_families import engine_tokens, hf_greedy, hf_model_greedy
from tests.model.test_parity import random_prompts

LENGTHS = [1, 13, 21]  # the windows (8) are shorter than two of them
VOCAB = 250
WANT_ARCH = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
             "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
             "phi3": "Phi3ForCausalLM"}


def _hf_on_gguf(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32)
    return hf_model_greedy(hf, prompts, 6)


@pytest.mark.parametrize("case", CASES)
def test_gguf_of_each_family_matches_hf_on_the_same_file(
        case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "cache"))
    hf_dir = make_hf_model(tmp_path / "hf", case)
    path = write_gguf(hf_dir, tmp_path / f"tiny-{case}.gguf", case)
    prompts = random_prompts(LENGTHS, VOCAB)
    want = _hf_on_gguf(path, prompts)
    assert want == hf_greedy(hf_dir, prompts, 6)  # the file is the model it was written from
    converted = resolve_model(str(path)).hf_dir
    assert read_model_spec(converted).architecture == WANT_ARCH[case]
    llm = LLM(model=str(path), dtype="float32", kv_cache_tokens=1024)
    assert engine_tokens(llm, prompts) == want


def _with(src: Path, dst: Path, extra: dict[str, float | int],
          tensor: str | None = None) -> Path:
    """`src` rewritten with extra metadata (and an extra tensor), as a GGUF the reader would
    convert but lose part of."""
    reader = gguf.GGUFReader(str(src))
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    w = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in extra:
            continue
        value = field.contents()
        w.add_key_value(key, value, field.types[0],
                        field.types[-1] if len(field.types) > 1 else None)
    for key, value in extra.items():
        if isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_float32(key, value)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data))  # fp32, as write_gguf writes them
    if tensor is not None:
        w.add_tensor(tensor, np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize(("case", "extra", "tensor", "what"), [
    ("gemma3", {"gemma3.rope.scaling.factor": 8.0}, None, "rope scaling"),
    ("phi3", {}, "rope_factors_long.weight", "LongRoPE"),
    ("phi3", {"phi3.rope.dimension_count": 12}, None, "partial rotary"),
    ("gemma2", {"gemma2.final_logit_softcapping": 15.0}, None, "final_logit_softcapping"),
])
def test_what_the_reader_drops_is_a_clear_load_error(
        case: str, extra: dict[str, float | int], tensor: str | None, what: str,
        tmp_path: Path
) -> None:
    src = write_gguf(make_hf_model(tmp_path / "hf", case), tmp_path / "src.gguf", case)
    bad = _with(src, tmp_path / "bad.gguf", extra, tensor)
    with pytest.raises(ModelLoadError, match=what):
        resolve_model(str(bad), cache_dir=tmp_path / "cache")

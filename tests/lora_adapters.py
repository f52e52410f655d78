"""Tiny LoRA adapters saved as PEFT folders, and the merged-weights models they stand for.

Owns: writing `adapter_config.json` + `adapter_model.safetensors` with the keys peft's
`save_pretrained` writes (`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`,
A: (r, in), B: (out, r)), and the reference: the base checkpoint with W + scale * B @ A written
as a plain HF folder (peft is not installed here; transformers runs the merged model).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def _module_path(layer: int, module: str) -> str:
    block = "self_attn" if module in ATTN or module == "qkv_proj" else "mlp"
    return f"model.layers.{layer}.{block}.{module}"


def make_peft_adapter(path: Path, base: Path, targets: tuple[str, ...] = ATTN + MLP, *,
                      r: int = 4, alpha: float = 8.0, seed: int = 1, use_rslora: bool = False,
                      std: float = 0.15, extra_config: dict[str, Any] | None = None) -> Path:
    """A random adapter for the model in `base` (its shapes from the base's weights)."""
    weights = load_file(str(base / "model.safetensors"))
    layers = json.loads((base / "config.json").read_text())["num_hidden_layers"]
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(layers):
        for mod in targets:
            out_f, in_f = weights[_module_path(i, mod) + ".weight"].shape
            key = f"base_model.model.{_module_path(i, mod)}"
            tensors[key + ".lora_A.weight"] = torch.randn(r, in_f, generator=g) * std
            tensors[key + ".lora_B.weight"] = torch.randn(out_f, r, generator=g) * std
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets),
              "use_rslora": use_rslora, "use_dora": False, "bias": "none",
              "lora_dropout": 0.0, "base_model_name_or_path": str(base),
              "task_type": "CAUSAL_LM", "fan_in_fan_out": False, "modules_to_save": None,
              **(extra_config or {})}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def make_merged_model(base: Path, adapter: Path, out: Path) -> Path:
    """The base model with the adapter merged: W + scale * B @ A, as a plain HF folder."""
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    r = cfg["r"]
    scale = cfg["lora_alpha"] / (math.sqrt(r) if cfg.get("use_rslora") else r)
    weights = load_file(str(base / "model.safetensors"))
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    for key, a in lora.items():
        if ".lora_A." not in key:
            continue
        b = lora[key.replace(".lora_A.", ".lora_B.")]
        name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        weights[name] = weights[name] + scale * (b @ a)
    shutil.copytree(base, out, dirs_exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out

"""Reading safetensors weights into the fused layout the forward pass uses.

Owns: name mapping from HF checkpoints (q/k/v fused into qkv, gate/up fused into gate_up),
dtype/device placement and the loading progress bar. Does not know: the forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from radixserve.model.arch import ModelArch
from radixserve.model_source import ModelLoadError


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # (hidden,)
    qkv: torch.Tensor  # ((heads + 2 * kv_heads) * head_dim, hidden)
    qkv_bias: torch.Tensor | None  # ((heads + 2 * kv_heads) * head_dim,)
    o_proj: torch.Tensor  # (hidden, heads * head_dim)
    post_norm: torch.Tensor  # (hidden,)
    gate_up: torch.Tensor  # (2 * intermediate, hidden)
    down: torch.Tensor  # (hidden, intermediate)


@dataclass
class ModelWeights:
    embed: torch.Tensor  # (vocab, hidden)
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # (hidden,)
    lm_head: torch.Tensor  # (vocab, hidden); the embedding itself when tied


def _read_all(hf_dir: Path, show_progress: bool) -> dict[str, torch.Tensor]:
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{hf_dir}: no *.safetensors weights (only safetensors are loaded)")
    tensors: dict[str, torch.Tensor] = {}
    names: list[tuple[Path, str]] = []
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            names.extend((f, k) for k in sf.keys())
    bar = tqdm(total=len(names), desc="Loading weights", disable=not show_progress, leave=False)
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                name = key.removeprefix("model.")
                tensors[name] = sf.get_tensor(key)
                bar.update(1)
    bar.close()
    return tensors


def load_weights(
    hf_dir: Path, spec: ModelArch, dtype: torch.dtype, device: torch.device,
    show_progress: bool = True,
) -> ModelWeights:
    raw = _read_all(hf_dir, show_progress)

    def take(name: str) -> torch.Tensor:
        if name not in raw:
            raise ModelLoadError(f"{hf_dir}: weight {name!r} missing from the checkpoint")
        return raw.pop(name).to(device=device, dtype=dtype).contiguous()

    layers = []
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        bias = None
        if spec.qkv_bias:
            bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=qkv,
                qkv_bias=bias,
                o_proj=take(p + "self_attn.o_proj.weight"),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]),
                down=take(p + "mlp.down_proj.weight"),
            )
        )
    embed = take("embed_tokens.weight")
    if spec.tie_word_embeddings or "lm_head.weight" not in raw:
        lm_head = embed
    else:
        lm_head = take("lm_head.weight")
    return ModelWeights(embed=embed, layers=layers, final_norm=take("norm.weight"), lm_head=lm_head)

"""Reading a PEFT LoRA adapter folder into the fused targets of the model's linear layers.

Owns: the PEFT format (`adapter_config.json` + `adapter_model.safetensors`, keys as peft's
`save_pretrained` writes them: `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`),
its checks (a clear LoRALoadError for what is not served: DoRA, embedding or LM-head targets,
`modules_to_save`, bias training, rank above `--max-lora-rank`, per-module rank or alpha
patterns), the scaling (`lora_alpha / r`, or `/ sqrt(r)` with `use_rslora`) and the content
digest. Does not know: requests, batches, devices (weights are read to CPU; manager.py places
them).

Fusing: the model runs q/k/v as one `qkv_proj` GEMM and gate/up as one `gate_up_proj`, so an
adapter's per-projection A matrices are stacked into one shrink (parts * r, in) and its B
matrices into one block-diagonal expand (out, parts * r): one shrink and one expand GEMM per
fused target. A projection the adapter leaves out is a zero block; an adapter trained on a
fused checkpoint (`qkv_proj`, `gate_up_proj`) is used as is. The scaling is folded into B.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from radixserve.model.arch import ModelArch
from radixserve.model.lora_delta import LoRAWeights

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The model's fused linear layers (model/layers/linear.py's LinearLayer names), in order
TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# PEFT module name -> (fused target, part index in it; -1: the fused projection itself)
_MODULES = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
            "qkv_proj": ("qkv_proj", -1), "o_proj": ("o_proj", 0),
            "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
            "gate_up_proj": ("gate_up_proj", -1), "down_proj": ("down_proj", 0)}
_KEY = re.compile(r"(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight")
_UNSERVED_TARGETS = ("embed_tokens", "lm_head", "wte", "embed_in", "embed_out")


class LoRALoadError(ValueError):
    """An adapter that cannot be served: the message says which file and why."""


@dataclass(frozen=True)
class PeftAdapter:
    name: str
    path: str
    digest: str  # of the config and weight files' bytes
    rank: int
    scaling: float
    layers: tuple[dict[str, LoRAWeights], ...]  # per layer: target -> weights (absent: none)

    def to(self, device: torch.device) -> PeftAdapter:
        layers = tuple({t: LoRAWeights(w.a.to(device), w.b.to(device)) for t, w in lay.items()}
                       for lay in self.layers)
        return PeftAdapter(self.name, self.path, self.digest, self.rank, self.scaling, layers)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for lay in self.layers
                   for w in lay.values() for t in (w.a, w.b))


def target_parts(spec: ModelArch, target: str) -> tuple[tuple[int, int], tuple[int, ...]]:
    """((in_features, out_features), the output sizes of its parts) of a fused target."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    h, inter = spec.hidden_size, spec.intermediate_size
    return {"qkv_proj": ((h, q + 2 * kv), (q, kv, kv)), "o_proj": ((q, h), (h,)),
            "gate_up_proj": ((h, 2 * inter), (inter, inter)),
            "down_proj": ((inter, h), (h,))}[target]


def _fail(path: Path, why: str) -> LoRALoadError:
    return LoRALoadError(f"LoRA adapter {str(path)!r}: {why}")


def read_config(path: Path, max_rank: int) -> tuple[int, float]:
    """(r, scaling) of a PEFT LoRA config; raises LoRALoadError for what is not served."""
    try:
        cfg: Any = json.loads((path / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise _fail(path, f"no {CONFIG_FILE} (a PEFT adapter folder is needed)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise _fail(path, f"unreadable {CONFIG_FILE}: {e}") from None
    if not isinstance(cfg, dict):
        raise _fail(path, f"{CONFIG_FILE} is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _fail(path, f"peft_type {cfg.get('peft_type')!r} is not LORA")
    if cfg.get("use_dora"):
        raise _fail(path, "DoRA adapters (use_dora) are not supported")
    targets = cfg.get("target_modules") or []
    named = [targets] if isinstance(targets, str) else list(targets)
    bad = [t for t in named if any(u in str(t) for u in _UNSERVED_TARGETS)]
    if bad or cfg.get("modules_to_save"):
        raise _fail(path, f"embedding / LM-head targets and modules_to_save are not supported "
                          f"(got target_modules={targets!r}, "
                          f"modules_to_save={cfg.get('modules_to_save')!r})")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise _fail(path, f"{key} (per-module rank or alpha) is not supported")
    if cfg.get("bias", "none") != "none" or cfg.get("fan_in_fan_out"):
        raise _fail(path, "trained biases and fan_in_fan_out are not supported")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise _fail(path, f"r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise _fail(path, f"rank {r} exceeds --max-lora-rank {max_rank}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise _fail(path, f"lora_alpha must be a number, got {alpha!r}")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, float(scaling)


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        h.update((path / name).read_bytes())
        h.update(b"\x00")
    return h.hexdigest()[:32]


def load_peft_adapter(name: str, path: str | Path, spec: ModelArch, max_rank: int,
                      dtype: torch.dtype) -> PeftAdapter:
    """Read and check one adapter folder (to CPU tensors of `dtype`)."""
    folder = Path(path)
    if not folder.is_dir():
        raise _fail(folder, "not a directory")
    r, scaling = read_config(folder, max_rank)
    if not (folder / WEIGHTS_FILE).is_file():
        raise _fail(folder, f"no {WEIGHTS_FILE} (only safetensors adapters are loaded)")
    raw: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as sf:
        for key in sf.keys():
            if "lora_embedding" in key or "lm_head" in key or "magnitude" in key:
                raise _fail(folder, f"weight {key!r}: embedding, LM-head and DoRA weights are "
                                    "not supported")
            m = _KEY.fullmatch(key)
            if m is None or m.group(2) not in _MODULES:
                raise _fail(folder, f"weight {key!r} is not a LoRA A/B of a decoder layer's "
                                    f"projection ({', '.join(_MODULES)})")
            layer = int(m.group(1))
            if layer >= spec.num_layers:
                raise _fail(folder, f"weight {key!r}: the model has {spec.num_layers} layers")
            raw.setdefault((layer, m.group(2)), {})[m.group(3)] = sf.get_tensor(key).float()
    if not raw:
        raise _fail(folder, f"{WEIGHTS_FILE} holds no LoRA weights")
    layers = tuple(_fuse_layer(folder, spec, r, scaling, {
        mod: ab for (li, mod), ab in raw.items() if li == i}, dtype)
        for i in range(spec.num_layers))
    return PeftAdapter(name, str(folder), file_digest(folder), r, scaling, layers)


def _fuse_layer(folder: Path, spec: ModelArch, r: int, scaling: float,
                mods: dict[str, dict[str, torch.Tensor]], dtype: torch.dtype
                ) -> dict[str, LoRAWeights]:
    out: dict[str, LoRAWeights] = {}
    for target in TARGETS:
        (fan_in, fan_out), parts = target_parts(spec, target)
        mine = {m: ab for m, ab in mods.items() if _MODULES[m][0] == target}
        if not mine:
            continue
        fused = [m for m in mine if _MODULES[m][1] < 0]
        if fused and len(mine) > 1:
            raise _fail(folder, f"both {fused[0]} and its parts {sorted(set(mine) - set(fused))}")
        slots = [(m, 0, fan_out) for m in fused] or [
            (m, sum(parts[: _MODULES[m][1]]), parts[_MODULES[m][1]]) for m in mine]
        a = torch.zeros(len(slots) * r, fan_in)  # (parts * r, in)
        b = torch.zeros(fan_out, len(slots) * r)  # (out, parts * r)
        for j, (mod, row, rows) in enumerate(sorted(slots, key=lambda s: s[1])):
            ab = mine[mod]
            if set(ab) != {"A", "B"}:
                raise _fail(folder, f"{mod}: needs both lora_A and lora_B")
            if ab["A"].shape != (r, fan_in) or ab["B"].shape != (rows, r):
                raise _fail(folder, f"{mod}: lora_A {tuple(ab['A'].shape)} / lora_B "
                                    f"{tuple(ab['B'].shape)}, expected ({r}, {fan_in}) / "
                                    f"({rows}, {r}) for this model and r={r}")
            a[j * r : (j + 1) * r] = ab["A"]
            b[row : row + rows, j * r : (j + 1) * r] = ab["B"] * scaling
        out[target] = LoRAWeights(a.to(dtype).contiguous(), b.to(dtype).contiguous())
    return out

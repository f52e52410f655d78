"""The family registry: config.json's `architectures[0]` (else `model_type`) to its family,
and the one entry point that builds any family's model.

Owns: the list of families (FAMILIES), the refusal of an unknown architecture (naming the
supported ones), and build_model (linear method, TP, the fused choice, embedding and head).
Does not know: any family's layer order or config fields.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from radixserve.attention.base import AttentionBackend, StoredKVAttention
from radixserve.model.arch import ModelArch
from radixserve.model.families.base import CausalLM, head_and_embed, model_parts
from radixserve.model.families.family import Family
from radixserve.model.families.gemma import GEMMA2, GEMMA3_FAMILY
from radixserve.model.families.llama import LLAMA, MISTRAL, QWEN2
from radixserve.model.families.mixtral import MIXTRAL
from radixserve.model.families.olmoe import OLMOE
from radixserve.model.families.phi3 import PHI3
from radixserve.model.families.qwen3 import QWEN3
from radixserve.model.families.qwen_moe import QWEN2_MOE, QWEN3_MOE
from radixserve.model.layers.linear import LoraHook, linear_method
from radixserve.model.quantization.config import QuantConfig, read_quant_config
from radixserve.model.weights import ModelWeights
from radixserve.model_source import ModelLoadError

if TYPE_CHECKING:
    from radixserve.model.tp_shard import TPShard
    from radixserve.parallel.comm import TPComm

FAMILIES: tuple[Family, ...] = (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3_FAMILY, PHI3,
                                QWEN3_MOE, QWEN2_MOE, MIXTRAL, OLMOE)


def supported_architectures() -> tuple[str, ...]:
    return tuple(a for f in FAMILIES for a in f.architectures)


def family_of(architecture: str) -> Family:
    for family in FAMILIES:
        if architecture in family.architectures:
            return family
    raise ModelLoadError(f"unsupported architecture {architecture!r}; supported: "
                         f"{', '.join(supported_architectures())}")


def parse_config(cfg: dict[str, object]) -> ModelArch:
    """The family's frozen arch for a parsed config.json."""
    archs = cfg.get("architectures") or []
    assert isinstance(archs, list)
    arch = archs[0] if archs else None
    if arch is None:
        model_type = cfg.get("model_type", "")
        arch = next((f.architectures[0] for f in FAMILIES if model_type in f.model_types), None)
    family = family_of(str(arch))
    return family.parse(str(arch), dict(cfg))


def read_model_spec(hf_dir: Path) -> ModelArch:
    return parse_config(json.loads((hf_dir / "config.json").read_text()))


def _fused(backend: AttentionBackend, fused: bool | None) -> bool:
    """The fused-kernel path where the backend attends over stored K/V and runs the Triton
    kernels (None: decide)."""
    runs = isinstance(backend, StoredKVAttention) and backend.fused_kernels
    if fused is None:
        return runs
    if fused and not runs:
        raise ValueError(f"fused kernels need a backend with attend() and the Triton kernels, "
                         f"not {type(backend)}")
    return fused


def build_model(spec: ModelArch, weights: ModelWeights, backend: AttentionBackend,
                max_positions: int, quantization: str | None = None,
                quantize_lm_head: bool = True, fused: bool | None = None,
                tp: TPComm | None = None, shard: TPShard | None = None,
                checkpoint_quant: QuantConfig | None = None,
                lora: LoraHook | None = None) -> CausalLM:
    """The model of `spec`'s family. With `tp`: `spec` is the rank's own
    (shard.local_arch()), the weights its slices. `fused`: None: the Triton fused kernels
    where the backend supports them; False: the unfused order with any backend.
    `checkpoint_quant`: the checkpoint's own quantization (its weights arrive as QWeights);
    only int8 quantizes the LM head (FP8 keeps it in the model's dtype, as vLLM does).
    `lora`: the hook every projection carries (--enable-lora)."""
    family = family_of(spec.architecture)
    device, dtype = weights.embed.device, weights.embed.dtype
    is_fused = _fused(backend, fused)
    method = linear_method(quantization, device, checkpoint_quant)
    parts = model_parts(spec, method, max_positions, dtype, device, is_fused, tp, lora)
    quantize_lm_head = quantize_lm_head and method.name == "int8"
    layers = family.layers(parts, weights)
    # NOTE: the loaded ModelWeights is not kept: its layer weights live on only in their
    # (possibly prepacked) kernels, so the model holds one copy of each.
    embed, head = head_and_embed(parts, weights, shard, quantize_lm_head,
                                 family.head.embed_scale(spec), family.head.final_softcap(spec))
    final_norm = parts.norm(weights.final_norm, family.head.gemma_final_norm)
    return CausalLM(spec, embed, layers, final_norm, head, backend, is_fused,
                    parts.ops.rope_store)


def load_model(hf_dir: Path, spec: ModelArch, backend: AttentionBackend, max_positions: int,
               dtype: torch.dtype, device: torch.device, **kw: object) -> CausalLM:
    """Weights read and the model built in one call (tests, benches); a quantized
    checkpoint's own quantization_config applies."""
    from radixserve.model.weights import load_weights

    quant = read_quant_config(hf_dir)
    weights = load_weights(hf_dir, spec, dtype, device, show_progress=False,
                           names=family_of(spec.architecture).weight_names, quant=quant)
    if quant is not None:
        kw.setdefault("checkpoint_quant", quant)
    return build_model(spec, weights, backend, max_positions, **kw)  # type: ignore[arg-type]

"""Family: what the registry knows of one model family, and the features it supports.

Owns: the record each family module exports (its architectures, model_types, config parser,
checkpoint names, layer builder) and Features (what the model table in docs/models.md lists).
Does not know: any particular family.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixserve.model.arch import ModelArch
from radixserve.model.families.base import DecoderLayer, ModelParts
from radixserve.model.weights import ModelWeights, WeightNames

ParseConfig = Callable[[str, dict[str, Any]], ModelArch]  # (architecture, config) -> arch
BuildLayers = Callable[[ModelParts, ModelWeights], Sequence[DecoderLayer]]


@dataclass(frozen=True)
class Features:
    """What works for a family (the model table's columns)."""

    tensor_parallel: bool = True
    int8: bool = True
    fp8_kv: bool = True
    sliding_window: bool = False
    # GGUF: "tested" (a GGUF of it is served in the tests: the default SmolLM2, the tiny
    # GGUFs of tests/model/test_gguf_families.py), "reader"
    # (transformers' GGUF reader knows the architecture, so model_source.py converts it; no
    # GGUF of it is in the tests), "" (no)
    gguf: str = "reader"


@dataclass(frozen=True)
class HeadOptions:
    """How a family's embedding and LM head differ from Llama's."""

    embed_scale: Callable[[ModelArch], float | None] = lambda spec: None
    final_softcap: Callable[[ModelArch], float | None] = lambda spec: None
    gemma_final_norm: bool = False


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    parse: ParseConfig
    layers: BuildLayers
    weight_names: WeightNames = WeightNames()
    head: HeadOptions = HeadOptions()
    features: Features = field(default_factory=Features)

"""LoRAConfig: multi-LoRA serving's settings (vLLM's `--enable-lora` flags), validated once.

Owns: `--lora-modules` parsing (`name=path` or the JSON form `{"name", "path",
"base_model_name"}`), the batch/rank/LRU bounds and whether adapters may be loaded at run time.
Does not know: adapter files (radixserve/lora/peft_format.py reads them), argparse, torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from radixserve.config.parsing import ConfigError

# An adapter name is what a request puts in `model`: printable, no whitespace, no NUL (the
# radix namespace separates with NUL, see radixserve/lora/namespace.py).
_NAME = re.compile(r"[^\s\x00]{1,256}")


@dataclass(frozen=True)
class LoRAModule:
    """One adapter the server starts with: `model` name, its PEFT folder, its base's id."""

    name: str
    path: str
    base_model_name: str | None = None

    @staticmethod
    def parse(text: str) -> LoRAModule:
        """`name=path` or `{"name": ..., "path": ..., "base_model_name": ...}` (vLLM's forms)."""
        text = text.strip()
        if text.startswith("{"):
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--lora-modules: invalid JSON {text!r}: {e}") from None
            if not isinstance(obj, dict) or set(obj) - {"name", "path", "base_model_name"}:
                raise ConfigError(f"--lora-modules JSON takes name, path and base_model_name, "
                                  f"got {text!r}")
            name, path, base = obj.get("name"), obj.get("path"), obj.get("base_model_name")
            if not isinstance(name, str) or not isinstance(path, str) or not (
                    base is None or isinstance(base, str)):
                raise ConfigError(f"--lora-modules JSON needs string name and path, got {text!r}")
            return LoRAModule(check_lora_name(name), path, base)
        name, sep, path = text.partition("=")
        if not sep or not path:
            raise ConfigError(f"--lora-modules takes name=path or a JSON object, got {text!r}")
        return LoRAModule(check_lora_name(name), path)


def check_lora_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise ConfigError(f"invalid LoRA adapter name {name!r}: 1-256 characters, no "
                          "whitespace")
    return name


@dataclass(frozen=True)
class LoRAConfig:
    """Present (not None in EngineConfig) iff `--enable-lora`."""

    max_loras: int = 1  # distinct adapters in one batch (vLLM's default)
    max_lora_rank: int = 16  # an adapter of higher rank fails to load
    max_cpu_loras: int | None = None  # adapters kept loaded (LRU); None: max_loras
    modules: tuple[LoRAModule, ...] = ()
    # vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING=True enables /v1/load_lora_adapter and
    # /v1/unload_lora_adapter (read from the environment at the edge, cli.py).
    allow_runtime_updates: bool = False

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                              f"({self.max_loras})")
        names = [m.name for m in self.modules]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ConfigError(f"--lora-modules names an adapter twice: {sorted(dup)}")

    @property
    def cpu_capacity(self) -> int:
        assert self.max_cpu_loras is not None  # set in __post_init__
        return self.max_cpu_loras

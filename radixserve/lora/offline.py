"""The offline API's LoRA keywords: `LLM(enable_lora=True, max_lora_rank=R, ...)` and
`generate(..., lora_request=LoRARequest(...))`, as vLLM spells them.

Owns: turning those keywords into a LoRAConfig and one LoRARequest (or None) per prompt.
Does not know: the engine, adapters' files.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixserve.config.lora_config import LoRAConfig
from radixserve.lora.request import LoRARequest

_KEYWORDS = ("max_loras", "max_lora_rank", "max_cpu_loras")


def pop_lora_config(engine_kwargs: dict[str, Any]) -> LoRAConfig | None:
    """Remove vLLM's LoRA keywords from `engine_kwargs`; the LoRAConfig they ask for."""
    enabled = bool(engine_kwargs.pop("enable_lora", False))
    given = {k: engine_kwargs.pop(k) for k in _KEYWORDS if k in engine_kwargs}
    if given and not enabled:
        raise ValueError(f"{', '.join(given)} need enable_lora=True")
    return LoRAConfig(**given) if enabled else None


def lora_per_prompt(value: LoRARequest | Sequence[LoRARequest | None] | None, n: int,
                    enabled: bool) -> list[LoRARequest | None]:
    """One LoRARequest (or None: the base model) per prompt."""
    if value is None or isinstance(value, LoRARequest):
        out: list[LoRARequest | None] = [value] * n
    else:
        out = list(value)
        if len(out) != n:
            raise ValueError(f"got {n} prompts but {len(out)} lora_request: pass one for all "
                             "prompts or exactly one per prompt")
    for r in out:
        if r is not None and not isinstance(r, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest or None, got {type(r).__name__}")
    if not enabled and any(r is not None for r in out):
        raise ValueError("lora_request needs LLM(..., enable_lora=True)")
    return out

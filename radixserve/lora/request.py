"""LoRARequest: which adapter a request runs under, with vLLM's names (offline API).

Owns: the value type `LoRARequest(lora_name, lora_int_id, lora_path)`. Does not know: the
adapter's files or weights (peft_format.py), the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.config.lora_config import check_lora_name


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's positional order: name, a positive integer id, the PEFT folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        check_lora_name(self.lora_name)
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or (
                self.lora_int_id < 1):
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError("LoRARequest needs lora_path (the adapter's PEFT folder)")

"""radixserve: a prefix-sharing LLM serving engine.

`from radixserve import LLM, SamplingParams` is the offline API (with `Constraint` for
structured output, `LoRARequest` for adapters). LLM is imported lazily (module
`__getattr__`), so that importing radixserve.server or the router never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixserve.constraints import Constraint
from radixserve.lora.request import LoRARequest
from radixserve.types import SamplingParams

if TYPE_CHECKING:
    from radixserve.llm import LLM, RequestOutput

__all__ = ["LLM", "Constraint", "LoRARequest", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "RequestOutput"):
        from radixserve import llm
        return getattr(llm, name)
    raise AttributeError(f"module 'radixserve' has no attribute {name!r}")

"""The only types that cross the process boundary between the API process and the engine.

Owns: the message dataclasses (pickled through multiprocessing pipes/queues).
Does not know: aiohttp, torch. Keep them small: token ids, not text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from radixserve.types import SamplingParams, TokenOutput


@dataclass(frozen=True)
class GenerateMsg:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str = ""
    priority: int = 0  # lower = more important (vLLM's convention)
    # OpenAI's `prediction`, tokenized: a draft source for this request (speculative decoding)
    prediction_ids: list[int] | None = None
    # The LoRA adapter it runs under (None: the base model); the path where the engine does
    # not know the name yet (an offline LoRARequest).
    lora_name: str | None = None
    lora_path: str | None = None


@dataclass(frozen=True)
class AbortMsg:
    rid: str


@dataclass(frozen=True)
class FlushCacheMsg:
    include_pins: bool = False  # also release every pinned prefix first


@dataclass(frozen=True)
class PinMsg:
    """Prefill `token_ids` if needed, then lock its whole pages in the tree (a pin)."""

    call_id: str
    token_ids: list[int]
    salt: str = ""
    ttl_s: float | None = None


@dataclass(frozen=True)
class UnpinMsg:
    """Release one pin by id, or every pin of exactly this prefix in this namespace."""

    call_id: str
    pin_id: str | None = None
    token_ids: list[int] | None = None
    salt: str = ""


@dataclass(frozen=True)
class ListPinsMsg:
    call_id: str


@dataclass(frozen=True)
class CallResultMsg:
    """Reply to a Pin/Unpin/ListPins call: a result, or an error with an HTTP-like status."""

    call_id: str
    result: dict[str, Any] | None = None
    error: str | None = None
    status: int = 200


@dataclass(frozen=True)
class LoadLoRAMsg:
    """POST /v1/load_lora_adapter: read the adapter (off the step), reply when loaded."""

    call_id: str
    lora_name: str
    lora_path: str


@dataclass(frozen=True)
class UnloadLoRAMsg:
    """POST /v1/unload_lora_adapter: forget the adapter (running requests finish with it)."""

    call_id: str
    lora_name: str


CacheCallMsg = Union[PinMsg, UnpinMsg, ListPinsMsg, LoadLoRAMsg, UnloadLoRAMsg]


@dataclass(frozen=True)
class FlushCacheResultMsg:
    """Reply to FlushCacheMsg: False when requests were running (nothing flushed)."""

    flushed: bool


@dataclass(frozen=True)
class ShutdownMsg:
    pass


@dataclass(frozen=True)
class TokenBatchMsg:
    """Everything one engine step produced, for all requests."""

    outputs: list[TokenOutput]


@dataclass(frozen=True)
class EngineStatsMsg:
    """Periodic snapshot for /metrics, logs and /server_info."""

    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineReadyMsg:
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineErrorMsg:
    """The engine hit an error: for one request (rid set) or fatally (rid None)."""

    message: str
    rid: str | None = None
    status: int = 500


@dataclass(frozen=True)
class CacheEventsMsg:
    """Radix-cache events (radix_cache.CacheEvent tuples) of one or more steps, for /kv_events."""

    events: list[Any]

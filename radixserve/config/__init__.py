"""Frozen, validated settings, built once at the edge (the CLI or the offline LLM).

One module per config: engine_config (EngineConfig, SchedulePolicy), server_config
(ServerConfig), speculative_config (SpeculativeConfig, vLLM's --speculative-config),
kv_events_config (KVEventsConfig, vLLM's --kv-events-config), lora_config (LoRAConfig,
vLLM's --enable-lora flags); parsing holds ConfigError and
the JSON-valued flag rule. This package re-exports them so callers write
`from radixserve.config import EngineConfig`. Nothing here imports torch.
"""

from __future__ import annotations

from radixserve.config.engine_config import (
    ATTENTION_BACKENDS,
    DTYPES,
    EVICTION_POLICIES,
    KV_CACHE_DTYPES,
    KV_OFFLOAD_WRITE_POLICIES,
    QUANTIZATIONS,
    SCHEDULE_POLICIES,
    TIER_BLOCK_SIZE,
    EngineConfig,
    SchedulePolicy,
)
from radixserve.config.kv_events_config import (
    KV_EVENT_PUBLISHERS,
    KVEventsConfig,
    kv_events_config_from,
)
from radixserve.config.lora_config import LoRAConfig, LoRAModule
from radixserve.config.parsing import ConfigError, json_object_from
from radixserve.config.server_config import (
    METRICS_COMPAT,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    ServerConfig,
)
from radixserve.config.speculative_config import SpeculativeConfig

__all__ = [
    "ATTENTION_BACKENDS", "DTYPES", "EVICTION_POLICIES", "KV_CACHE_DTYPES",
    "KV_EVENT_PUBLISHERS", "KV_OFFLOAD_WRITE_POLICIES", "METRICS_COMPAT", "QUANTIZATIONS",
    "REASONING_PARSERS", "SCHEDULE_POLICIES", "TIER_BLOCK_SIZE", "TOOL_CALL_PARSERS",
    "ConfigError", "EngineConfig", "KVEventsConfig", "LoRAConfig", "LoRAModule",
    "SchedulePolicy", "ServerConfig", "SpeculativeConfig",
    "json_object_from", "kv_events_config_from",
]

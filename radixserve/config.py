"""Frozen, validated settings for the engine and the server; built once at the edge (the CLI).

Owns: ModelConfig-independent knobs (EngineConfig, ServerConfig). Does not know: argparse
(cli.py builds these), the model's own config.json (model/ reads it).
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.spec.config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")


class SchedulePolicy(enum.StrEnum):
    """Order of the waiting queue (sched/policy.py); the values are the CLI's strings."""

    LPM = "lpm"  # longest prefix match first (with an age guard)
    FCFS = "fcfs"  # arrival order


SCHEDULE_POLICIES = tuple(p.value for p in SchedulePolicy)
ATTENTION_BACKENDS = ("auto", "torch", "triton")
QUANTIZATIONS = ("int8",)  # weight int8, per output channel (model/quant.py)
EVICTION_POLICIES = ("lru", "slru")
TOOL_CALL_PARSERS = ("hermes", "llama3_json")  # api/tools/parsers.py's registry
METRICS_COMPAT = ("vllm",)  # --metrics-compat: also export these engines' metric names
KV_EVENT_PUBLISHERS = ("null", "zmq")
_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")
KV_OFFLOAD_WRITE_POLICIES = ("write_back", "write_through")
TIER_BLOCK_SIZE = 16  # tier blocks are kv_events' blocks


class ConfigError(ValueError):
    """A setting is invalid; the message names it and what is allowed."""


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m"
    # auto: bfloat16 on CUDA, on CPUs with AMX, and on AVX512-BF16 CPUs where a start-up
    # matmul measures it faster than fp32; else float32 (model/auto_dtype.py)
    dtype: str = "auto"
    quantization: str | None = None  # "int8": int8 weights for every linear layer
    device: str = "auto"  # auto: cuda if available else cpu
    max_model_len: int | None = None  # default: the model's max_position_embeddings (capped)
    kv_cache_tokens: int | None = None  # default: sized from free memory
    page_size: int = 1
    max_running_requests: int = 256
    max_prefill_tokens: int = 8192  # token budget of one prefill batch
    chunked_prefill_size: int = 2048  # 0 disables chunking
    # While requests decode, prefill chunks (up to chunked_prefill_size tokens) share their
    # forward (MIXED steps); False: decode and prefill steps alternate.
    mixed_chunk: bool = True
    schedule_policy: SchedulePolicy = SchedulePolicy.LPM  # a string is parsed at the edge
    disable_radix_cache: bool = False
    attention_backend: str = "auto"
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU
    enable_kv_events: bool = False
    eviction_policy: str = "lru"  # slru: prefixes hit more than once outlive one-off prompts
    # Fraction of the KV pool a tenant (API key) may keep cached before eviction takes from it
    # first; None: no quotas.
    tenant_cache_quota: float | None = None
    # Pinned prefixes (POST /cache/pin) may lock at most this many tokens; None: a quarter of
    # the KV pool, so pins can never starve serving.
    max_pinned_tokens: int | None = None
    # vLLM's --speculative-config (JSON text or a dict here, parsed into SpeculativeConfig);
    # None: no server-wide drafting (a request's own `prediction` still drafts).
    speculative_config: SpeculativeConfig | None = None
    # Tiers below the pool (cache/kv_tiers.py). The local tier: files under this directory,
    # bounded by kv_offload_size GiB (on CUDA with host memory of kv_offload_host_size GiB
    # above the disk); the shared tier: a directory several replicas mount, written through.
    kv_offload_dir: str | None = None
    kv_offload_size: float = 16.0
    kv_shared_dir: str | None = None
    kv_offload_write_policy: str = "write_back"  # or write_through (bench/README.md)
    kv_offload_host_size: float = 4.0

    @property
    def kv_tiers_enabled(self) -> bool:
        return self.kv_offload_dir is not None or self.kv_shared_dir is not None

    def __post_init__(self) -> None:
        for name in ("kv_offload_dir", "kv_shared_dir"):
            value = getattr(self, name)
            if value is not None:  # a Path is accepted (LLM(kv_offload_dir=tmp_path))
                object.__setattr__(self, name, os.fspath(value))
        self._parse_speculative()
        if self.dtype not in DTYPES:
            raise ConfigError(f"unsupported dtype {self.dtype!r}; supported: {', '.join(DTYPES)}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"unsupported quantization {self.quantization!r}; supported: "
                              f"{', '.join(QUANTIZATIONS)} (or none)")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ConfigError(
                f"unknown schedule policy {self.schedule_policy!r}; "
                f"supported: {', '.join(SCHEDULE_POLICIES)}"
            )
        object.__setattr__(self, "schedule_policy", SchedulePolicy(self.schedule_policy))
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"unknown attention backend {self.attention_backend!r}; "
                f"supported: {', '.join(ATTENTION_BACKENDS)}"
            )
        if self.page_size < 1:
            raise ConfigError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.page_size:
            raise ConfigError(f"kv_cache_tokens must be >= page_size, got {self.kv_cache_tokens}")
        if self.max_running_requests < 1:
            raise ConfigError("max_running_requests must be >= 1")
        if self.max_prefill_tokens < 1:
            raise ConfigError("max_prefill_tokens must be >= 1")
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ConfigError(f"unknown eviction policy {self.eviction_policy!r}; "
                              f"supported: {', '.join(EVICTION_POLICIES)}")
        if self.tenant_cache_quota is not None and not 0 < self.tenant_cache_quota <= 1:
            raise ConfigError(
                f"tenant_cache_quota must be in (0, 1], got {self.tenant_cache_quota}")
        if self.max_pinned_tokens is not None and self.max_pinned_tokens < 0:
            raise ConfigError(f"max_pinned_tokens must be >= 0, got {self.max_pinned_tokens}")
        if self.chunked_prefill_size < 0:
            raise ConfigError("chunked_prefill_size must be >= 0 (0 disables chunking)")
        self._check_tiers()

    def _check_tiers(self) -> None:
        if not self.kv_offload_size > 0 or not self.kv_offload_host_size > 0:
            raise ConfigError(f"kv_offload_size and kv_offload_host_size must be > 0 GiB, got "
                              f"{self.kv_offload_size} and {self.kv_offload_host_size}")
        if self.kv_offload_write_policy not in KV_OFFLOAD_WRITE_POLICIES:
            raise ConfigError(f"unknown kv_offload_write_policy "
                              f"{self.kv_offload_write_policy!r}; supported: "
                              f"{', '.join(KV_OFFLOAD_WRITE_POLICIES)}")
        if not self.kv_tiers_enabled:
            return
        if TIER_BLOCK_SIZE % self.page_size:
            raise ConfigError(f"--kv-offload-dir / --kv-shared-dir store {TIER_BLOCK_SIZE}-token "
                              f"blocks: page_size must divide {TIER_BLOCK_SIZE}, got "
                              f"{self.page_size}")
        if self.disable_radix_cache:
            raise ConfigError("--kv-offload-dir / --kv-shared-dir extend the radix cache: they "
                              "cannot be used with --disable-radix-cache")
        if self.kv_offload_dir is not None and self.kv_offload_dir == self.kv_shared_dir:
            raise ConfigError("--kv-offload-dir and --kv-shared-dir must be different "
                              "directories")

    def _parse_speculative(self) -> None:
        value: Any = self.speculative_config
        if value is None:
            return
        from radixserve.spec.config import SpeculativeConfig

        # Built once at the edge: the flag's JSON or the offline API's dict becomes the frozen
        # SpeculativeConfig (ConfigError when invalid).
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(value))


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` (same keys and defaults): block events as msgpack over a
    ZMQ PUB socket, numbered, with an optional ROUTER socket that replays recent batches."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when events are enabled, else "null" (vLLM)
    endpoint: str = "tcp://*:5557"  # bound when it has a wildcard (or ipc/inproc), else connected
    replay_endpoint: str | None = None  # always bound
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher_name == "zmq"

    @property
    def publisher_name(self) -> str:
        return self.publisher or ("zmq" if self.enable_kv_cache_events else "null")

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ConfigError("kv-events-config: enable_kv_cache_events must be true or false")
        if self.publisher_name not in KV_EVENT_PUBLISHERS:
            raise ConfigError(f"kv-events-config: unknown publisher {self.publisher!r}; "
                              f"supported: {', '.join(KV_EVENT_PUBLISHERS)}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str)
                                      or not value.startswith(_ZMQ_SCHEMES)):
                raise ConfigError(f"kv-events-config: {name} must be a ZMQ endpoint "
                                  f"(tcp://host:port, ipc://path), got {value!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"kv-events-config: {name} must be an integer >= 1, "
                                  f"got {value!r}")
        if not isinstance(self.topic, str):
            raise ConfigError(f"kv-events-config: topic must be a string, got {self.topic!r}")


def json_object_from(value: object, what: str) -> Mapping[str, Any]:
    """A config flag's value as a mapping: the mapping itself, or its JSON text parsed (vLLM's
    JSON-valued flags and the offline API's dicts). Raises ConfigError naming `what`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{what} is not valid JSON: {err}") from None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{what} must be a JSON object")
    return value


def kv_events_config_from(value: object, what: str = "kv_events_config") -> KVEventsConfig:
    """A KVEventsConfig from itself, a dict of vLLM's keys, or their JSON; raises
    ConfigError naming `what` for anything else."""
    if isinstance(value, KVEventsConfig):
        return value
    value = json_object_from(value, what)
    unknown = sorted(set(value) - {f.name for f in fields(KVEventsConfig)})
    if unknown:
        raise ConfigError(f"{what}: unknown key(s) {', '.join(map(str, unknown))}")
    return KVEventsConfig(**value)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    api_keys: tuple[str, ...] = ()
    admin_key: str | None = None  # for admin routes (/cache/pin...) when keys are configured
    shared_cache: bool = False  # False: the prefix cache is namespaced per API key
    served_model_name: str | None = None
    max_tokens_cap: int | None = None
    max_input_tokens: int | None = None
    max_concurrent_per_key: int | None = None
    max_queue: int | None = None  # waiting + running requests; past it: 429
    log_stats_interval: float = 5.0
    tool_call_parser: str = "hermes"  # how tool calls are written and read back
    api_keys_file: str | None = None  # JSON/TOML: named keys with per-key limits (SIGHUP reloads)
    log_requests: bool = False  # one line per request; prompts cut short, keys never shown
    request_timeout: float | None = None  # seconds from arrival; past it: abort, 408
    max_body_bytes: int = 32 * 1024 * 1024
    max_connections: int = 2048  # open client connections; past it: 503 and close
    keepalive_timeout: float = 15.0  # idle (or still sending its headers) connection: closed
    body_timeout: float = 30.0  # a request body not fully received by then: 408
    send_timeout: float = 30.0  # a client that accepts no bytes this long: dropped
    shutdown_timeout: float = 30.0  # SIGTERM: in-flight requests get this long to finish
    restart_engine: bool = False  # engine died: restart it (with backoff) instead of exiting 1
    kv_events_config: KVEventsConfig | None = None  # vLLM-format events over ZMQ too
    metrics_compat: str | None = None  # "vllm": /metrics also carries vllm:* gauges
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_tokens_cap", "max_input_tokens", "max_concurrent_per_key", "max_queue",
                     "max_body_bytes", "max_connections"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(
                f"unknown tool-call parser {self.tool_call_parser!r}; "
                f"supported: {', '.join(TOOL_CALL_PARSERS)}"
            )
        for name in ("request_timeout", "keepalive_timeout", "body_timeout", "send_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {value}")
        if self.metrics_compat is not None and self.metrics_compat not in METRICS_COMPAT:
            raise ConfigError(f"unknown metrics compat {self.metrics_compat!r}; supported: "
                              f"{', '.join(METRICS_COMPAT)}")
        if self.kv_events_config is not None and self.kv_events_config.publishes \
                and not self.engine.enable_kv_events:
            raise ConfigError("kv-events-config publishes events the engine must emit: "
                              "set engine.enable_kv_events too")
        if not self.shutdown_timeout >= 0:
            raise ConfigError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")

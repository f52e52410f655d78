"""ServerConfig: the API process's settings (HTTP, keys, limits, timeouts) and its engine's.

Owns: validation of the server's flags. Does not know: argparse (cli.py), aiohttp.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.config.engine_config import EngineConfig
from radixserve.config.kv_events_config import HashAlgo, KVEventsConfig
from radixserve.config.parsing import ConfigError

TOOL_CALL_PARSERS = ("hermes", "llama3_json")  # api/tools/parsers.py's registry
REASONING_PARSERS = ("qwen3", "deepseek_r1")  # api/reasoning.py's registry
METRICS_COMPAT = ("vllm",)  # --metrics-compat: also export these engines' metric names


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
    reasoning_parser: str | None = None  # <think>...</think> read into reasoning_content
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
    # /v1/responses kept for previous_response_id and GET (least recently used dropped first;
    # 0: none kept). Each holds its own input and output; a chain shares its items.
    responses_store_size: int = 10000
    # The block hashes of both KV event streams: radixserve's xxh64 or vLLM's sha256_cbor.
    prefix_caching_hash_algo: str = HashAlgo.XXH64.value
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
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"unknown reasoning parser {self.reasoning_parser!r}; "
                              f"supported: {', '.join(REASONING_PARSERS)}")
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
        if self.responses_store_size < 0:
            raise ConfigError(f"responses_store_size must be >= 0, got "
                              f"{self.responses_store_size}")
        if self.prefix_caching_hash_algo not in {a.value for a in HashAlgo}:
            raise ConfigError(f"unknown prefix-caching hash algo "
                              f"{self.prefix_caching_hash_algo!r}; supported: "
                              f"{', '.join(a.value for a in HashAlgo)}")
        if not self.shutdown_timeout >= 0:
            raise ConfigError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")

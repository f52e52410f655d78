"""KVEventsConfig: vLLM's `--kv-events-config`, parsed and validated once at the edge.

Owns: the ZMQ publisher's settings. Does not know: the publisher (kv_events/zmq_stream.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields

from radixserve.config.parsing import ConfigError, json_object_from

KV_EVENT_PUBLISHERS = ("null", "zmq")
_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


class HashAlgo(str, enum.Enum):
    """--prefix-caching-hash-algo: how both KV event streams hash a block (kv_events/)."""

    XXH64 = "xxh64"  # radixserve's own chain (publisher.py's docstring)
    SHA256_CBOR = "sha256_cbor"  # vLLM's cross-language scheme


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

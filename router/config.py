"""The router's settings: one frozen dataclass, validated once, built by the CLI (or a test).

Owns: every knob of the router and its defaults. Does not know: argparse (see __main__.py),
aiohttp.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from radixserve.config.kv_events_config import HashAlgo


class ConfigError(ValueError):
    """A setting is invalid; the message names it and what is allowed."""


# Canary groups (canary.py): workers outside any named group form the stable group, which
# gets the share of sessions the named groups leave.
STABLE_GROUP = "stable"
_GROUP_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")


def check_group_name(name: str, flag: str) -> None:
    """Raises ConfigError unless `name` is a usable group name (a metric label value)."""
    if not isinstance(name, str) or not _GROUP_NAME.fullmatch(name):
        raise ConfigError(f"{flag}: a group name is a letter then up to 63 letters, digits, "
                          f"'_', '.' or '-', got {name!r}")


def check_share(share: object, flag: str) -> float:
    """`share` as a float in [0, 1]; raises ConfigError naming `flag` otherwise."""
    if isinstance(share, bool) or not isinstance(share, (int, float)) \
            or not math.isfinite(share) or not 0.0 <= share <= 1.0:
        raise ConfigError(f"{flag} must be a number in [0, 1], got {share!r}")
    return float(share)


def check_total_share(weights: dict[str, float], flag: str) -> None:
    total = sum(weights.values())
    if total > 1.0 + 1e-9:
        raise ConfigError(f"{flag}: the groups' shares add up to {total:g} > 1 ({weights})")


class PolicyName(str, enum.Enum):
    CACHE_AWARE = "cache_aware"
    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"
    RANDOM = "random"


def normalize_worker_url(url: str) -> str:
    """`http://host:port` without a trailing slash; raises ConfigError for anything else."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"worker URL must look like http://host:port, got {url!r}")
    if parts.query or parts.fragment:
        raise ConfigError(f"worker URL must not carry a query or fragment, got {url!r}")
    try:
        parts.port  # noqa: B018 -- raises ValueError on a bad port
    except ValueError as e:
        raise ConfigError(f"bad port in worker URL {url!r}") from e
    return f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"


@dataclass(frozen=True)
class RouterConfig:
    workers: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 30000
    policy: PolicyName = PolicyName.CACHE_AWARE
    # Admin routes (/workers, /flush_cache) need this key; without one, the mutating ones
    # (POST/DELETE /workers, POST /flush_cache) are off (403).
    admin_key: str | None = None
    replica_api_key: str | None = None  # sent to replicas on /kv_events and /flush_cache
    # Precise mode: follow each replica's /kv_events; needs a tokenizer for text prompts.
    kv_events: bool = False
    tokenizer: str | None = None  # a model spec radixserve.model_source understands
    kv_block_size: int = 16  # must equal the replicas' --kv-events block size
    # ... and this their --prefix-caching-hash-algo (xxh64 or vLLM's sha256_cbor)
    prefix_caching_hash_algo: HashAlgo = HashAlgo.XXH64
    pending_ttl_s: float = 30.0  # routed-but-not-yet-announced blocks count this long
    kv_stream_timeout_s: float = 30.0  # no byte (not even a keepalive) for this long: down
    precise_max_blocks: int = 1 << 20  # block hashes kept per replica, oldest dropped beyond
    # Cache namespaces: True mirrors replicas that salt their cache per API key (the
    # default); False mirrors replicas started with --shared-cache.
    salt_by_api_key: bool = True
    # Approximate index: chained hashes of `block_chars`-byte blocks of the prompt text.
    block_chars: int = 64
    index_max_entries: int = 1 << 20  # (block, worker) pairs over ALL workers, LRU beyond
    # cache_aware score = match_ratio - balance_lambda * (load - min_load) / max(1, mean_load)
    balance_lambda: float = 0.5
    # Loads differing by at most this many requests count as equal (policy.py); 0: off.
    balance_abs_threshold: int = 0
    # Health: GET /health every interval; N failures -> down, M successes -> up.
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0
    fail_threshold: int = 3
    success_threshold: int = 2
    # Retries of a request that failed before any response byte was relayed: connection
    # errors, 5xx and 429 answers.
    max_retries: int = 3
    retry_backoff_s: float = 0.05  # 50 ms x 1.5^n
    retry_backoff_factor: float = 1.5
    connect_timeout_s: float = 5.0
    seed: int = 0  # the random policy's generator
    # Canary (canary.py): (url, group) for each worker outside the stable group, and
    # (group, share of new sessions in [0, 1]) for each such group; stable gets the rest.
    worker_groups: tuple[tuple[str, str], ...] = ()
    group_weights: tuple[tuple[str, float], ...] = ()
    # Sessions (session.py): a session's replica keeps it while its load is below
    # ceil(session_load_factor * (in flight + 1) / replicas); the table holds max_sessions.
    session_load_factor: float = 1.25
    max_sessions: int = 1 << 20
    # Breaker (breaker.py): an open worker waits this long (doubled per consecutive trip, at
    # most breaker_max_cooldown_s) before a successful probe lets a trial request in.
    breaker_cooldown_s: float = 1.0
    breaker_max_cooldown_s: float = 30.0
    # Mid-stream failover (resume.py): resumes per request; a stream without a byte for this
    # long (after its first) counts as broken. 0 resumes: a broken stream ends with an error.
    max_resumes: int = 1
    stream_stall_timeout_s: float = 60.0
    # Every wait on a replica is bounded (relay.py): response headers and the first body byte
    # within first_byte_timeout_s, a whole non-streamed answer within request_timeout_s.
    # Past either: 504 (or, mid-stream, an SSE error event), one fault for the replica.
    request_timeout_s: float = 600.0
    first_byte_timeout_s: float = 60.0
    # Fleet-wide limits (limits.py): the replicas' keys file, and how many routers share it
    # (each enforces 1/router_replicas of every rpm, tpm and max_concurrency).
    api_keys_file: str | None = None
    router_replicas: int = 1
    # redis://HOST:PORT/DB: every router counts the keys' limits in this Redis, exactly
    # (redis_limits.py); router_replicas is then the share each uses while it is down.
    redis_url: str | None = None

    def _check_groups(self) -> None:
        grouped = dict(self.worker_groups)
        weights = dict(self.group_weights)
        if len(grouped) != len(self.worker_groups) or len(weights) != len(self.group_weights):
            raise ConfigError("--worker: a worker is in one group, a group has one weight")
        for url, group in grouped.items():
            if url not in self.workers:
                raise ConfigError(f"--worker: {url!r} has a group but is not a worker")
            check_group_name(group, "--worker URL@GROUP")
        for group, share in weights.items():
            check_group_name(group, "--worker URL@GROUP")
            check_share(share, "--weight")
            if group not in grouped.values():
                raise ConfigError(f"--weight: group {group!r} has a weight but no worker")
        if STABLE_GROUP in grouped.values() or STABLE_GROUP in weights:
            raise ConfigError(f"--weight: the {STABLE_GROUP!r} group takes the share the "
                              "other groups leave; it has no weight of its own")
        for group in grouped.values():
            if group not in weights:
                raise ConfigError(f"--weight: group {group!r} has no weight (--worker URL "
                                  f"--weight SHARE, or --worker URL@{group}:PERCENT)")
        check_total_share(weights, "--weight")

    def __post_init__(self) -> None:
        if not isinstance(self.policy, PolicyName):
            allowed = ", ".join(p.value for p in PolicyName)
            raise ConfigError(f"unknown policy {self.policy!r}; supported: {allowed}")
        for url in self.workers:
            if normalize_worker_url(url) != url:
                raise ConfigError(f"worker URL {url!r} is not normalized (normalize_worker_url)")
        if len(set(self.workers)) != len(self.workers):
            raise ConfigError(f"duplicate worker URLs in {list(self.workers)}")
        self._check_groups()
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if not isinstance(self.prefix_caching_hash_algo, HashAlgo):
            raise ConfigError(f"unknown prefix-caching hash algo "
                              f"{self.prefix_caching_hash_algo!r}; supported: "
                              f"{', '.join(a.value for a in HashAlgo)}")
        if self.kv_events and self.policy is not PolicyName.CACHE_AWARE:
            raise ConfigError("--kv-events needs --policy cache_aware")
        for name in ("kv_block_size", "block_chars", "index_max_entries",
                     "fail_threshold", "success_threshold", "precise_max_blocks"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("health_interval_s", "health_timeout_s", "connect_timeout_s",
                     "pending_ttl_s", "kv_stream_timeout_s", "request_timeout_s",
                     "first_byte_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_retries < 0 or self.retry_backoff_s < 0 or self.retry_backoff_factor < 1:
            raise ConfigError("max_retries >= 0, retry_backoff_s >= 0, retry_backoff_factor >= 1")
        self._check_fleet()
        if self.balance_abs_threshold < 0:
            raise ConfigError(f"balance_abs_threshold must be >= 0, got "
                              f"{self.balance_abs_threshold}")
        if self.balance_lambda < 0:
            raise ConfigError(f"balance_lambda must be >= 0, got {self.balance_lambda}")
        for name in ("admin_key", "replica_api_key"):
            value = getattr(self, name)
            if value is not None and (not value or value != value.strip()):
                raise ConfigError(f"{name} must be a non-empty string without spaces around it")

    def _check_fleet(self) -> None:
        if not (math.isfinite(self.session_load_factor) and self.session_load_factor >= 1.0):
            raise ConfigError(f"session_load_factor must be >= 1, got {self.session_load_factor}")
        for name in ("max_sessions", "router_replicas"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.redis_url is not None:
            if urlsplit(self.redis_url).scheme not in ("redis", "rediss", "unix"):
                raise ConfigError(f"--redis-url must look like redis://HOST:PORT/DB, got "
                                  f"{self.redis_url!r}")
            if self.api_keys_file is None:
                raise ConfigError("--redis-url counts the limits of --api-keys-file: give both")
        if self.max_resumes < 0:
            raise ConfigError(f"max_resumes must be >= 0, got {self.max_resumes}")
        if not self.stream_stall_timeout_s > 0:
            raise ConfigError(f"stream_stall_timeout_s must be > 0, got "
                              f"{self.stream_stall_timeout_s}")
        if not 0 <= self.breaker_cooldown_s <= self.breaker_max_cooldown_s:
            raise ConfigError("0 <= breaker_cooldown_s <= breaker_max_cooldown_s")

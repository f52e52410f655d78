"""What an API key stands for, as data: the keys file, a key's digest and its cache namespace.

Owns: the keys file's format (JSON or TOML, chosen by the file's suffix; `.json` or `.toml`),
its validation, KeyEntry (a key's sha256 digest, its name and its KeyLimits), and
cache_salt_for_api_key (the prefix-cache namespace of a key, which the server, the router and
the fake replica must compute alike). The plaintext of a key is hashed as soon as it is read
and never kept. Does not know: HTTP, buckets (ratelimit.py enforces rpm/tpm), how a request's
key is checked against the table (server/access/auth.py).

Format (TOML shown; JSON is the same object: {"keys": [{...}, ...]}):

    [[keys]]
    name = "alice"              # shown in /metrics and logs; the key itself never is
    key = "sk-alice-secret"     # or key_sha256 = "<64 hex chars>" (sha256 of the key)
    rpm = 60                    # requests per minute (token bucket; burst = rpm)
    tpm = 40000                 # tokens per minute: prompt + max_tokens, refunded to actual
    max_concurrency = 4         # requests in flight at once
    max_tokens = 512            # cap on a request's max_tokens
    max_input_tokens = 4096     # cap on a prompt's length
    priority = 5                # default request priority, and the most important one the key
                                # may ask for (lower = more important; default 0)
Every limit is optional (absent: only the server-wide flags apply).
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import orjson

from radixserve.config import ConfigError

NAME_RE = re.compile(r"^[A-Za-z0-9_.@:-]{1,64}$")  # safe as a Prometheus label value
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def cache_salt_for_api_key(api_key: str | None) -> str:
    """The cache namespace of an API key: "" for none, else 16 hex chars of its sha256."""
    if api_key is None:
        return ""
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()[:16]


def digest_key(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


@dataclass(frozen=True)
class KeyLimits:
    rpm: int | None = None
    tpm: int | None = None
    max_concurrency: int | None = None
    max_tokens: int | None = None
    max_input_tokens: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise ConfigError(f"'{f.name}' must be an integer >= 1, got {value!r}")


LIMIT_FIELDS = frozenset(f.name for f in fields(KeyLimits))
ENTRY_FIELDS = LIMIT_FIELDS | {"name", "key", "key_sha256", "priority"}
MAX_ABS_PRIORITY = 1_000_000  # the bound on a request's `priority` too (protocol.py)


@dataclass(frozen=True)
class KeyEntry:
    name: str
    digest: bytes  # sha256 of the key
    limits: KeyLimits
    admin: bool = False  # the server's --admin-key: may use admin routes (cache pins)
    # A request without its own priority gets this one; a request may ask for a less
    # important one (larger), never a more important one. None: no floor (the admin key).
    priority: int | None = 0


def _entry(raw: Any, i: int) -> KeyEntry:
    where = f"keys[{i}]"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a table/object")
    unknown = sorted(set(raw) - ENTRY_FIELDS)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(ENTRY_FIELDS)}")
    name = raw.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise ConfigError(f"{where}: 'name' must match {NAME_RE.pattern}, got {name!r}")
    key, hexdigest = raw.get("key"), raw.get("key_sha256")
    if (key is None) == (hexdigest is None):
        raise ConfigError(f"{where} ({name}): give exactly one of 'key' and 'key_sha256'")
    if key is not None:
        if not isinstance(key, str) or not key or key != key.strip():
            raise ConfigError(f"{where} ({name}): 'key' must be a non-empty string without "
                              "surrounding spaces")
        digest = digest_key(key)
    else:
        if not isinstance(hexdigest, str) or not _HEX64.match(hexdigest.lower()):
            raise ConfigError(f"{where} ({name}): 'key_sha256' must be 64 hex characters")
        digest = bytes.fromhex(hexdigest)
    try:
        limits = KeyLimits(**{k: raw[k] for k in LIMIT_FIELDS if k in raw})
    except ConfigError as err:
        raise ConfigError(f"{where} ({name}): {err}") from None
    priority = raw.get("priority", 0)
    if (not isinstance(priority, int) or isinstance(priority, bool)
            or abs(priority) > MAX_ABS_PRIORITY):
        raise ConfigError(f"{where} ({name}): 'priority' must be an integer in "
                          f"[-{MAX_ABS_PRIORITY}, {MAX_ABS_PRIORITY}], got {priority!r}")
    return KeyEntry(name, digest, limits, priority=priority)


def parse_keys(data: Any) -> list[KeyEntry]:
    """Validate a decoded file. Raises ConfigError naming the entry at fault."""
    if not isinstance(data, dict) or set(data) != {"keys"} or not isinstance(data["keys"], list):
        raise ConfigError('the keys file must hold exactly one field, "keys": a list of keys')
    entries = [_entry(raw, i) for i, raw in enumerate(data["keys"])]
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ConfigError(f"duplicate key names in the keys file: {dup}")
    if len({e.digest for e in entries}) != len(entries):
        raise ConfigError("the same key appears twice in the keys file")
    return entries


def load_keys_file(path: str | Path) -> list[KeyEntry]:
    """Read and validate a `.json` or `.toml` keys file. Raises ConfigError."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"cannot read the keys file {path}: {err.strerror}") from None
    try:
        if path.suffix.lower() == ".toml":
            data = tomllib.loads(raw.decode("utf-8"))
        elif path.suffix.lower() == ".json":
            data = orjson.loads(raw)
        else:
            raise ConfigError(f"the keys file must end in .json or .toml, got {path.name}")
    except (tomllib.TOMLDecodeError, orjson.JSONDecodeError, UnicodeDecodeError) as err:
        # NOTE: the decoder's message may quote the offending line (a key): never show it.
        raise ConfigError(f"the keys file {path} is not valid {path.suffix[1:].upper()} "
                          f"({type(err).__name__})") from None
    return parse_keys(data)

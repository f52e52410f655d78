"""Authentication: which configured key, if any, a request's Bearer token is.

Owns: key verification (constant-time over sha256 digests, every configured key checked, so
timing reveals neither which key matched nor how much of it), the key table (from `--api-key`
flags and `--api-keys-file`, swapped whole on reload so a request in flight keeps the entry it
was admitted with), and the caller's cache salt (radixserve/api/api_keys.py computes it). Only
digests are kept; a request's plaintext key lives as long as its salt is computed. Does not
know: routes (the app decides which paths are public), the engine, the limits' enforcement
(limits.py), the keys file's format (radixserve/api/api_keys.py).
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from radixserve.api.api_keys import (
    KeyEntry,
    KeyLimits,
    cache_salt_for_api_key,
    digest_key,
    load_keys_file,
)
from radixserve.server.error_responses import APIError

ANONYMOUS = ""  # the name of every caller when no keys are configured
NO_LIMITS = KeyLimits()


@dataclass(frozen=True)
class Caller:
    """An authenticated request's identity: its key's name (never the key), limits, salt."""

    name: str
    limits: KeyLimits
    cache_salt: str
    admin: bool = False
    priority: int | None = None  # the key's priority: its default and floor (None: no floor)

    def priority_for(self, requested: int | None) -> int:
        """A request's effective priority (lower = more important). Without its own it gets
        the key's; with its own it may be less important than the key's, never more: a
        tenant cannot jump ahead of others by claiming a priority its key was not given.
        Without keys (or with the admin key) the request's own value stands, default 0."""
        if self.priority is None:
            return 0 if requested is None else requested
        return self.priority if requested is None else max(requested, self.priority)


ANONYMOUS_CALLER = Caller(ANONYMOUS, NO_LIMITS, "")
ADMIN_NAME = "admin"


def flag_entries(keys: Sequence[str]) -> list[KeyEntry]:
    """`--api-key` keys are named key-1, key-2, ... in the order given; no per-key limits,
    priority 0."""
    return [KeyEntry(f"key-{i}", digest_key(k), NO_LIMITS) for i, k in enumerate(keys, 1)]


class ApiKeys:
    def __init__(self, keys: Sequence[str], shared_cache: bool = False,
                 keys_file: str | None = None, admin_key: str | None = None) -> None:
        """Raises ConfigError when the keys file is unreadable or invalid. `admin_key` is
        accepted as a key named "admin" that may use admin routes."""
        self._flag_entries = flag_entries(keys)
        if admin_key:
            # The operator's key: its requests may set any priority.
            self._flag_entries.append(KeyEntry(ADMIN_NAME, digest_key(admin_key), NO_LIMITS,
                                               admin=True, priority=None))
        self._keys_file = None if keys_file is None else Path(keys_file)
        self._shared_cache = shared_cache
        self._entries: tuple[KeyEntry, ...] = ()
        # Cache salt -> key name, learnt as keys are used (at most one per key ever loaded):
        # lets /metrics name a tenant's cache by its key's name.
        self._salt_names: dict[str, str] = {}
        self.reload()

    def reload(self) -> list[str]:
        """Re-read the keys file (SIGHUP) and swap the table at once. Returns the key names.

        Raises ConfigError and keeps the old table when the file is invalid."""
        entries = list(self._flag_entries)
        if self._keys_file is not None:
            from_file = load_keys_file(self._keys_file)
            names = {e.name for e in from_file}
            # File names win over the generated flag names they collide with.
            entries = [e for e in entries if e.name not in names] + from_file
        self._entries = tuple(entries)
        return [e.name for e in entries]

    @property
    def enabled(self) -> bool:
        return bool(self._entries)

    @property
    def num_keys(self) -> int:
        return len(self._entries)

    def authenticate(self, authorization: str | None) -> Caller:
        """The caller (ANONYMOUS_CALLER when auth is off). Raises APIError(401)."""
        entries = self._entries  # one snapshot: a reload mid-check changes nothing here
        if not entries:
            return ANONYMOUS_CALLER
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        candidate = digest_key(token)
        found: KeyEntry | None = None
        for entry in entries:  # no early exit: the time taken does not depend on the match
            if hmac.compare_digest(candidate, entry.digest) and (found is None or entry.admin):
                found = entry
        if found is None:
            raise APIError(401, "invalid API key", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        salt = "" if self._shared_cache else cache_salt_for_api_key(token)
        if salt:
            self._salt_names[salt] = found.name
        return Caller(found.name, found.limits, salt, found.admin, found.priority)

    def cache_salt(self, key: str) -> str:
        """The cache namespace requests with `key` use ("" when shared or auth is off)."""
        if self._shared_cache or not self._entries or key == ANONYMOUS:
            return ""
        return cache_salt_for_api_key(key)

    def salt_name(self, salt: str) -> str:
        """The name of the key a cache salt belongs to (for metric labels)."""
        return self._salt_names.get(salt) or salt[:12] or "shared"

"""API keys: who may call, and which prefix-cache namespace their requests use.

Owns: key verification (constant-time over sha256 digests, every configured key checked, so
timing reveals neither which key matched nor how much of it) and the per-key cache salt.
Does not know: routes (the app decides which paths are public), the engine.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from radixserve.kv_events import cache_salt_for_api_key
from radixserve.server.errors import APIError

ANONYMOUS = ""  # the key of every request when no keys are configured


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class ApiKeys:
    def __init__(self, keys: Sequence[str], shared_cache: bool = False) -> None:
        self._digests = [_digest(k) for k in keys]
        self._shared_cache = shared_cache

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def authenticate(self, authorization: str | None) -> str:
        """The caller's key (ANONYMOUS when auth is off). Raises APIError(401)."""
        if not self._digests:
            return ANONYMOUS
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        candidate = _digest(token)
        matched = False
        for digest in self._digests:
            matched |= hmac.compare_digest(candidate, digest)
        if not matched:
            raise APIError(401, "invalid API key", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        return token

    def cache_salt(self, key: str) -> str:
        """Requests share cached prefixes only within one key's namespace (unless shared)."""
        if self._shared_cache or key == ANONYMOUS:
            return ""
        return cache_salt_for_api_key(key)

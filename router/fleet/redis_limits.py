"""Per-key limits counted in one Redis for every router (`--redis-url`).

Exact fleet-wide rpm, tpm and max_concurrency however the routers share the traffic.

Owns: the Redis keys and the two Lua scripts (atomic: a check and its charge are one step for
every router), the fallback state (Redis unreachable: say so once, count it, retry after a
pause) and its counters. Does not know: HTTP, the keys file (key_limits.py calls this with a
key's digest and its whole limits).

Layout in Redis, per key (`K` = the hex SHA-256 of the API key, as the keys file's digest;
the key itself never leaves the router):
  radixserve:limits:K:req   hash {level, stamp}: the requests-per-minute bucket
  radixserve:limits:K:tok   hash {level, stamp}: the tokens-per-minute bucket
  radixserve:limits:K:conc  sorted set: one member per request in flight, scored by when it
                            is forgotten (a router that dies cannot hold a slot forever)
The buckets are the replica's (radixserve/api/ratelimit.py): at most a minute's allowance,
refilled continuously at limit/60 per second, on Redis's clock. A bucket unused for a minute
is full, so it expires then: a missing bucket reads as full.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from radixserve.api.api_keys import KeyLimits

log = logging.getLogger(__name__)
PREFIX = "radixserve:limits:"
RETRY_DOWN_S = 1.0  # after a failure, this router uses its share this long before retrying
CALL_TIMEOUT_S = 0.5  # a Redis that hangs costs a request at most this much

# KEYS: req, tok, conc. ARGV: rpm, tpm, max_concurrency (-1: none), tokens, slot id, slot ttl.
# Returns {"ok" | "requests" | "tokens" | "concurrency", wait_s, req level, tok level}.
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rpm, tpm, cap = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local n = tonumber(ARGV[4])
local function level(key, limit)
  if limit < 0 then return -1 end
  local v = redis.call('HMGET', key, 'level', 'stamp')
  local lvl, stamp = tonumber(v[1]), tonumber(v[2])
  if not lvl then return limit end
  return math.min(limit, lvl + (now - stamp) * limit / 60)
end
local r, k = level(KEYS[1], rpm), level(KEYS[2], tpm)
if cap >= 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= cap then
    return {'concurrency', '1', tostring(r), tostring(k)}
  end
end
if rpm >= 0 and r < 1 then
  return {'requests', tostring((1 - r) * 60 / rpm), tostring(r), tostring(k)}
end
if tpm >= 0 and k < n then
  return {'tokens', tostring((n - k) * 60 / tpm), tostring(r), tostring(k)}
end
if rpm >= 0 then
  r = r - 1
  redis.call('HSET', KEYS[1], 'level', tostring(r), 'stamp', tostring(now))
  redis.call('EXPIRE', KEYS[1], 61)
end
if tpm >= 0 then
  k = k - n
  redis.call('HSET', KEYS[2], 'level', tostring(k), 'stamp', tostring(now))
  redis.call('EXPIRE', KEYS[2], 61)
end
if cap >= 0 then
  local ttl = tonumber(ARGV[6])
  redis.call('ZADD', KEYS[3], now + ttl, ARGV[5])
  redis.call('EXPIRE', KEYS[3], math.ceil(ttl) + 1)
end
return {'ok', '0', tostring(r), tostring(k)}
"""


@dataclass(frozen=True)
class Grant:
    """Redis's answer: `refused` is "" (granted), "requests", "tokens" or "concurrency"."""

    refused: str
    wait_s: float
    requests_left: float  # -1 without that limit
    tokens_left: float
    slot: str | None  # the concurrency member to release (None: no concurrency limit)


class RedisCounter:
    """The routers' shared counters; every method answers None when Redis did not."""

    def __init__(self, url: str, slot_ttl_s: float) -> None:
        self.url = url
        self.slot_ttl_s = slot_ttl_s
        self.client: Any = aioredis.Redis.from_url(
            url, socket_timeout=CALL_TIMEOUT_S, socket_connect_timeout=CALL_TIMEOUT_S,
            retry_on_timeout=False)
        self._acquire = self.client.register_script(_ACQUIRE)
        self.up = True
        self.num_fallbacks = 0  # requests limited by this router's share instead
        self._down_until = 0.0

    def _failed(self, error: BaseException) -> None:
        if self.up:
            log.warning("Redis at %s is unreachable (%r): every key's limits fall back to "
                        "this router's share until it answers", self.url, error)
        self.up = False
        self._down_until = time.monotonic() + RETRY_DOWN_S

    async def acquire(self, digest: bytes, limits: KeyLimits, num_tokens: int) -> Grant | None:
        if not self.up and time.monotonic() < self._down_until:
            self.num_fallbacks += 1
            return None
        base = PREFIX + digest.hex()
        slot = uuid.uuid4().hex if limits.max_concurrency is not None else None
        args = [-1 if v is None else v for v in (limits.rpm, limits.tpm,
                                                  limits.max_concurrency)]
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S * 2):
                answer = await self._acquire(
                    keys=[base + ":req", base + ":tok", base + ":conc"],
                    args=[*args, num_tokens, slot or "", self.slot_ttl_s])
        except (RedisError, OSError, TimeoutError) as e:
            self._failed(e)
            self.num_fallbacks += 1
            return None
        if not self.up:
            log.warning("Redis at %s answers again: limits are fleet-wide again", self.url)
            self.up = True
        kind, wait, req, tok = (x.decode() if isinstance(x, bytes) else str(x) for x in answer)
        refused = "" if kind == "ok" else kind
        return Grant(refused, float(wait), float(req), float(tok),
                     None if refused else slot)

    async def release(self, digest: bytes, slot: str) -> None:
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S * 2):
                await self.client.zrem(PREFIX + digest.hex() + ":conc", slot)
        except (RedisError, OSError, TimeoutError) as e:
            self._failed(e)  # the slot expires by itself (slot_ttl_s)

    async def close(self) -> None:
        await self.client.aclose()

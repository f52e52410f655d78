"""Fleet-wide per-key limits: rpm, tpm and max_concurrency, enforced before routing.

So that a key spread over N replicas gets its limit once and not N times.

Owns: the keys file as the router reads it (the replicas' own file and format:
radixserve.api.api_keys), its reload on SIGHUP (a bad file keeps the old keys, logged), each
key's share of its limits, the per-key in-flight counts, and the 429 answers (Retry-After and
OpenAI's x-ratelimit-* headers, as the replica sends them). Does not know: routing, workers.

Arithmetic with several routers (`router_replicas` = N, each router sees its own traffic):
each enforces max(1, limit // N) of rpm, tpm and max_concurrency, so the fleet never grants
more than the limit while limit >= N (and at most N per minute below that); a load balancer
that spreads a key's requests unevenly over the routers makes the key hit its share on one
router before the whole limit is used. Tokens are charged up front as the replica does
(prompt + max_tokens), the prompt counted as its UTF-8 bytes / 4 (the router has no
tokenizer here) and never refunded; each replica still enforces its own exact buckets.
A request whose key is not in the file passes through: the replica answers it (401).

With `--redis-url` (redis_limits.py) every router counts each key's whole limits in one Redis
instead, exact however the traffic is spread; while Redis does not answer, each router falls
back to its share as above (logged once, counted in key_limits_redis_fallbacks), never a 5xx.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

import orjson
from aiohttp import web

from radixserve.api.api_keys import KeyLimits, digest_key, load_keys_file
from radixserve.api.protocol import COMPLETIONS_DEFAULT_MAX_TOKENS
from radixserve.api.ratelimit import RateLimiter, format_duration
from radixserve.config import ConfigError
from router.fleet.redis_limits import Grant, RedisCounter

log = logging.getLogger(__name__)
BYTES_PER_TOKEN = 4
CONCURRENCY_RETRY_AFTER_S = 1


def share(limits: KeyLimits, num_routers: int) -> KeyLimits:
    def part(value: int | None) -> int | None:
        return None if value is None else max(1, value // num_routers)

    return replace(limits, rpm=part(limits.rpm), tpm=part(limits.tpm),
                   max_concurrency=part(limits.max_concurrency))


def estimate_tokens(body: Any) -> int:
    """prompt + max_tokens, the prompt estimated from its bytes (module docstring)."""
    if not isinstance(body, dict):
        return 1
    prompt = body.get("prompt", body.get("messages", body.get("input", body.get("text"))))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        num_prompt = len(prompt)
    else:
        num_prompt = len(orjson.dumps(prompt)) // BYTES_PER_TOKEN if prompt else 0
    out = body.get("max_completion_tokens", body.get("max_tokens",
                                                     body.get("max_output_tokens")))
    if not isinstance(out, int) or isinstance(out, bool):
        out = COMPLETIONS_DEFAULT_MAX_TOKENS if "prompt" in body else 0
    return max(1, num_prompt + max(0, out))


def _capped(num_tokens: int, limits: KeyLimits) -> int:
    """A request larger than a minute's allowance is the replica's to refuse (400)."""
    return num_tokens if limits.tpm is None else min(num_tokens, limits.tpm)


def _refusal(grant: Grant, limits: KeyLimits) -> web.Response | None:
    """Redis's answer as the replica's 429 (None: granted)."""
    headers: dict[str, str] = {}
    for kind, limit, left in (("requests", limits.rpm, grant.requests_left),
                              ("tokens", limits.tpm, grant.tokens_left)):
        if limit is not None:
            headers[f"x-ratelimit-limit-{kind}"] = str(limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(left)))
            headers[f"x-ratelimit-reset-{kind}"] = format_duration((limit - left) * 60 / limit)
    if not grant.refused:
        return None
    if grant.refused == "concurrency":
        return _too_many(f"too many concurrent requests for this API key (fleet-wide: "
                         f"{limits.max_concurrency})", "concurrency_limit_exceeded",
                         CONCURRENCY_RETRY_AFTER_S, headers)
    per_min = limits.rpm if grant.refused == "requests" else limits.tpm
    return _too_many(f"rate limit reached for {grant.refused} per minute (fleet-wide: "
                     f"{per_min}); retry in {grant.wait_s:.1f}s", "rate_limit_exceeded",
                     grant.wait_s, headers)


def _too_many(message: str, code: str, retry_after_s: float,
              headers: dict[str, str]) -> web.Response:
    body = {"error": {"message": message, "type": "rate_limit_error", "param": None,
                      "code": code}}
    return web.Response(status=429, body=orjson.dumps(body), content_type="application/json",
                        headers={**headers, "Retry-After": str(max(1, math.ceil(retry_after_s)))})


@dataclass(frozen=True)
class _Key:
    name: str
    whole: KeyLimits  # the file's limits: what Redis counts fleet-wide
    share: KeyLimits  # this router's part of them, without Redis (or while it is down)


class FleetLimits:
    def __init__(self, path: str, num_routers: int,
                 clock: Callable[[], float] | None = None,
                 redis: RedisCounter | None = None) -> None:
        self.path = path
        self.num_routers = num_routers
        self.rate = RateLimiter(clock) if clock is not None else RateLimiter()
        self.redis = redis
        self._keys: dict[bytes, _Key] = {}
        self._in_flight: dict[str, int] = {}
        self.num_refused = 0
        self.reload()

    def reload(self) -> None:
        """Read the file again; raises ConfigError (the old keys stay)."""
        entries = load_keys_file(self.path)
        self._keys = {e.digest: _Key(e.name, e.limits, share(e.limits, self.num_routers))
                      for e in entries}

    def reload_logged(self) -> None:
        try:
            self.reload()
            log.info("keys file %s reloaded: %d keys", self.path, len(self._keys))
        except ConfigError as e:
            log.error("keys file %s not reloaded (the old keys stay): %s", self.path, e)

    def _caller(self, authorization: str | None) -> tuple[bytes, _Key] | None:
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        digest = digest_key(token.strip())
        key = self._keys.get(digest)
        return None if key is None else (digest, key)

    @contextlib.asynccontextmanager
    async def admit(self, authorization: str | None, body: Any
                    ) -> AsyncIterator[web.Response | None]:
        """Yields a 429 to answer, or None while the request may run (its slot held)."""
        caller = self._caller(authorization)
        if caller is None:
            yield None
            return
        digest, key = caller
        num_tokens = estimate_tokens(body)
        grant = None
        if self.redis is not None:
            grant = await self.redis.acquire(digest, key.whole, _capped(num_tokens, key.whole))
        refusal = (self._check(key.name, key.share, num_tokens) if grant is None
                   else _refusal(grant, key.whole))
        if refusal is not None:
            self.num_refused += 1
            yield refusal
            return
        self._in_flight[key.name] = self._in_flight.get(key.name, 0) + 1
        try:
            yield None
        finally:
            self._in_flight[key.name] -= 1
            if grant is not None and grant.slot is not None and self.redis is not None:
                # Shielded: a cancelled request still gives its slot back.
                await asyncio.shield(self.redis.release(digest, grant.slot))

    def _check(self, name: str, limits: KeyLimits, num_tokens: int) -> web.Response | None:
        headers = self.rate.headers(name, limits)
        cap = limits.max_concurrency
        if cap is not None and self._in_flight.get(name, 0) >= cap:
            return _too_many(f"too many concurrent requests for this API key (this router's "
                             f"share: {cap})", "concurrency_limit_exceeded",
                             CONCURRENCY_RETRY_AFTER_S, headers)
        decision = self.rate.try_acquire(name, limits, _capped(num_tokens, limits))
        if decision.retry_after_s is None:
            return None
        per_min = limits.rpm if decision.limit == "requests" else limits.tpm
        return _too_many(f"rate limit reached for {decision.limit} per minute (this router's "
                         f"share: {per_min}); retry in {decision.retry_after_s:.1f}s",
                         "rate_limit_exceeded", decision.retry_after_s,
                         self.rate.headers(name, limits))

    def in_flight(self) -> dict[str, int]:
        """This router's requests in flight per key name, every key of the file included."""
        return {k.name: self._in_flight.get(k.name, 0) for k in self._keys.values()}

    def install_sighup(self) -> Callable[[], None]:
        """Reload on SIGHUP; returns the undo (the app's cleanup calls it)."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, self.reload_logged)

        def undo() -> None:
            loop.remove_signal_handler(signal.SIGHUP)

        return undo

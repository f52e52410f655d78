"""Per-key rate limits: token buckets for requests and tokens per minute, and their headers.

Owns: one pair of buckets per key name (kept across key-file reloads, resized to the new
limits), the refill arithmetic, and OpenAI's `x-ratelimit-*` header values. A bucket holds at
most one minute's allowance (the burst) and refills continuously at limit/60 per second.
Does not know: HTTP, what a token is (the caller charges prompt + max_tokens and refunds the
difference to the actual usage), concurrency (server/access/limits.py).
All state is touched on the event loop only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from radixserve.api.api_keys import KeyLimits

WINDOW_S = 60.0


def format_duration(seconds: float) -> str:
    """OpenAI's reset format: "20ms", "1.5s", "6m0s"."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    if seconds < 60:
        return f"{seconds:.3g}s"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{rest:.0f}s"


class TokenBucket:
    def __init__(self, limit: int, now: float) -> None:
        self.limit = limit
        self.level = float(limit)
        self._stamp = now

    def resize(self, limit: int, now: float) -> None:
        self.refill(now)
        self.limit = limit
        self.level = min(self.level, float(limit))

    def refill(self, now: float) -> None:
        rate = self.limit / WINDOW_S
        self.level = min(float(self.limit), self.level + (now - self._stamp) * rate)
        self._stamp = now

    def wait_s(self, amount: float) -> float:
        """Seconds until `amount` can be taken (0 when it can be now). Call refill first."""
        missing = amount - self.level
        return 0.0 if missing <= 0 else missing * WINDOW_S / self.limit

    def reset_s(self) -> float:
        """Seconds until the bucket is full again."""
        return (self.limit - self.level) * WINDOW_S / self.limit

    def take(self, amount: float) -> None:
        self.level -= amount

    def give(self, amount: float) -> None:
        self.level = min(float(self.limit), self.level + amount)


@dataclass(frozen=True)
class RateDecision:
    """retry_after_s is None when allowed; else which limit refused and for how long."""

    retry_after_s: float | None
    limit: str = ""  # "requests" or "tokens"


class RateLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._requests: dict[str, TokenBucket] = {}
        self._tokens: dict[str, TokenBucket] = {}

    def _bucket(self, table: dict[str, TokenBucket], name: str, limit: int | None,
                now: float) -> TokenBucket | None:
        if limit is None:
            table.pop(name, None)
            return None
        bucket = table.get(name)
        if bucket is None:
            bucket = table[name] = TokenBucket(limit, now)
        elif bucket.limit != limit:
            bucket.resize(limit, now)
        else:
            bucket.refill(now)
        return bucket

    def try_acquire(self, name: str, limits: KeyLimits, num_tokens: int) -> RateDecision:
        """Take one request and `num_tokens` tokens, or nothing and say how long to wait.

        The caller checks num_tokens <= tpm first (a request larger than a minute's allowance
        could never pass)."""
        now = self._clock()
        req = self._bucket(self._requests, name, limits.rpm, now)
        tok = self._bucket(self._tokens, name, limits.tpm, now)
        if req is not None and (wait := req.wait_s(1)) > 0:
            return RateDecision(wait, "requests")
        if tok is not None and (wait := tok.wait_s(num_tokens)) > 0:
            return RateDecision(wait, "tokens")
        if req is not None:
            req.take(1)
        if tok is not None:
            tok.take(num_tokens)
        return RateDecision(None)

    def refund_tokens(self, name: str, num_tokens: int) -> None:
        bucket = self._tokens.get(name)
        if bucket is not None and num_tokens > 0:
            bucket.refill(self._clock())
            bucket.give(num_tokens)

    def headers(self, name: str, limits: KeyLimits) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for the limits this key has (none: no headers)."""
        now = self._clock()
        out: dict[str, str] = {}
        for kind, table, limit in (("requests", self._requests, limits.rpm),
                                   ("tokens", self._tokens, limits.tpm)):
            bucket = self._bucket(table, name, limit, now)
            if bucket is None:
                continue
            out[f"x-ratelimit-limit-{kind}"] = str(bucket.limit)
            out[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(bucket.level)))
            out[f"x-ratelimit-reset-{kind}"] = format_duration(bucket.reset_s())
        return out

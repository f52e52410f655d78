"""Admission limits: concurrency per API key, engine requests server-wide, rpm/tpm per key.

Owns: the counters, the 429 decisions (with Retry-After) and the Ticket a request holds for
its whole life (streaming included) through the `admit` context manager; on exit the tokens
charged up front (prompt + max_tokens) are reconciled with the tokens really used.
Does not know: routes or the engine; the buckets' arithmetic (ratelimit.py).
All state is touched on the event loop only, so no lock is needed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from radixserve.server.auth import Caller
from radixserve.server.errors import APIError
from radixserve.server.ratelimit import RateLimiter

RETRY_AFTER_S = 1


@dataclass
class Ticket:
    """One admitted HTTP request: what it was charged, and what it used so far."""

    caller: Caller
    charged_tokens: int
    used_tokens: int = 0  # prompt tokens + generated tokens, counted as outputs arrive


def _too_many(message: str, code: str, retry_after_s: float) -> APIError:
    return APIError(429, message, code=code,
                    headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})


class Admission:
    def __init__(self, max_concurrent_per_key: int | None, max_queue: int | None,
                 rate: RateLimiter | None = None,
                 on_refused: Callable[[str, str], None] | None = None) -> None:
        self._per_key_cap = max_concurrent_per_key
        self._queue_cap = max_queue
        self.rate = rate or RateLimiter()
        self._on_refused = on_refused
        self._per_key: dict[str, int] = {}
        self.num_queued = 0  # engine requests (choices) admitted and not finished

    def in_flight(self, name: str) -> int:
        return self._per_key.get(name, 0)

    @property
    def num_requests(self) -> int:
        """HTTP requests admitted and not finished (streams included)."""
        return sum(self._per_key.values())

    def _check(self, caller: Caller, num_engine_requests: int, num_tokens: int) -> None:
        limits = caller.limits
        cap = limits.max_concurrency or self._per_key_cap
        if cap is not None and self._per_key.get(caller.name, 0) >= cap:
            raise _too_many(f"too many concurrent requests for this API key (limit {cap})",
                            "concurrency_limit_exceeded", RETRY_AFTER_S)
        if self._queue_cap is not None and self.num_queued + num_engine_requests > self._queue_cap:
            raise _too_many(f"the server queue is full ({self._queue_cap} requests); retry "
                            "later", "queue_full", RETRY_AFTER_S)
        if limits.tpm is not None and num_tokens > limits.tpm:
            raise APIError(400, f"this request needs {num_tokens} tokens (prompt + max_tokens) "
                                f"but this API key's limit is {limits.tpm} tokens per minute; "
                                "lower max_tokens or shorten the prompt", param="max_tokens",
                           code="request_too_large")
        decision = self.rate.try_acquire(caller.name, limits, num_tokens)
        if decision.retry_after_s is not None:
            per_min = limits.rpm if decision.limit == "requests" else limits.tpm
            raise _too_many(f"rate limit reached for {decision.limit} per minute (limit "
                            f"{per_min}); retry in {decision.retry_after_s:.1f}s",
                            "rate_limit_exceeded", decision.retry_after_s)

    @contextmanager
    def admit(self, caller: Caller, num_engine_requests: int,
              charged_tokens: int = 0) -> Iterator[Ticket]:
        """Hold one per-key slot, `num_engine_requests` queue slots, one request and
        `charged_tokens` tokens of the key's buckets. Raises APIError(429) (or 400 for a
        request larger than the key's tpm)."""
        try:
            self._check(caller, num_engine_requests, charged_tokens)
        except APIError as err:
            if self._on_refused is not None:
                self._on_refused(caller.name, err.code or "refused")
            raise
        ticket = Ticket(caller, charged_tokens)
        self._per_key[caller.name] = self._per_key.get(caller.name, 0) + 1
        self.num_queued += num_engine_requests
        try:
            yield ticket
        finally:
            self.num_queued -= num_engine_requests
            left = self._per_key[caller.name] - 1
            if left:
                self._per_key[caller.name] = left
            else:
                del self._per_key[caller.name]
            if caller.limits.tpm is not None:
                self.rate.refund_tokens(caller.name, charged_tokens - ticket.used_tokens)

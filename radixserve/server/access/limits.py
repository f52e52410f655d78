"""Admission limits: concurrency per API key, engine requests server-wide, rpm/tpm per key.

Owns: the counters, the 429 decisions (with Retry-After) and the Ticket a request holds for
its whole life (streaming included) through the `admit` context manager; on exit the tokens
charged up front (prompt + max_tokens) are reconciled with the tokens really used. And who a
full queue refuses: the least important request, which is the newcomer unless a request
still waiting for its first token is strictly less important (larger priority); then that one
is displaced: its Ticket is marked, its queue slots pass to the newcomer at once, and its
handler (waiting through Ticket.wait_in) aborts its engine work and answers 429.
Does not know: routes or the engine; the buckets' arithmetic (radixserve/api/ratelimit.py).
All state is touched on the event loop only, so no lock is needed.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from radixserve.api.ratelimit import RateLimiter
from radixserve.server.access.auth import Caller
from radixserve.server.error_responses import APIError

RETRY_AFTER_S = 1


@dataclass(eq=False)
class Ticket:
    """One admitted HTTP request: what it was charged, and what it used so far."""

    caller: Caller
    charged_tokens: int
    used_tokens: int = 0  # prompt tokens + generated tokens, counted as outputs arrive
    num_engine_requests: int = 0  # the queue slots it holds
    priority: int = 0  # lower = more important
    seq: int = 0  # admission order
    started: bool = False  # an output reached the handler: never displaced from then on
    displaced: bool = False  # refused after admission: its queue slots were given away
    # While waiting for its first output, the handler's wait; displacement expires it.
    _window: asyncio.Timeout | None = field(default=None, repr=False)

    def wait_in(self, window: asyncio.Timeout | None) -> None:
        """The handler waits for the next output under `window` (None: the wait ended).
        Until the first output arrives, a displacement expires the window from outside (a
        TimeoutError in the waiter, after the cancellation closed the engine requests); a
        ticket displaced already is refused at once (APIError 429)."""
        if window is not None and not self.started and self.displaced:
            raise displaced_error(self)
        self._window = None if self.started else window

    def output_arrived(self) -> None:
        """An output reached the handler: from now on the ticket is never displaced."""
        self.started = True
        self._window = None

    def timeout_error(self) -> APIError | None:
        """The error a handler's expired wait means when the ticket was displaced (None:
        it was not, the wait's own deadline expired)."""
        return displaced_error(self) if self.displaced and not self.started else None


def _too_many(message: str, code: str, retry_after_s: float) -> APIError:
    return APIError(429, message, code=code,
                    headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})


class Admission:
    def __init__(self, max_concurrent_per_key: int | None, max_queue: int | None,
                 rate: RateLimiter | None = None,
                 on_refused: Callable[[str, str], None] | None = None,
                 on_displaced: Callable[[Ticket], None] | None = None) -> None:
        self._per_key_cap = max_concurrent_per_key
        self._queue_cap = max_queue
        self.rate = rate or RateLimiter()
        self._on_refused = on_refused
        self._on_displaced = on_displaced
        self._per_key: dict[str, int] = {}
        self._live: dict[int, Ticket] = {}  # admitted and not finished, by seq
        self._seq = itertools.count()
        self.num_queued = 0  # engine requests (choices) admitted, not finished nor displaced

    def in_flight(self, name: str) -> int:
        return self._per_key.get(name, 0)

    @property
    def num_requests(self) -> int:
        """HTTP requests admitted and not finished (streams included)."""
        return sum(self._per_key.values())

    def _victims(self, num_engine_requests: int, priority: int) -> list[Ticket] | None:
        """Whom a newcomer of `priority` must displace to fit: [] when it fits, None when it
        cannot (only requests still waiting and strictly less important are candidates,
        least important first, the most recent first among equals)."""
        assert self._queue_cap is not None
        excess = self.num_queued + num_engine_requests - self._queue_cap
        if excess <= 0:
            return []
        candidates = sorted((t for t in self._live.values()
                             if not t.started and not t.displaced and t.priority > priority),
                            key=lambda t: (t.priority, t.seq), reverse=True)
        victims = []
        for ticket in candidates:
            if excess <= 0:
                break
            victims.append(ticket)
            excess -= ticket.num_engine_requests
        return victims if excess <= 0 else None

    def _check(self, caller: Caller, num_engine_requests: int, num_tokens: int,
               priority: int) -> list[Ticket]:
        """Raise the refusal, or return the waiting requests to displace (usually none)."""
        limits = caller.limits
        cap = limits.max_concurrency or self._per_key_cap
        if cap is not None and self._per_key.get(caller.name, 0) >= cap:
            raise _too_many(f"too many concurrent requests for this API key (limit {cap})",
                            "concurrency_limit_exceeded", RETRY_AFTER_S)
        victims: list[Ticket] | None = []
        if self._queue_cap is not None:
            victims = self._victims(num_engine_requests, priority)
        if victims is None:
            raise _too_many(f"the server queue is full ({self._queue_cap} requests); "
                            "retry later", "queue_full", RETRY_AFTER_S)
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
        return victims

    def _displace(self, ticket: Ticket) -> None:
        ticket.displaced = True
        self.num_queued -= ticket.num_engine_requests
        if ticket._window is not None:  # its handler is waiting: wake it now
            ticket._window.reschedule(asyncio.get_running_loop().time())
        if self._on_displaced is not None:
            self._on_displaced(ticket)

    @contextmanager
    def admit(self, caller: Caller, num_engine_requests: int, charged_tokens: int = 0,
              priority: int = 0) -> Iterator[Ticket]:
        """Hold one per-key slot, `num_engine_requests` queue slots, one request and
        `charged_tokens` tokens of the key's buckets. Raises APIError(429) (or 400 for a
        request larger than the key's tpm). A full queue makes room by displacing waiting
        requests less important than `priority`, if that is enough."""
        try:
            victims = self._check(caller, num_engine_requests, charged_tokens, priority)
        except APIError as err:
            if self._on_refused is not None:
                self._on_refused(caller.name, err.code or "refused")
            raise
        for victim in victims:
            self._displace(victim)
        ticket = Ticket(caller, charged_tokens, num_engine_requests=num_engine_requests,
                        priority=priority, seq=next(self._seq))
        self._live[ticket.seq] = ticket
        self._per_key[caller.name] = self._per_key.get(caller.name, 0) + 1
        self.num_queued += num_engine_requests
        try:
            yield ticket
        finally:
            del self._live[ticket.seq]
            if not ticket.displaced:
                self.num_queued -= num_engine_requests
            left = self._per_key[caller.name] - 1
            if left:
                self._per_key[caller.name] = left
            else:
                del self._per_key[caller.name]
            if caller.limits.tpm is not None:
                self.rate.refund_tokens(caller.name, charged_tokens - ticket.used_tokens)


def displaced_error(ticket: Ticket) -> APIError:
    return _too_many(f"the server queue is full and this request (priority {ticket.priority}) "
                     "was displaced by a more important request before it started; retry "
                     "later", "queue_full", RETRY_AFTER_S)

"""Admission limits: concurrent HTTP requests per API key, and engine requests server-wide.

Owns: the counters and the 429 decisions. Does not know: routes or the engine; a request is
admitted for its whole life (streaming included) through the `admit` context manager.
All state is touched on the event loop only, so no lock is needed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from radixserve.server.errors import APIError

RETRY_AFTER_S = 1


class Admission:
    def __init__(self, max_concurrent_per_key: int | None, max_queue: int | None) -> None:
        self._per_key_cap = max_concurrent_per_key
        self._queue_cap = max_queue
        self._per_key: dict[str, int] = {}
        self.num_queued = 0  # engine requests (choices) admitted and not finished

    @contextmanager
    def admit(self, key: str, num_engine_requests: int) -> Iterator[None]:
        """Hold one per-key slot and `num_engine_requests` queue slots. Raises APIError(429)."""
        if self._per_key_cap is not None and self._per_key.get(key, 0) >= self._per_key_cap:
            raise APIError(429, f"too many concurrent requests for this API key (limit "
                                f"{self._per_key_cap})", code="concurrency_limit_exceeded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        if self._queue_cap is not None and self.num_queued + num_engine_requests > self._queue_cap:
            raise APIError(429, f"the server queue is full ({self._queue_cap} requests); retry "
                                "later", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self._per_key[key] = self._per_key.get(key, 0) + 1
        self.num_queued += num_engine_requests
        try:
            yield
        finally:
            self.num_queued -= num_engine_requests
            left = self._per_key[key] - 1
            if left:
                self._per_key[key] = left
            else:
                del self._per_key[key]

"""A request's deadline: its event stream cut off after --request-timeout (or its own).

Owns: the wrapper that closes a request's event stream at its deadline (which aborts its
engine requests, so the engine frees their pages) and raises APIError(408). Does not know:
which timeout applies (server/app_state.py picks the tightest), routes, the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any, TypeVar

from radixserve.api.errors import APIError

T = TypeVar("T")


async def deadline_events(events: AsyncGenerator[T, None], remaining: float, limit: float,
                          on_timeout: Callable[[], Any]) -> AsyncGenerator[T, None]:
    """Yield from `events` until `remaining` seconds pass, then close it (which aborts its
    engine requests) and raise APIError(408)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + remaining
    async with aclosing(events) as stream:
        iterator = stream.__aiter__()
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    item = await iterator.__anext__()
            except StopAsyncIteration:
                return
            except TimeoutError:
                on_timeout()
                raise APIError(408, f"the request did not finish within its {limit:g} s "
                                    "timeout; it was aborted", code="request_timeout") from None
            yield item

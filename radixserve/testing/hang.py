"""A replica that accepts and never answers, for the router's timeout tests.

Owns: Hang (where a request stops: before its response headers, or after them) and the aiohttp
middleware that makes every route but the operational ones (/health, /metrics, /kv_events)
hang that way while a getter says so. Does not know: the fake replica's simulation.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable

import orjson
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

OPERATIONAL = frozenset({"/health", "/metrics", "/kv_events"})


class Hang(enum.Enum):
    BEFORE_HEADERS = "before_headers"  # the request is read, nothing is ever sent back
    AFTER_HEADERS = "after_headers"  # 200 and headers (SSE when streamed), then nothing


def hang_middleware(mode: Callable[[], Hang | None]) -> Middleware:
    @web.middleware
    async def hang(request: web.Request, handler: Handler) -> web.StreamResponse:
        how = mode()
        if how is None or request.path in OPERATIONAL:
            return await handler(request)
        body = await request.read()
        if how is Hang.AFTER_HEADERS:
            streamed = bool(body) and b'"stream"' in body and \
                orjson.loads(body).get("stream") is True
            kind = "text/event-stream" if streamed else "application/json"
            resp = web.StreamResponse(headers={"Content-Type": kind})
            await resp.prepare(request)
        await asyncio.Event().wait()  # until the client leaves (handler cancellation)
        raise AssertionError("unreachable")

    return hang

"""Send timeouts: a client that stops reading is dropped, for streams and plain responses.

Owns: send_within (one bounded write of a stream: SSE) and the bounded_send middleware (a
plain response's body sent under the same timeout, SEND_TIMEOUT_KEY). Does not know: routes,
the engine, OpenAI's formats.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

logger = logging.getLogger("radixserve.server")

SEND_TIMEOUT_KEY: web.AppKey[float] = web.AppKey("radixserve_send_timeout", float)
# A body this small fits under the transport's high-water mark (asyncio: 64 KiB): its write
# never waits for the client, and the keep-alive timeout closes the connection if it stalls.
SMALL_BODY_BYTES = 64 * 1024


async def send_within(request: web.Request, resp: web.StreamResponse, data: bytes) -> None:
    """Write `data`; a client that accepts no bytes for the send timeout (it stopped reading
    but keeps the connection open) is dropped: ConnectionResetError, as if it had left, so
    the caller aborts its engine work."""
    try:
        async with asyncio.timeout(request.app.get(SEND_TIMEOUT_KEY)):
            await resp.write(data)
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()
        raise ConnectionResetError("the client stopped reading; connection dropped") from None


async def _finish_within(request: web.Request, resp: web.Response, timeout: float) -> None:
    """Send `resp` whole, dropping the connection when the client takes no bytes (the
    transport's write buffer does not change) for `timeout` seconds."""
    transport = request.transport
    loop = asyncio.get_running_loop()
    task = loop.create_task(_send_whole(request, resp))
    tick = max(0.01, timeout / 4)
    last_size, last_progress = -1, loop.time()
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=tick)
            size = transport.get_write_buffer_size() if transport is not None else 0
            if size != last_size:
                last_size, last_progress = size, loop.time()
            elif not task.done() and loop.time() - last_progress >= timeout:
                logger.info("dropped a client that took no response bytes for %g s", timeout)
                if transport is not None:
                    transport.abort()
                break
    finally:
        if not task.done():
            task.cancel()
        # A write to a client that left raises a ConnectionError: nobody to tell.
        await asyncio.gather(task, return_exceptions=True)


async def _send_whole(request: web.Request, resp: web.Response) -> None:
    await resp.prepare(request)
    await resp.write_eof()


@web.middleware
async def bounded_send(request: web.Request, handler: Any) -> web.StreamResponse:
    """Send a plain response here, under the send timeout, rather than after the handler in
    aiohttp (whose write of the body waits for the client as long as it takes: a client that
    never reads a large JSON answer would hold its connection and the body's memory for ever).
    Streams (SSE) bound each of their own writes (send_within)."""
    resp: web.StreamResponse = await handler(request)
    timeout = request.app.get(SEND_TIMEOUT_KEY)
    if (timeout is not None and isinstance(resp, web.Response) and not resp.prepared
            and (resp.content_length or 0) > SMALL_BODY_BYTES):
        await _finish_within(request, resp, timeout)
    return resp  # aiohttp's own prepare / write_eof find it sent: no-ops

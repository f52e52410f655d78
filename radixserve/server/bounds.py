"""Bounds on what one client can hold: a request's deadline, its body, and connections.

Owns: the deadline wrapper around a request's event stream (408 and an abort, so the engine
frees the request's pages), reading a body with a size cap (413) and a time cap (408, against
bodies trickled byte by byte), a send timeout for streams (a client that stops reading is
dropped; `bounded_send` does the same for a plain response's body), and GuardedRunner: an
AppRunner that refuses connections past a cap (503, then close). Idle connections, and ones still sending their headers, are closed by
aiohttp's keepalive timeout (set by the caller), which runs from the moment a connection opens.
Does not know: routes, the engine, OpenAI's formats.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any, TypeVar

import orjson
from aiohttp import web

from radixserve.server.errors import APIError

T = TypeVar("T")
logger = logging.getLogger("radixserve.server")

BODY_TIMEOUT_KEY: web.AppKey[float] = web.AppKey("radixserve_body_timeout", float)
SEND_TIMEOUT_KEY: web.AppKey[float] = web.AppKey("radixserve_send_timeout", float)
# A body this small fits under the transport's high-water mark (asyncio: 64 KiB): its write
# never waits for the client, and the keep-alive timeout closes the connection if it stalls.
SMALL_BODY_BYTES = 64 * 1024
_OVER_CAPACITY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                  b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s")


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


async def read_json(request: web.Request) -> Any:
    """The decoded body. Over the app's client_max_size: 413; slower than the body timeout: 408.
    """
    timeout = request.app.get(BODY_TIMEOUT_KEY)
    try:
        async with asyncio.timeout(timeout):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge as err:
        raise APIError(413, f"the request body is too large: {err.text}",
                       code="body_too_large") from err
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s",
                       code="body_timeout", headers={"Connection": "close"}) from None
    if not raw:
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        raise APIError(400, f"the request body is not valid JSON: {err}") from err


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


class GuardedRunner(web.AppRunner):
    """An AppRunner whose server answers 503 and closes every connection past `max_connections`
    (a slow or idle client holds a connection, never more than its share of them)."""

    def __init__(self, app: web.Application, *, max_connections: int, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._max_connections = max_connections
        self.num_refused = 0

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        admit = server.connection_made

        def connection_made(handler: Any, transport: asyncio.Transport) -> None:
            admit(handler, transport)
            if len(server.connections) > self._max_connections:
                self.num_refused += 1
                body = orjson.dumps({"error": {
                    "message": "the server has too many open connections; retry later",
                    "type": "service_unavailable", "param": None, "code": "too_many_connections"}})
                transport.write(_OVER_CAPACITY % (len(body), body))
                transport.close()

        # NOTE: aiohttp calls server.connection_made for every new connection; an instance
        # attribute is the one hook it offers without copying its Server class.
        server.connection_made = connection_made  # type: ignore[method-assign]
        return server

"""The cap on open connections: GuardedRunner, an AppRunner that refuses connections past it.

Owns: the 503-and-close answer written straight to the transport of a connection over the
cap. Idle connections, and ones still sending their headers, are closed by aiohttp's
keepalive timeout (set by the caller), which runs from the moment a connection opens.
Does not know: routes, the engine, OpenAI's formats (beyond the one error body it writes).
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

_OVER_CAPACITY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                  b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s")


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

"""Server-Sent Events responses: when headers go out, and errors after they did.

`data: {json}\\n\\n` per event, `data: [DONE]` last; or, for the Responses API (`named`),
`event: <type>\\ndata: {json}\\n\\n` per typed event, no [DONE].

Owns: when headers go out (only after the first event, so a request the engine rejects still
gets a real 4xx status), and how an error after that point is reported (an error event, then
[DONE]: the status line is already sent). Does not know: what the events contain.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import orjson
from aiohttp import web

from radixserve.server.access.send import send_within
from radixserve.server.error_responses import APIError, to_api_error

logger = logging.getLogger("radixserve.server")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"


def sse_event(data: Any, named: bool = False) -> bytes:
    body = b"data: " + orjson.dumps(data) + b"\n\n"
    return b"event: " + data["type"].encode() + b"\n" + body if named else body


async def write_sse(request: web.Request, events: AsyncGenerator[Any, None],
                    named: bool = False, headers: dict[str, str] | None = None
                    ) -> web.StreamResponse:
    """Stream `events`; an exception before the first one propagates (the error middleware
    turns it into a JSON error response). Closing the events on exit aborts the engine work.
    `named`: each event is a dict with a "type", sent as the SSE event name too."""
    async with aclosing(events) as stream:
        iterator = stream.__aiter__()
        try:
            first = await iterator.__anext__()
        except StopAsyncIteration:
            first = None
        resp = web.StreamResponse(headers={**SSE_HEADERS, **(headers or {})})
        await resp.prepare(request)
        try:
            if first is not None:
                await send_within(request, resp, sse_event(first, named))
            async for event in iterator:
                await send_within(request, resp, sse_event(event, named))
        except ConnectionResetError:
            # The client is gone (or was dropped for not reading): leaving `aclosing` aborts
            # the engine work. Returned, not raised: aiohttp would log a raised one as an
            # error with a traceback, and a client leaving mid-stream is no server error.
            return resp
        except Exception as exc:
            api_err = to_api_error(exc)
            if api_err is None:  # a bug: the status line is out, so report it in-band
                logger.exception("internal error while streaming %s", request.path)
                api_err = APIError(500, f"internal server error ({type(exc).__name__})")
            if named:
                await resp.write(sse_event({"type": "error", **api_err.body["error"]}, named))
            else:
                await resp.write(sse_event(api_err.body))
        if not named:
            await resp.write(DONE)
        await resp.write_eof()
        return resp

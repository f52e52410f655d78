"""A request's body under two caps: its size (413) and the time it takes to arrive (408).

Owns: reading and decoding a JSON body; the size cap is the app's client_max_size, the time
cap (against bodies trickled byte by byte) is BODY_TIMEOUT_KEY. Does not know: what the body
holds (radixserve/api parses it), routes, the engine.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web

from radixserve.api.errors import APIError

BODY_TIMEOUT_KEY: web.AppKey[float] = web.AppKey("radixserve_body_timeout", float)


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

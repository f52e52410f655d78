"""Reading a streamed (SSE) OpenAI answer in tests.

Owns: the client side of `data: {json}` / `data: [DONE]` framing, and the tally of what ends
a stream (its [DONE]s and error events). Does not know: what the chunks mean.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

import aiohttp
import orjson


class Tally(Protocol):
    done: int
    errors: list[Any]


async def openai_chunks(resp: aiohttp.ClientResponse, tally: Tally
                        ) -> AsyncIterator[dict[str, Any]]:
    """The chunks of `resp`; `[DONE]` and error events are counted on `tally` instead."""
    async for line in resp.content:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            tally.done += 1
            continue
        event = orjson.loads(data)
        if "error" in event:
            tally.errors.append(event)
            continue
        yield event

"""`GET /kv_events?since=SEQ`: the replica's block events as Server-Sent Events.

Owns: the SSE framing and the replay-then-follow loop. Does not know: where events come from
(the server feeds the `KVEventPublisher` stored under `KV_EVENTS_PUBLISHER_KEY`).

Stream: `data: {EventBatch JSON}\\n\\n` per batch (format in radixserve/kv_events/publisher.py), first
every batch after `since` (or one snapshot batch when the buffer no longer reaches back that
far), then new batches as they are published, and a `: keepalive` comment line whenever
`publisher.keepalive_s` passes without one, so a subscriber can time out a dead connection.
"""

from __future__ import annotations

import orjson
from aiohttp import web

from radixserve.kv_events.publisher import KVEventPublisher, encode_batch

KV_EVENTS_PUBLISHER_KEY: web.AppKey[KVEventPublisher] = web.AppKey(
    "kv_events_publisher", KVEventPublisher
)


def _bad_request(message: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error",
                      "param": "since", "code": None}}
    return web.Response(status=400, body=orjson.dumps(body), content_type="application/json")


async def kv_events_handler(request: web.Request) -> web.StreamResponse:
    publisher = request.app[KV_EVENTS_PUBLISHER_KEY]
    raw = request.query.get("since", "0")
    try:
        since = int(raw)
    except ValueError:
        return _bad_request(f"since must be a non-negative integer, got {raw!r}")
    if since < 0:
        return _bad_request(f"since must be a non-negative integer, got {raw!r}")
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    while not publisher.closed:
        batches = publisher.batches_since(since)
        for batch in batches:
            await resp.write(b"data: " + encode_batch(batch) + b"\n\n")
            since = batch.seq
        if batches:
            continue
        if not await publisher.wait_newer(since, publisher.keepalive_s) and not publisher.closed:
            await resp.write(b": keepalive\n\n")
    return resp


def setup_kv_events(app: web.Application, publisher: KVEventPublisher) -> None:
    """Register `GET /kv_events`, store the publisher, and close it on shutdown.

    Closing on shutdown matters: an open subscription would otherwise hold the server's
    graceful shutdown for its whole timeout.
    """
    app[KV_EVENTS_PUBLISHER_KEY] = publisher

    async def _close(_: web.Application) -> None:
        publisher.close()

    app.on_shutdown.append(_close)
    app.router.add_get("/kv_events", kv_events_handler)

"""Relaying one upstream answer under deadlines, and what a timeout answers.

Owns: Deadlines (the first-byte, whole-request and stall bounds of one request, as loop
times), the OpenAI error answers of the proxy (`error_response`, the 504 of a timeout, the SSE
error event), the header filter, and the two plain relays: a non-streamed answer is read
whole by its deadline and then answered (so a replica that stops half-way gets a 504, never
a truncated 200), an SSE answer is relayed event by event (whole events only, so that an
error event can follow cleanly) with its first byte due by the first-byte deadline and no gap
longer than the stall timeout. A timeout counts one fault against the worker. Does not know:
routing, retries (forward.py), failover of OpenAI streams (resume.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict

from router.workers import Worker, WorkerPool

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
# An SSE event larger than this is no answer of ours: the stream is treated as broken, so a
# replica cannot make the router buffer without bound.
MAX_EVENT_BYTES = 16 << 20
TIMEOUT_CODE = "upstream_timeout"
STREAM_ERROR_CODE = "stream_interrupted"

# RFC 9110 7.6.1 hop-by-hop headers, plus those the client library sets itself.
_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "trailers", "transfer-encoding", "upgrade", "host", "content-length",
})


def error_response(status: int, message: str, err_type: str, code: str | None = None,
                   param: str | None = None) -> web.Response:
    """An OpenAI-style error: {"error": {"message", "type", "param", "code"}}."""
    body = {"error": {"message": message, "type": err_type, "param": param, "code": code}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def timeout_response(message: str) -> web.Response:
    return error_response(504, message, "timeout_error", TIMEOUT_CODE)


def error_event(message: str) -> bytes:
    """The SSE event that ends a stream the router could not complete."""
    body = {"error": {"message": message, "type": "server_error", "param": None,
                      "code": STREAM_ERROR_CODE}}
    return b"data: " + orjson.dumps(body) + b"\n\n"


def passthrough_headers(headers: Mapping[str, str], keep_length: bool) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        lower = name.lower()
        if lower in _HOP_BY_HOP and not (keep_length and lower == "content-length"):
            continue
        out.add(name, value)
    return out


@dataclass(frozen=True)
class Deadlines:
    """One request's bounds, set when it is sent: `first_byte` and `whole` are loop times."""

    first_byte: float  # response headers and the first body byte
    whole: float  # the last byte of a non-streamed answer
    first_byte_s: float
    whole_s: float
    stall_s: float  # the longest gap inside a stream

    @classmethod
    def start(cls, first_byte_s: float, whole_s: float, stall_s: float) -> Deadlines:
        now = asyncio.get_running_loop().time()
        return cls(now + min(first_byte_s, whole_s), now + whole_s, first_byte_s, whole_s,
                   stall_s)


async def read_before(response: aiohttp.ClientResponse, deadline: float | None,
                      stall_s: float) -> bytes:
    """The next chunk, due by `deadline` (loop time) or else within `stall_s`; raises
    TimeoutError."""
    if deadline is not None:
        async with asyncio.timeout_at(deadline):
            return await response.content.readany()
    async with asyncio.timeout(stall_s):
        return await response.content.readany()


async def relay_whole(upstream: aiohttp.ClientResponse, worker: Worker, pool: WorkerPool,
                      deadlines: Deadlines) -> web.Response:
    """A non-streamed answer, read whole by the request's deadline; raises aiohttp.ClientError
    when the replica broke it (nothing relayed yet: the caller may retry)."""
    try:
        async with asyncio.timeout_at(deadlines.whole):
            data = await upstream.read()
    except TimeoutError:
        upstream.close()
        pool.mark_suspect(worker, f"answer not complete within {deadlines.whole_s:g} s")
        return timeout_response(f"the replica did not finish its answer within the request "
                                f"timeout ({deadlines.whole_s:g} s)")
    pool.breaker.success(worker)
    # The bytes go through untouched (the session never decompresses); web.Response sets
    # the length itself.
    return web.Response(status=upstream.status, reason=upstream.reason, body=data,
                        headers=passthrough_headers(upstream.headers, keep_length=False))


async def relay_events(request: web.Request, upstream: aiohttp.ClientResponse, worker: Worker,
                       pool: WorkerPool, deadlines: Deadlines) -> web.StreamResponse:
    """An SSE answer passed through whole event by whole event; a timeout or a broken
    upstream ends it with an error event and [DONE], then a dropped connection (no chunked
    terminator: a client reading bytes sees an incomplete answer)."""
    out = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                             headers=passthrough_headers(upstream.headers, keep_length=False))
    await out.prepare(request)
    buf = bytearray()
    first: float | None = deadlines.first_byte
    failure = None
    while True:
        try:
            chunk = await read_before(upstream, first, deadlines.stall_s)
        except TimeoutError:
            failure = (f"no first byte within {deadlines.first_byte_s:g} s" if first is not None
                       else f"stalled: no byte for {deadlines.stall_s:g} s")
            break
        except aiohttp.ClientError as e:
            failure = f"stream broken: {e!r}"
            break
        first = None
        if not chunk:
            break
        buf += chunk
        end = buf.rfind(b"\n\n")
        if len(buf) - end > MAX_EVENT_BYTES:
            failure = f"an event over {MAX_EVENT_BYTES} bytes"
            break
        if end < 0:
            continue
        try:
            await out.write(bytes(buf[: end + 2]))
        except ConnectionResetError:
            upstream.close()  # the client left; closing upstream makes the replica abort too
            return out
        del buf[: end + 2]
    if failure is None:
        await out.write(bytes(buf))
        await out.write_eof()
        pool.breaker.success(worker)
        return out
    upstream.close()
    pool.mark_suspect(worker, failure)
    log.warning("stream from %s ends with an error event: %s", worker.url, failure)
    await write_error_end(request, out, f"the replica serving this stream failed ({failure})")
    return out


async def write_error_end(request: web.Request, out: web.StreamResponse, message: str) -> None:
    """An SSE error event and [DONE], then the connection dropped."""
    try:
        await out.write(error_event(message) + DONE)
    except ConnectionResetError:
        return
    if request.transport is not None:
        request.transport.close()  # flushes what was written, then no chunked terminator

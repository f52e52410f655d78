"""Mid-stream failover: a stream whose replica fails is continued on another.

Relay an OpenAI SSE stream and, when its replica fails after the first byte, continue it on
another replica so that the client sees one unbroken stream.

Owns: the relay loop of streamed /v1/completions and /v1/chat/completions answers, the
failure kinds seen mid-stream (connection reset, an in-band 5xx error event, a stall past
`stream_stall_timeout_s`, a stream that ends without `[DONE]`), at most `max_resumes`
continuations per request (stream_state.py builds them), and the ending when none is possible
or all failed: an SSE error event (an OpenAI error object, code "stream_interrupted") and
`[DONE]`, after which the connection is closed without the chunked terminator, so that a
client reading bytes rather than events still sees an incomplete answer. Does not know:
routing policies (a `Reopen` callback chooses and connects the next replica), how retries
before the first byte work (proxy.py).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import aiohttp
import orjson
from aiohttp import web

from router.proxy.relay import DONE, MAX_EVENT_BYTES, Deadlines, read_before, write_error_end
from router.proxy.stream_state import NotContinuable, StreamState
from router.routing.kv_index import split_sse
from router.workers import Worker, WorkerPool

log = logging.getLogger(__name__)

_FAULT_TYPES = frozenset({"server_error", "service_unavailable_error", "internal_error"})


class Upstream(NamedTuple):
    worker: Worker
    response: aiohttp.ClientResponse
    deadlines: Deadlines  # its first byte, then no gap over the stall timeout


# Chooses a replica not in the set, sends the continuation body there and returns it once it
# answered 200 (its in_flight counted); None when no replica would.
Reopen = Callable[[bytes, set[str]], Awaitable[Upstream | None]]


class Failure(NamedTuple):
    message: str
    client_gone: bool = False
    final: bool = False  # no resume can follow (no replica left to resume on)


def _is_fault_event(payload: bytes) -> bool | None:
    """An error event: True for the replica's own failure (resume), False for one about the
    request (relay it); None when `payload` is no error event."""
    if not payload.startswith(b'{"error"'):
        return None
    try:
        error = orjson.loads(payload).get("error")
    except orjson.JSONDecodeError:
        return True
    return isinstance(error, dict) and error.get("type") in _FAULT_TYPES


async def _pump(up: Upstream, out: web.StreamResponse,
                handle: Callable[[bytes], bytes | None]) -> Failure | None:
    """Relay events until `[DONE]` (None) or a failure. `handle` turns an upstream payload
    into the payload to write (None: nothing)."""
    buf = bytearray()
    first: float | None = up.deadlines.first_byte
    while True:
        try:
            chunk = await read_before(up.response, first, up.deadlines.stall_s)
        except TimeoutError:
            return Failure(f"no first byte within {up.deadlines.first_byte_s:g} s"
                           if first is not None else
                           f"stalled: no byte for {up.deadlines.stall_s:g} s")
        except aiohttp.ClientError as e:
            return Failure(f"stream broken: {e!r}")
        first = None
        if not chunk:
            return Failure("stream ended without [DONE]")
        buf += chunk
        for payload in split_sse(buf):
            if payload == b"[DONE]":
                return None
            fault = _is_fault_event(payload)
            if fault:
                return Failure(f"error event: {payload[:300].decode(errors='replace')}")
            try:
                data = payload if fault is False else handle(payload)
            except (orjson.JSONDecodeError, AttributeError, TypeError) as e:
                return Failure(f"malformed event: {e!r}")
            if data is None:
                continue
            try:
                await out.write(b"data: " + data + b"\n\n")
            except ConnectionResetError:
                return Failure("client left", client_gone=True)
        if len(buf) > MAX_EVENT_BYTES:
            return Failure(f"an event over {MAX_EVENT_BYTES} bytes")


class Failover:
    """One streamed request's relay; `resumable` is None or why it cannot be resumed."""

    def __init__(self, state: StreamState, pool: WorkerPool, reopen: Reopen,
                 max_resumes: int, resumable: str | None,
                 counts: dict[str, int] | None = None) -> None:
        self.counts = counts if counts is not None else {}  # "resumed", "failed" (metrics)
        self.state = state
        self.pool = pool
        self.reopen = reopen
        self.max_resumes = max_resumes
        self.resumable = resumable
        self.num_resumes = 0
        self._pending: list[bytes] = []  # events the router writes itself before [DONE]

    async def relay(self, request: web.Request, first: Upstream,
                    out: web.StreamResponse) -> web.StreamResponse:
        """Relay `first` (headers already sent as `out`), resuming on failures."""
        st = self.state
        worker = first.worker
        failure = await _pump(first, out, st.on_openai)
        failed = {worker.url}
        while failure is not None and not failure.client_gone and not failure.final:
            log.warning("stream from %s failed mid-way (%s)", worker.url, failure.message)
            self.pool.mark_suspect(worker, failure.message)
            why = self.resumable or st.why_not_continuable()
            if why is NotContinuable.ANSWER_COMPLETE:
                failure = self._finish_without_replica()
                break
            if why is not None or self.num_resumes >= self.max_resumes:
                failure = Failure(f"{failure.message}; not resumed: "
                                  f"{why or f'--max-resumes {self.max_resumes} reached'}")
                break
            self.num_resumes += 1
            self.counts["resumed"] = self.counts.get("resumed", 0) + 1
            failure, worker = await self._continue(out, failed, worker)
            failed.add(worker.url)
        if failure is None and self.num_resumes:
            self._pending += st.closing_events()
        return await self._end(request, out, worker, failure)

    async def _continue(self, out: web.StreamResponse, failed: set[str], worker: Worker
                        ) -> tuple[Failure | None, Worker]:
        """Continue every unfinished choice in turn, each on a replica that has not failed
        this request; the first failure (and where), or None when all of them ended."""
        st = self.state
        for index in st.unfinished():
            if st.remaining(index) == 0:  # all its tokens were sent: only the finish is lost
                st.choice(index).finish_reason = "length"
                await out.write(b"data: " + orjson.dumps(st.chunk("", [], "length", index))
                                + b"\n\n")
                continue
            nxt = await self.reopen(st.resume_body(index), set(failed))
            if nxt is None:
                return Failure("no replica to resume on", final=True), worker
            worker = nxt.worker
            try:
                failure = await _pump(nxt, out, st.on_native)
            finally:
                worker.in_flight -= 1
                nxt.response.release()
            if failure is not None:
                return failure, worker
        return None, worker

    def _finish_without_replica(self) -> Failure | None:
        """The answer was complete: only the usage and [DONE] are missing, and the router
        knows them."""
        self._pending += self.state.closing_events()
        return None

    async def _end(self, request: web.Request, out: web.StreamResponse, worker: Worker,
                   failure: Failure | None) -> web.StreamResponse:
        try:
            for event in self._pending:
                await out.write(b"data: " + event + b"\n\n")
            if failure is None:
                await out.write(DONE)
                await out.write_eof()
                self.pool.breaker.success(worker)
                return out
            if failure.client_gone:
                return out
        except ConnectionResetError:
            return out
        log.warning("stream ends with an error event: %s", failure.message)
        self.counts["failed"] = self.counts.get("failed", 0) + 1
        await write_error_end(request, out, f"the replica serving this stream failed "
                                            f"({failure.message})")
        return out

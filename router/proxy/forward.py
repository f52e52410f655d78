"""Forwarding one request: choose a worker, send, stream the answer back as it comes.

Owns: the retry rule and the passthrough. A request that fails before any response byte is
relayed is retried on another worker, at most `max_retries` times, sleeping 50 ms x 1.5^n
between tries: a connection failure (refused, reset, timed out connecting) or a 5xx answer
(not ready, draining, engine dead or failed) marks the worker suspect; a 429 for a full
queue (`queue_full`, or no code) just moves on. A 429 for the caller's own per-key limit
(`rate_limit_exceeded`, `concurrency_limit_exceeded`) is relayed as it stands: retrying it on
another replica would multiply the key's limits by the number of replicas. When no other
worker is left, the last retryable answer is passed through as it stands. Once the status line of a 2xx-4xx answer has been relayed,
bytes go to the client chunk by chunk and are never retried; an upstream failure reaches the
client as it stands: the connection is dropped, so it sees a truncated response, never a
short "complete" one. Except streamed /v1/completions and /v1/chat/completions answers: those
are relayed event by event by resume.py, which continues them on another replica when theirs
fails mid-way, or ends them with an SSE error event and [DONE]. In-flight counts are decremented in `finally`. Does not know: policies
or indexes (routing.py), the route table (app.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, NamedTuple

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict

from router.breaker import is_fault
from router.core import Router
from router.fleet.canary import SESSION_HEADER
from router.proxy.resume import Failover, Upstream
from router.proxy.stream_state import StreamState, upstream_body, why_not_resumable
from router.routing.route_key import RequestKind, RouteKey
from router.workers import Worker, WorkerPool

log = logging.getLogger(__name__)

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


def no_worker_response(detail: str = "") -> web.Response:
    msg = "no healthy worker is available" + (f" ({detail})" if detail else "")
    return error_response(503, msg, "service_unavailable_error", "no_worker_available")


def _passthrough_headers(headers: Mapping[str, str], keep_length: bool) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        lower = name.lower()
        if lower in _HOP_BY_HOP and not (keep_length and lower == "content-length"):
            continue
        out.add(name, value)
    return out


class Attempt(NamedTuple):
    response: web.StreamResponse | None  # relayed to the client: done
    retry_error: str | None  # nothing relayed yet: try another worker
    fallback: web.Response | None  # the answer to return as it stands if no worker is left
    suspect: bool = True  # the worker looks broken (not just busy)


# 429 codes (radixserve's, as OpenAI's) that refuse the caller, not the replica.
PER_KEY_LIMIT_CODES = frozenset({"rate_limit_exceeded", "concurrency_limit_exceeded"})


def retryable(status: int) -> bool:
    """Answers worth another replica: it failed (5xx) or is over its limits (429)."""
    return status >= 500 or status == 429


def per_key_limit(status: int, body: bytes) -> bool:
    """A 429 that the caller's own limit caused (the same key is limited everywhere)."""
    if status != 429:
        return False
    try:
        error = orjson.loads(body).get("error")
        return isinstance(error, dict) and error.get("code") in PER_KEY_LIMIT_CODES
    except (orjson.JSONDecodeError, AttributeError):
        return False


async def _relay(request: web.Request, upstream: aiohttp.ClientResponse,
                 worker: Worker, pool: WorkerPool) -> web.StreamResponse:
    # Content-Length is kept (so a plain JSON answer stays unchunked) only when the bytes go
    # through untouched: the session never decompresses.
    out = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                             headers=_passthrough_headers(upstream.headers, keep_length=True))
    await out.prepare(request)
    while True:
        try:
            chunk = await upstream.content.readany()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            pool.mark_suspect(worker, f"stream broken: {e!r}")
            log.warning("stream from %s broke mid-way: %r", worker.url, e)
            if request.transport is not None:
                request.transport.close()
            return out
        if not chunk:
            break
        try:
            await out.write(chunk)
        except ConnectionResetError:
            # The client left; closing upstream (in _attempt) makes the replica abort too.
            upstream.close()
            return out
    await out.write_eof()
    pool.breaker.success(worker)
    return out


async def _relay_stream(request: web.Request, upstream: aiohttp.ClientResponse,
                        worker: Worker, failover: Failover) -> web.StreamResponse:
    out = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                             headers=_passthrough_headers(upstream.headers, keep_length=False))
    await out.prepare(request)
    return await failover.relay(request, Upstream(worker, upstream), out)


async def _attempt(request: web.Request, session: aiohttp.ClientSession, worker: Worker,
                   body: bytes, connect_timeout_s: float, pool: WorkerPool,
                   failover: Failover | None = None) -> Attempt:
    url = f"{worker.url}{request.rel_url}"
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
    try:
        upstream = await session.request(
            request.method, url, data=body if body else None, timeout=timeout,
            headers=_passthrough_headers(request.headers, keep_length=False),
        )
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        return Attempt(None, f"{type(e).__name__}: {e}", None)
    try:
        if retryable(upstream.status):
            data = await upstream.read()
            fallback = web.Response(status=upstream.status, body=data,
                                    headers=_passthrough_headers(upstream.headers,
                                                                 keep_length=False))
            if per_key_limit(upstream.status, data):
                return Attempt(fallback, None, None)  # relayed: no replica would differ
            return Attempt(None, f"answered {upstream.status}", fallback,
                           suspect=is_fault(upstream.status, data))
        if failover is not None and upstream.status == 200 and \
                upstream.content_type == "text/event-stream":
            return Attempt(await _relay_stream(request, upstream, worker, failover), None, None)
        return Attempt(await _relay(request, upstream, worker, pool), None, None)
    except BaseException:
        upstream.close()  # not fully read: this connection cannot go back to the pool
        raise
    finally:
        upstream.release()


async def proxy(request: web.Request, router: Router, session: aiohttp.ClientSession,
                kind: RequestKind | None) -> web.StreamResponse:
    """Route and forward `request`; retry elsewhere while nothing has been relayed. With a
    keys file, the key's fleet-wide limits (limits.py) apply first."""
    body = await request.read()
    parsed = None
    if kind is not None and body:
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            parsed = None  # routed anyway; the replica answers the 400
    if router.limits is None or kind is None:
        return await _proxy(request, router, session, kind, body, parsed)
    with router.limits.admit(request.headers.get("Authorization"), parsed) as refusal:
        if refusal is not None:
            return refusal
        return await _proxy(request, router, session, kind, body, parsed)


async def _proxy(request: web.Request, router: Router, session: aiohttp.ClientSession,
                 kind: RequestKind | None, body: bytes, parsed: Any) -> web.StreamResponse:
    cfg = router.cfg
    key = await router.route_key(kind or RequestKind.GENERATE, parsed,
                                 request.headers.get("Authorization"),
                                 request.headers.get(SESSION_HEADER))
    failover = None
    if kind in (RequestKind.COMPLETIONS, RequestKind.CHAT) and isinstance(parsed, dict) \
            and parsed.get("stream") is True:
        failover, body = _failover(request, router, session, key, kind, parsed, body)
    tried: set[str] = set()
    fallback: web.Response | None = None
    for attempt in range(cfg.max_retries + 1):
        if attempt:
            await asyncio.sleep(cfg.retry_backoff_s * cfg.retry_backoff_factor ** (attempt - 1))
        decision = router.choose(key, frozenset(tried))
        if decision is None:
            break
        router.record(key, decision)
        worker = decision.worker
        tried.add(worker.url)
        worker.in_flight += 1
        try:
            result = await _attempt(request, session, worker, body, cfg.connect_timeout_s,
                                    router.pool, failover)
        finally:
            worker.in_flight -= 1
        if result.response is not None:
            return result.response
        assert result.retry_error is not None
        log.info("%s failed before any byte (%s); retrying elsewhere", worker.url,
                 result.retry_error)
        if result.suspect:
            router.pool.mark_suspect(worker, result.retry_error)
        fallback = result.fallback or fallback
    return fallback or no_worker_response(f"tried {len(tried)}" if tried else "")


def _failover(request: web.Request, router: Router, session: aiohttp.ClientSession,
              key: RouteKey, kind: RequestKind, parsed: dict[str, object], body: bytes
              ) -> tuple[Failover, bytes]:
    """The relay of a streamed answer, and the body to send (with return_token_ids when the
    stream can be resumed exactly: resume.py, stream_state.py)."""
    cfg = router.cfg
    why = why_not_resumable(kind, parsed) if cfg.max_resumes else "--max-resumes is 0"
    state = StreamState(kind, parsed, strip_ids=parsed.get("return_token_ids") is not True)
    headers = _passthrough_headers(request.headers, keep_length=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout_s)

    async def reopen(resume: bytes, exclude: set[str]) -> Upstream | None:
        for _ in range(cfg.max_retries + 1):
            decision = router.choose(key, frozenset(exclude))
            if decision is None:
                return None
            router.record(key, decision)
            worker = decision.worker
            exclude.add(worker.url)
            worker.in_flight += 1
            try:
                resp = await session.post(f"{worker.url}/generate", data=resume,
                                          headers=headers, timeout=timeout)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                worker.in_flight -= 1
                router.pool.mark_suspect(worker, f"{type(e).__name__}: {e}")
                continue
            if resp.status == 200:
                return Upstream(worker, resp)
            data = await resp.read()
            resp.release()
            worker.in_flight -= 1
            log.warning("resume on %s answered %d: %s", worker.url, resp.status, data[:200])
            if is_fault(resp.status, data):
                router.pool.mark_suspect(worker, f"resume answered {resp.status}")
        return None

    failover = Failover(state, router.pool, reopen, cfg.max_resumes,
                        cfg.stream_stall_timeout_s, why, router.stream_counts)
    return failover, (body if why is not None else upstream_body(parsed))

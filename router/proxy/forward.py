"""Forwarding one request: choose a worker, send, stream the answer back as it comes.

Owns: the retry rule and the passthrough. A request that fails before any response byte is
relayed is retried on another worker, at most `max_retries` times, sleeping 50 ms x 1.5^n
between tries: a connection failure (refused, reset, timed out connecting) or a 5xx answer
(not ready, draining, engine dead or failed) marks the worker suspect; a 429 for a full
queue (`queue_full`, or no code) just moves on. A 429 for the caller's own per-key limit
(`rate_limit_exceeded`, `concurrency_limit_exceeded`) is relayed as it stands: retrying it on
another replica would multiply the key's limits by the number of replicas. When no other
worker is left, the last retryable answer is passed through as it stands.
Every wait is bounded (relay.py): no response headers by the first-byte timeout is a 504
(not retried: the request may be running; the client's wait stays bounded); a non-streamed
answer is read whole within the request timeout, then answered (504 past it); an SSE answer is
relayed event by event and ends with an SSE error event and [DONE] when it stalls or breaks.
Streamed /v1/completions and /v1/chat/completions answers are relayed by resume.py, which
continues them on another replica when theirs fails mid-way. In-flight counts are
decremented in `finally`. Does not know: policies or indexes (routing.py), the route table
(app.py).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, NamedTuple

import aiohttp
import orjson
from aiohttp import web

from router.breaker import is_fault
from router.config import RouterConfig
from router.core import Router
from router.fleet.canary import SESSION_HEADER
from router.proxy.relay import (
    Deadlines,
    error_response,
    passthrough_headers,
    relay_events,
    relay_whole,
    timeout_response,
)
from router.proxy.resume import Failover, Upstream
from router.proxy.stream_state import StreamState, upstream_body, why_not_resumable
from router.routing.route_key import RequestKind, RouteKey
from router.workers import Worker, WorkerPool

log = logging.getLogger(__name__)

def no_worker_response(detail: str = "") -> web.Response:
    msg = "no healthy worker is available" + (f" ({detail})" if detail else "")
    return error_response(503, msg, "service_unavailable_error", "no_worker_available")


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


async def _attempt(request: web.Request, session: aiohttp.ClientSession, worker: Worker,
                   body: bytes, cfg: RouterConfig, pool: WorkerPool,
                   failover: Failover | None = None) -> Attempt:
    url = f"{worker.url}{request.rel_url}"
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout_s)
    deadlines = Deadlines.start(cfg.first_byte_timeout_s, cfg.request_timeout_s,
                                cfg.stream_stall_timeout_s)
    try:
        async with asyncio.timeout_at(deadlines.first_byte):
            upstream = await session.request(
                request.method, url, data=body if body else None, timeout=timeout,
                headers=passthrough_headers(request.headers, keep_length=False),
            )
    except TimeoutError:
        # Sent, maybe running: not retried (the client's wait is bounded by this timeout).
        pool.mark_suspect(worker, f"no response headers within {cfg.first_byte_timeout_s:g} s")
        return Attempt(timeout_response(f"the replica did not answer within the first-byte "
                                        f"timeout ({deadlines.first_byte_s:g} s)"), None, None)
    except (aiohttp.ClientError, OSError) as e:
        return Attempt(None, f"{type(e).__name__}: {e}", None)
    try:
        if retryable(upstream.status):
            async with asyncio.timeout_at(deadlines.whole):
                data = await upstream.read()
            fallback = web.Response(status=upstream.status, body=data,
                                    headers=passthrough_headers(upstream.headers,
                                                                keep_length=False))
            if per_key_limit(upstream.status, data):
                return Attempt(fallback, None, None)  # relayed: no replica would differ
            return Attempt(None, f"answered {upstream.status}", fallback,
                           suspect=is_fault(upstream.status, data))
        if upstream.content_type != "text/event-stream":
            return Attempt(await relay_whole(upstream, worker, pool, deadlines), None, None)
        if failover is not None and upstream.status == 200:
            out = web.StreamResponse(status=upstream.status, reason=upstream.reason,
                                     headers=passthrough_headers(upstream.headers,
                                                                 keep_length=False))
            await out.prepare(request)
            relayed = await failover.relay(request, Upstream(worker, upstream, deadlines), out)
            return Attempt(relayed, None, None)
        return Attempt(await relay_events(request, upstream, worker, pool, deadlines),
                       None, None)
    except (aiohttp.ClientError, TimeoutError) as e:  # nothing relayed yet: try elsewhere
        upstream.close()
        return Attempt(None, f"answer broken: {e!r}", None)
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
    async with router.limits.admit(request.headers.get("Authorization"), parsed) as refusal:
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
            result = await _attempt(request, session, worker, body, cfg, router.pool,
                                    failover)
        finally:
            worker.in_flight -= 1
        if result.response is not None:
            router.responses.note_answer(result.response.headers, worker.url)
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
    headers = passthrough_headers(request.headers, keep_length=False)
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
            deadlines = Deadlines.start(cfg.first_byte_timeout_s, cfg.request_timeout_s,
                                        cfg.stream_stall_timeout_s)
            try:
                async with asyncio.timeout_at(deadlines.first_byte):
                    resp = await session.post(f"{worker.url}/generate", data=resume,
                                              headers=headers, timeout=timeout)
                    if resp.status != 200:
                        data = await resp.read()
                        resp.release()
            except (aiohttp.ClientError, TimeoutError, OSError) as e:
                worker.in_flight -= 1
                router.pool.mark_suspect(worker, f"resume: {type(e).__name__}: {e}")
                continue
            if resp.status == 200:
                return Upstream(worker, resp, deadlines)
            worker.in_flight -= 1
            log.warning("resume on %s answered %d: %s", worker.url, resp.status, data[:200])
            if is_fault(resp.status, data):
                router.pool.mark_suspect(worker, f"resume answered {resp.status}")
        return None

    failover = Failover(state, router.pool, reopen, cfg.max_resumes, why,
                        router.stream_counts)
    return failover, (body if why is not None else upstream_body(parsed))

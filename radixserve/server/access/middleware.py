"""The access middleware: Bearer auth, and OpenAI's x-ratelimit-* headers.

Bearer auth on every route but the public ones, and the x-ratelimit-* headers on every
response to a rate-limited key.

Owns: which paths are public (/health, /metrics, /version) and where a request's Caller is
set (CALLER_FIELD). Does not know: how a key is verified (auth.py), the buckets
(radixserve/api/ratelimit.py), routes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from radixserve.server.app_state import CALLER_FIELD, STATE_KEY

PUBLIC_PATHS = frozenset({"/health", "/metrics", "/version"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path not in PUBLIC_PATHS:
        request[CALLER_FIELD] = request.app[STATE_KEY].auth.authenticate(
            request.headers.get("Authorization"))
    return await handler(request)


async def rate_limit_headers(request: web.Request, response: web.StreamResponse) -> None:
    """OpenAI's x-ratelimit-* headers on every response to a key that has rpm/tpm limits."""
    caller = request.get(CALLER_FIELD)
    if caller is None or (caller.limits.rpm is None and caller.limits.tpm is None):
        return
    state = request.app[STATE_KEY]
    response.headers.update(state.admission.rate.headers(caller.name, caller.limits))

"""The access middleware: Bearer auth, and OpenAI's x-ratelimit-* headers.

Bearer auth on every route but the public ones, and the x-ratelimit-* headers on every
response to a rate-limited key.

Owns: which paths are public (/health, /metrics, /version), where a request's Caller is set
(CALLER_FIELD), and the app keys it reads (AUTH_KEY, ADMISSION_KEY; create_app sets them).
Does not know: how a key is verified (auth.py), the buckets (radixserve/api/ratelimit.py),
routes, the server state (it imports nothing of the server outside access/).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from radixserve.server.access.auth import ApiKeys, Caller
from radixserve.server.access.limits import Admission

PUBLIC_PATHS = frozenset({"/health", "/metrics", "/version"})
AUTH_KEY: web.AppKey[ApiKeys] = web.AppKey("radixserve_auth", ApiKeys)
ADMISSION_KEY: web.AppKey[Admission] = web.AppKey("radixserve_admission", Admission)
# The caller, set on each request by the auth middleware.
CALLER_FIELD: web.RequestKey[Caller] = web.RequestKey("radixserve_caller", Caller)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path not in PUBLIC_PATHS:
        request[CALLER_FIELD] = request.app[AUTH_KEY].authenticate(
            request.headers.get("Authorization"))
    return await handler(request)


async def rate_limit_headers(request: web.Request, response: web.StreamResponse) -> None:
    """OpenAI's x-ratelimit-* headers on every response to a key that has rpm/tpm limits."""
    caller = request.get(CALLER_FIELD)
    if caller is None or (caller.limits.rpm is None and caller.limits.tpm is None):
        return
    rate = request.app[ADMISSION_KEY].rate
    response.headers.update(rate.headers(caller.name, caller.limits))

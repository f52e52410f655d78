"""The router's aiohttp application: route table, lifecycle, and the small handlers.

Owns: `create_app(cfg)`, the ONE shared ClientSession and the health task (cleanup_ctx), the
admin guard, /health, /metrics, /workers, /flush_cache. Does not know: how a worker is chosen
(routing.py) or how bytes are relayed (proxy.py).

Admin routes need `Authorization: Bearer <admin key>`. A router started without an admin key
refuses the mutating ones (POST/DELETE /workers, POST /flush_cache) with 403 and serves the
read-only GET /workers to anyone. /flush_cache reaches every replica with the replicas' key
(`replica_api_key`), never with the admin key. Everything else passes the client's
Authorization header through to the replica untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

from router.config import ConfigError, RouterConfig, normalize_worker_url
from router.core import Router
from router.discovery import DiscoveryConfig, attach_discovery
from router.fleet.canary import SplitUpdateError
from router.fleet.response_owners import stored_response
from router.metrics import make_registry
from router.proxy.forward import no_worker_response, proxy
from router.proxy.relay import error_response
from router.routing.route_key import PromptEncoder, RequestKind, load_prompt_encoder
from router.workers import UnknownWorkerError, WorkerExistsError, health_loop

ROUTER_KEY = web.AppKey("router", Router)
REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)
MAX_BODY_BYTES = 64 << 20  # long-context prompts; replicas enforce their own limits (413)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


def _admin_denied(request: web.Request) -> web.Response | None:
    """None when the request may use admin routes; else the 401 (or 403) to answer."""
    key = request.app[ROUTER_KEY].cfg.admin_key
    if key is None:
        if request.method == "GET":
            return None
        return error_response(403, "admin routes are off: start the router with --admin-key",
                              "permission_error", "admin_disabled")
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    given = hashlib.sha256(token.strip().encode()).digest()
    expected = hashlib.sha256(key.encode()).digest()
    if scheme.lower() == "bearer" and hmac.compare_digest(given, expected):
        return None
    return error_response(401, "admin routes need 'Authorization: Bearer <admin key>'",
                          "authentication_error", "invalid_admin_key")


def _admin(handler: Handler) -> Handler:
    async def guarded(request: web.Request) -> web.StreamResponse:
        return _admin_denied(request) or await handler(request)

    return guarded


def _proxied(kind: RequestKind | None) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        router = request.app[ROUTER_KEY]
        return await proxy(request, router, router.session, kind)

    return handler


async def _stored_response(request: web.Request) -> web.Response:
    """GET / DELETE a stored response: on the replica that holds it (response_owners.py)."""
    router = request.app[ROUTER_KEY]
    urls = [w.url for w in router.pool.routable()]
    if not urls:
        return no_worker_response()
    return await stored_response(request, router.session, router.responses, urls)


async def health(request: web.Request) -> web.Response:
    pool = request.app[ROUTER_KEY].pool
    if not pool.any_healthy():
        return no_worker_response()
    return _json({"status": "ok", "healthy_workers": sum(w.healthy for w in pool.all())})


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[REGISTRY_KEY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def list_workers(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    rows = []
    for w in router.pool.all():
        row = w.to_json()
        row["index_entries"] = router.index.num_entries(w.url)
        if router.precise is not None:
            row["kv_events_live"] = router.precise.is_live(w.url)
        row["group"] = router.split.group_of(w.url)
        rows.append(row)
    return _json({"workers": rows, "groups": _groups(request)})


def _groups(request: web.Request) -> dict[str, dict[str, object]]:
    router = request.app[ROUTER_KEY]
    return {v.name: {"weight": round(v.share, 6), "workers": v.workers, "routed": v.routed,
                     "errors": v.errors, "fallbacks": v.fallbacks}
            for v in router.split.views(router.pool.all())}


async def _body(request: web.Request) -> dict[str, object]:
    """The JSON object body ({} if none); readable again after _url_from (read() caches)."""
    if not request.body_exists:
        return {}
    with contextlib.suppress(orjson.JSONDecodeError):
        body = orjson.loads(await request.read())
        if isinstance(body, dict):
            return body
    return {}


async def update_workers(request: web.Request) -> web.Response:
    """PUT /workers {"url"?, "group"?, "weight"?}: move a worker and/or set a group's share."""
    router = request.app[ROUTER_KEY]
    body = await _body(request)
    worker = None
    raw = request.query.get("url", body.get("url"))
    if raw is not None:
        try:
            url = normalize_worker_url(raw if isinstance(raw, str) else "")
        except ConfigError as e:
            return error_response(400, str(e), "invalid_request_error", param="url")
        worker = router.pool.get(url)
        if worker is None:
            return error_response(404, f"worker {url} is not registered",
                                  "invalid_request_error", param="url")
    group = body.get("group")
    if group is not None and not isinstance(group, str):
        return error_response(400, "group must be a string", "invalid_request_error",
                              param="group")
    try:
        router.split.update(worker, group, body.get("weight"))
    except SplitUpdateError as e:
        return error_response(400, str(e), "invalid_request_error", param=e.param)
    return _json({"groups": _groups(request)})


async def _url_from(request: web.Request) -> str | web.Response:
    url = request.query.get("url")
    if url is None and request.can_read_body:
        with contextlib.suppress(orjson.JSONDecodeError):
            body = orjson.loads(await request.read())
            url = body.get("url") if isinstance(body, dict) else None
    if not isinstance(url, str):
        return error_response(400, 'give the worker as {"url": "http://host:port"} or ?url=',
                              "invalid_request_error", param="url")
    try:
        return normalize_worker_url(url)
    except ConfigError as e:
        return error_response(400, str(e), "invalid_request_error", param="url")


async def add_worker(request: web.Request) -> web.Response:
    url = await _url_from(request)
    if isinstance(url, web.Response):
        return url
    router = request.app[ROUTER_KEY]
    body = await _body(request)
    group, weight = body.get("group"), body.get("weight")
    if group is not None and not isinstance(group, str):
        return error_response(400, "group must be a string", "invalid_request_error",
                              param="group")
    try:
        worker = router.add_worker(url)
    except WorkerExistsError:
        return error_response(409, f"worker {url} is already registered",
                              "invalid_request_error", param="url")
    if group is not None or weight is not None:
        try:
            router.split.update(worker, group, weight)
        except SplitUpdateError as e:
            await router.remove_worker(url)  # all or nothing
            return error_response(400, str(e), "invalid_request_error", param=e.param)
    return _json({**worker.to_json(), "group": router.split.group_of(url)}, status=201)


async def remove_worker(request: web.Request) -> web.Response:
    url = await _url_from(request)
    if isinstance(url, web.Response):
        return url
    try:
        worker = await request.app[ROUTER_KEY].remove_worker(url)
    except UnknownWorkerError:
        return error_response(404, f"worker {url} is not registered", "invalid_request_error",
                              param="url")
    return _json(worker.to_json())


async def flush_cache(request: web.Request) -> web.Response:
    """POST /flush_cache to every worker; 200 if all answered 200, else 502 with details."""
    router = request.app[ROUTER_KEY]
    key = router.cfg.replica_api_key
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    timeout = aiohttp.ClientTimeout(total=router.cfg.health_timeout_s * 5)

    async def one(url: str) -> int | str:
        try:
            async with router.session.post(f"{url}/flush_cache", headers=headers,
                                           timeout=timeout) as resp:
                await resp.read()
                return resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return f"{type(e).__name__}: {e}"

    urls = [w.url for w in router.pool.all()]
    results = dict(zip(urls, await asyncio.gather(*(one(u) for u in urls)), strict=True))
    ok = bool(urls) and all(r == 200 for r in results.values())
    return _json({"success": ok, "workers": results}, status=200 if ok else 502)


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    router = app[ROUTER_KEY]
    cfg = router.cfg
    # One session for everything; limit=0 because the router must never queue requests
    # behind its own connection pool; bytes pass through untouched (no decompression).
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                    auto_decompress=False)
    router.start(session)
    undo_sighup = router.limits.install_sighup() if router.limits is not None else None
    health = asyncio.create_task(
        health_loop(session, router.pool, cfg.health_interval_s, cfg.health_timeout_s),
        name="router health",
    )
    try:
        yield
    finally:
        health.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await health
        await router.stop()
        await session.close()
        if undo_sighup is not None:
            undo_sighup()


def create_app(cfg: RouterConfig, encoder: PromptEncoder | None = None,
               discovery: DiscoveryConfig | None = None) -> web.Application:
    """The router app. Precise mode tokenizes with `encoder`, else with `cfg.tokenizer`;
    `discovery`: workers found at run time too (router/discovery)."""
    if encoder is None and cfg.tokenizer is not None:
        encoder = load_prompt_encoder(cfg.tokenizer)
    router = Router(cfg, encoder)
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[ROUTER_KEY] = router
    app[REGISTRY_KEY] = make_registry(router)
    app.cleanup_ctx.append(_lifecycle)
    if discovery is not None:
        attach_discovery(app, router, discovery)
    app.router.add_post("/v1/completions", _proxied(RequestKind.COMPLETIONS))
    app.router.add_post("/v1/chat/completions", _proxied(RequestKind.CHAT))
    app.router.add_post("/v1/responses", _proxied(RequestKind.RESPONSES))
    app.router.add_post("/generate", _proxied(RequestKind.GENERATE))
    app.router.add_get("/v1/responses/{response_id}", _stored_response)
    app.router.add_delete("/v1/responses/{response_id}", _stored_response)
    app.router.add_get("/v1/responses/{response_id}/input_items", _stored_response)
    app.router.add_get("/v1/models", _proxied(None))
    app.router.add_post("/tokenize", _proxied(None))  # any replica: they share the tokenizer
    app.router.add_post("/detokenize", _proxied(None))
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/workers", _admin(list_workers))
    app.router.add_post("/workers", _admin(add_worker))
    app.router.add_delete("/workers", _admin(remove_worker))
    app.router.add_put("/workers", _admin(update_workers))
    app.router.add_post("/flush_cache", _admin(flush_cache))
    return app

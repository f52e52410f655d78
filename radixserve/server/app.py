"""The aiohttp application: create_app(cfg, client).

Owns: the error middleware (errors -> OpenAI JSON, never a stack trace), the middleware order
(send bound, errors, auth: access/middleware.py), route registration, the engine's life
inside the app (cleanup_ctx: start in the background so /health answers 503 while loading;
stop on exit), and the /kv_events wiring.
Does not know: request formats (routes/), the engine's internals, the process-level serve
loop (serve.py: run_server).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from radixserve.config import ServerConfig
from radixserve.config.kv_events_config import HashAlgo
from radixserve.ipc.client import EngineClient
from radixserve.kv_events.publisher import KVEventPublisher
from radixserve.kv_events.zmq_stream import zmq_lifecycle
from radixserve.server.access.body import BODY_TIMEOUT_KEY
from radixserve.server.access.middleware import (
    ADMISSION_KEY,
    AUTH_KEY,
    auth_middleware,
    rate_limit_headers,
)
from radixserve.server.access.send import SEND_TIMEOUT_KEY, bounded_send
from radixserve.server.app_state import STATE_KEY, ServerState
from radixserve.server.error_responses import APIError, error_response, to_api_error
from radixserve.server.metrics_compat import VllmCompatCollector
from radixserve.server.routes.cache import add_cache_routes
from radixserve.server.routes.chat import add_chat_routes
from radixserve.server.routes.kv_events import setup_kv_events
from radixserve.server.routes.lora import add_lora_routes
from radixserve.server.routes.native import add_native_routes
from radixserve.server.routes.openai import add_openai_routes
from radixserve.server.routes.responses import add_responses_routes
from radixserve.server.routes.tokenize import add_tokenize_routes
from radixserve.server.stats_log import StatsLogger, log_capacity

logger = logging.getLogger("radixserve.server")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
LOAD_TASK_KEY: web.AppKey[asyncio.Task[None]] = web.AppKey("radixserve_load_task", asyncio.Task)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes `{"error": {...}}`; a bug is logged and answered with a 500."""
    try:
        return await handler(request)
    except web.HTTPException as exc:  # aiohttp's own: unknown route, wrong method, ...
        if exc.status < 400:
            raise
        return error_response(APIError(exc.status, exc.reason))
    except (asyncio.CancelledError, ConnectionResetError):
        raise  # the client went away: nobody to answer
    except Exception as exc:
        api_err = to_api_error(exc)
        if api_err is None:
            logger.exception("internal error on %s %s", request.method, request.path)
            api_err = APIError(500, f"internal server error ({type(exc).__name__})")
        return error_response(api_err)


async def _load(state: ServerState) -> None:
    await state.load()
    log_capacity(state.client.info)
    logger.info("model %r ready (max_model_len %d)", state.model_name, state.max_model_len)


async def _engine_ctx(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE_KEY]
    load_task = asyncio.create_task(_load(state))
    app[LOAD_TASK_KEY] = load_task
    stats_task = asyncio.create_task(
        StatsLogger(lambda: state.client.stats, state.cfg.log_stats_interval).run())
    yield
    for task in (load_task, stats_task):
        task.cancel()
    await asyncio.gather(load_task, stats_task, return_exceptions=True)
    engine = state.cfg.engine
    # The engine's clean exit may wait for its tier writes (--kv-offload-shutdown-timeout).
    await state.client.shutdown(10.0 + (engine.kv_offload_shutdown_timeout
                                        if engine.kv_tiers_enabled else 0.0))


async def _kv_events_disabled(request: web.Request) -> web.Response:
    raise APIError(404, "KV events are off; start the server with --enable-kv-events",
                   code="kv_events_disabled")


def create_app(cfg: ServerConfig, client: EngineClient, *,
               max_body_bytes: int | None = None) -> web.Application:
    """The app for one engine. The client is started by the app (cleanup_ctx) and stopped
    with it; until it is ready, /health answers 503 and generation routes 503.
    Raises ConfigError when the API keys file is invalid."""
    app = web.Application(client_max_size=max_body_bytes or cfg.max_body_bytes,
                          middlewares=[bounded_send, error_middleware, auth_middleware])
    state = ServerState(cfg, client)
    app[STATE_KEY] = state
    app[AUTH_KEY] = state.auth
    app[ADMISSION_KEY] = state.admission
    app[BODY_TIMEOUT_KEY] = cfg.body_timeout
    app[SEND_TIMEOUT_KEY] = cfg.send_timeout
    app.on_response_prepare.append(rate_limit_headers)
    add_openai_routes(app)
    add_chat_routes(app)
    add_responses_routes(app)
    add_cache_routes(app)
    add_native_routes(app)
    add_tokenize_routes(app)
    lora = cfg.engine.lora
    add_lora_routes(app, lora is not None and lora.allow_runtime_updates)
    if cfg.engine.enable_kv_events:
        publisher = KVEventPublisher(hash_algo=HashAlgo(cfg.prefix_caching_hash_algo))
        client.cache_event_sinks.append(publisher.publish)
        setup_kv_events(app, publisher)
        if cfg.kv_events_config is not None and cfg.kv_events_config.publishes:
            app.cleanup_ctx.append(zmq_lifecycle(publisher, cfg.kv_events_config,
                                                 lambda: client.info.get("device")))
    else:
        app.router.add_get("/kv_events", _kv_events_disabled)
    if cfg.metrics_compat == "vllm":
        state.metrics.registry.register(
            VllmCompatCollector(lambda: client.stats, lambda: state.model_name))
    app.cleanup_ctx.append(_engine_ctx)
    return app



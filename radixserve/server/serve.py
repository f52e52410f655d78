"""The server process: bind, supervise the engine, reload keys, drain on SIGTERM, exit code.

Owns: the process-level loop around create_app: signals (SIGTERM/SIGINT drain then exit 0,
SIGHUP reloads the API keys file), the engine supervisor (an engine that dies is restarted
with exponential backoff under --restart-engine, otherwise the server exits 1 so systemd or
Kubernetes restarts it), and logging set-up with redaction. Does not know: routes, request
formats, the engine's internals.

Drain: the server keeps listening (so probes see 503, not a refused connection), answers 503
to new requests and to /health, waits up to --shutdown-timeout for requests in flight, then
stops the engine (requests still running then get an error) and exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import signal

from aiohttp import web

from radixserve.config import ConfigError, ServerConfig
from radixserve.ipc.client import EngineClient, EngineUnavailableError
from radixserve.ipc.transport import EngineFactory
from radixserve.server.access.connections import GuardedRunner
from radixserve.server.app import LOAD_TASK_KEY, create_app
from radixserve.server.app_state import STATE_KEY, ServerState

logger = logging.getLogger("radixserve.server")

RESTART_BACKOFF_S = 1.0  # first restart after this long, doubling per quick death
RESTART_BACKOFF_MAX_S = 30.0
STABLE_RUN_S = 60.0  # an engine that lived this long resets the backoff
_SECRET_RE = re.compile(r"(?i)(bearer\s+|api[_-]?key[\"'=: ]+)[^\s\"',;]+")


class RedactFilter(logging.Filter):
    """Defence in depth: whatever a log line says, a Bearer token or api_key value in it is
    replaced by ***. (Prompts and completions are never logged in the first place.)"""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        scrubbed = _SECRET_RE.sub(r"\1***", text)
        if scrubbed != text:
            record.msg, record.args = scrubbed, None
        return True


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(RedactFilter())


def reload_keys(state: ServerState) -> None:
    try:
        names = state.auth.reload()
    except ConfigError as err:
        logger.error("API keys NOT reloaded (the old keys stay in force): %s", err)
        return
    logger.info("API keys reloaded: %d keys (%s)", len(names), ", ".join(names))


async def supervise(app: web.Application, cfg: ServerConfig) -> int:
    """Run until the engine fails for good; the exit code (1). Restarts it if configured."""
    state = app[STATE_KEY]
    try:
        await app[LOAD_TASK_KEY]
    except Exception as err:  # noqa: BLE001 - any start-up failure ends the process
        logger.error("start-up failed: %s", err)
        return 1
    loop = asyncio.get_running_loop()
    backoff, ready_at = RESTART_BACKOFF_S, loop.time()
    while True:
        reason = await state.client.wait_dead()
        if not cfg.restart_engine:
            logger.error("the engine process died (%s); exiting 1 so that a supervisor "
                         "restarts the server (or run with --restart-engine)", reason)
            return 1
        if loop.time() - ready_at >= STABLE_RUN_S:
            backoff = RESTART_BACKOFF_S
        logger.error("the engine process died (%s); restarting it in %.1fs", reason, backoff)
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, RESTART_BACKOFF_MAX_S)
        state.metrics.engine_restarts.inc()
        try:
            await state.client.restart()
        except EngineUnavailableError as err:
            logger.error("engine restart failed: %s", err)
            continue  # wait_dead answers at once; the next try waits longer
        ready_at = loop.time()
        logger.info("engine restarted")


async def drain(state: ServerState, timeout: float) -> None:
    """Refuse new requests; wait up to `timeout` for the admitted ones to finish."""
    state.draining = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    if state.admission.num_requests:
        logger.info("draining: %d requests in flight, waiting up to %.0fs",
                    state.admission.num_requests, timeout)
    while state.admission.num_requests and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if state.admission.num_requests:
        logger.warning("shutdown timeout: %d requests still in flight are cut off",
                       state.admission.num_requests)


async def serve(cfg: ServerConfig, factory: EngineFactory | None = None) -> int:
    """Run until SIGINT/SIGTERM (drain, 0) or until the engine fails for good (1)."""
    app = create_app(cfg, EngineClient.spawn(cfg.engine, factory))
    state = app[STATE_KEY]
    runner = GuardedRunner(app, max_connections=cfg.max_connections, handler_cancellation=True,
                           access_log=None, keepalive_timeout=cfg.keepalive_timeout,
                           shutdown_timeout=5.0)
    await runner.setup()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, reload_keys, state)
    code = 0
    try:
        site = web.TCPSite(runner, cfg.host, cfg.port)
        await site.start()
        logger.info("serving on %s (model loading in the background)", ", ".join(
            f"http://{host}:{port}" for host, port, *_ in runner.addresses))
        supervisor = asyncio.create_task(supervise(app, cfg))
        stop_task = asyncio.create_task(stop.wait())
        await asyncio.wait([supervisor, stop_task], return_when=asyncio.FIRST_COMPLETED)
        if supervisor.done():
            code = supervisor.result()
        else:
            logger.info("stop signal: draining")
            await drain(state, cfg.shutdown_timeout)
        for task in (supervisor, stop_task):
            task.cancel()
        await asyncio.gather(supervisor, stop_task, return_exceptions=True)
    finally:
        logger.info("shutting down")
        await runner.cleanup()
    return code


def run_server(cfg: ServerConfig, factory: EngineFactory | None = None) -> int:
    setup_logging()
    with contextlib.suppress(KeyboardInterrupt):
        return asyncio.run(serve(cfg, factory))
    return 130

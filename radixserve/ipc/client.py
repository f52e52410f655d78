"""The API process's handle on the engine: start it, stream tokens per request, abort, stop.

Owns: EngineClient (per-rid asyncio queues, engine state, latest stats, and the engine's
lives: an engine that dies fails every request in flight at once, and `restart` starts a new
one through the transport factory). Does not know: HTTP, tokenizers, what the engine does
inside a step, how messages travel (transport.py), when to restart (server/serve.py).
Everything a transport's threads receive is handed to the loop with call_soon_threadsafe, and
all client state is touched on the loop only.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Any

from radixserve.config import EngineConfig
from radixserve.ipc.messages import (
    AbortMsg,
    CacheCallMsg,
    CacheEventsMsg,
    CallResultMsg,
    EngineErrorMsg,
    EngineReadyMsg,
    EngineStatsMsg,
    FlushCacheMsg,
    FlushCacheResultMsg,
    GenerateMsg,
    TokenBatchMsg,
)
from radixserve.ipc.transport import EngineFactory, ProcessTransport, Transport
from radixserve.types import InvalidRequestError, TokenOutput

logger = logging.getLogger(__name__)


class EngineState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DEAD = "dead"
    STOPPED = "stopped"


class EngineUnavailableError(RuntimeError):
    """The engine cannot take requests now (still loading, dead or stopped): HTTP 503."""


class EngineFailedError(RuntimeError):
    """The engine failed while this request was in flight: HTTP 500."""


class EngineClient:
    """Async front of one engine. All methods run on the event loop that called start()."""

    def __init__(self, transport: Transport,
                 respawn: Callable[[], Transport] | None = None) -> None:
        """`respawn` builds a fresh transport for `restart` (None: no restarts)."""
        self._transport = transport
        self._respawn = respawn
        self._life = 0  # which transport's messages count: a dead one's late ones do not
        self._died: asyncio.Future[str] | None = None
        self.state = EngineState.LOADING
        self.info: dict[str, Any] = {}
        self.stats: dict[str, Any] = {}
        self.error: str | None = None
        self.cache_event_sinks: list[Callable[[list[Any]], object]] = []
        self._queues: dict[str, asyncio.Queue[TokenOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[dict[str, Any]] | None = None
        self._flush_waiters: list[asyncio.Future[bool]] = []
        self._calls: dict[str, asyncio.Future[dict[str, Any]]] = {}

    @classmethod
    def spawn(cls, cfg: EngineConfig, factory: EngineFactory | None = None) -> EngineClient:
        """The engine in its own process; `factory` None: the real Engine (tests: fakes)."""
        return cls(ProcessTransport(cfg, factory), lambda: ProcessTransport(cfg, factory))

    @property
    def transport(self) -> Transport:
        return self._transport

    async def start(self) -> dict[str, Any]:
        """Start the engine and wait for it to be ready. Raises EngineUnavailableError."""
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._died = self._loop.create_future()
        self._life += 1
        self._transport.start(self._from_thread(self._on_message), self._from_thread(self._on_exit))
        return await self._ready

    async def wait_dead(self) -> str:
        """Wait until the engine (the current one) dies; the reason. Call after start()."""
        assert self._died is not None, "start() first"
        return await asyncio.shield(self._died)

    async def restart(self) -> dict[str, Any]:
        """Replace a dead engine with a fresh one and wait for it to be ready.

        Raises EngineUnavailableError when the new one fails to start (the client stays DEAD).
        """
        assert self.state is EngineState.DEAD and self._respawn is not None
        old, self._transport = self._transport, self._respawn()
        await old.close(2.0)  # reap the dead process and its pipe threads
        self.state, self.error, self.stats = EngineState.LOADING, None, {}
        return await self.start()

    def _from_thread(self, fn: Callable[[Any], None]) -> Callable[[Any], None]:
        loop = self._loop
        assert loop is not None
        life = self._life

        def on_loop(arg: Any) -> None:
            if life == self._life:  # else: from an engine that died and was replaced
                fn(arg)

        def call(arg: Any) -> None:
            try:
                loop.call_soon_threadsafe(on_loop, arg)
            except RuntimeError:
                pass  # the loop is closed: the server is gone, nobody to tell

        return call

    def _on_message(self, msg: Any) -> None:
        if isinstance(msg, TokenBatchMsg):
            for out in msg.outputs:
                q = self._queues.get(out.rid)
                if q is not None:  # None: aborted on our side; late outputs are dropped
                    q.put_nowait(out)
        elif isinstance(msg, EngineStatsMsg):
            self.stats = msg.stats
        elif isinstance(msg, CacheEventsMsg):
            for sink in self.cache_event_sinks:
                sink(msg.events)
        elif isinstance(msg, EngineErrorMsg):
            self._on_error(msg)
        elif isinstance(msg, CallResultMsg):
            call = self._calls.get(msg.call_id)
            if call is not None and not call.done():
                if msg.error is None:
                    call.set_result(msg.result or {})
                elif msg.status < 500:
                    call.set_exception(InvalidRequestError(msg.error, status=msg.status))
                else:
                    call.set_exception(EngineFailedError(msg.error))
        elif isinstance(msg, FlushCacheResultMsg):
            if self._flush_waiters:
                fut = self._flush_waiters.pop(0)
                if not fut.done():
                    fut.set_result(msg.flushed)
        elif isinstance(msg, EngineReadyMsg):
            self.info = msg.info
            self.state = EngineState.READY
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(msg.info)
        else:
            logger.warning("ignoring unexpected engine message %s", type(msg).__name__)

    def _on_error(self, msg: EngineErrorMsg) -> None:
        if msg.rid is None:
            self._fail(msg.message)
            return
        q = self._queues.get(msg.rid)
        if q is not None:
            err: BaseException
            if msg.status < 500:
                err = InvalidRequestError(msg.message, status=msg.status)
            else:
                err = EngineFailedError(msg.message)
            q.put_nowait(err)

    def _on_exit(self, reason: str) -> None:
        if self.state is not EngineState.STOPPED:
            self._fail(self.error or reason)

    def _fail(self, reason: str) -> None:
        """The engine is gone: fail start-up, every pending request and every flush."""
        if self.state in (EngineState.STOPPED, EngineState.DEAD):
            return
        logger.error("engine failed: %s", reason)
        self.error = reason
        self.state = EngineState.DEAD
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(EngineUnavailableError(reason))
        for q in self._queues.values():
            q.put_nowait(EngineFailedError(f"the engine failed: {reason}"))
        for fut in self._flush_waiters:
            if not fut.done():
                fut.set_exception(EngineUnavailableError(reason))
        self._flush_waiters.clear()
        for call in self._calls.values():
            if not call.done():
                call.set_exception(EngineUnavailableError(reason))
        if self._died is not None and not self._died.done():
            self._died.set_result(reason)

    def _check_ready(self) -> None:
        if self.state is EngineState.LOADING:
            raise EngineUnavailableError("the model is still loading")
        if self.state is not EngineState.READY:
            raise EngineUnavailableError(f"the engine is {self.state.value}: {self.error or ''}")

    async def generate(self, msg: GenerateMsg) -> AsyncGenerator[TokenOutput, None]:
        """Stream one request's outputs. Stopping early (break, cancel, close) aborts it.

        Raises InvalidRequestError (the engine rejected it), EngineFailedError (the engine died)
        or EngineUnavailableError (not ready).
        """
        self._check_ready()
        assert msg.rid not in self._queues, f"duplicate rid {msg.rid}"
        q: asyncio.Queue[TokenOutput | BaseException] = asyncio.Queue()
        self._queues[msg.rid] = q
        self._transport.send(msg)
        finished = False
        try:
            while not finished:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
        finally:
            self._queues.pop(msg.rid, None)
            if not finished and self.state is EngineState.READY:
                self._transport.send(AbortMsg(msg.rid))

    async def flush_cache(self, include_pins: bool = False) -> bool:
        """Drop every cached prefix but pinned ones (all, with include_pins). False when
        requests are running (nothing flushed)."""
        self._check_ready()
        assert self._loop is not None
        fut: asyncio.Future[bool] = self._loop.create_future()
        self._flush_waiters.append(fut)
        self._transport.send(FlushCacheMsg(include_pins))
        return await fut

    async def call(self, msg: CacheCallMsg) -> dict[str, Any]:
        """A pin call's result. Raises InvalidRequestError (4xx from the engine),
        EngineFailedError (5xx) or EngineUnavailableError (not ready / died meanwhile)."""
        self._check_ready()
        assert self._loop is not None and msg.call_id not in self._calls
        fut: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        self._calls[msg.call_id] = fut
        self._transport.send(msg)
        try:
            return await fut
        finally:
            self._calls.pop(msg.call_id, None)

    def is_alive(self) -> bool:
        return self.state is EngineState.READY and self._transport.is_alive()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine by its handle; pending requests fail with EngineUnavailableError."""
        if self.state is EngineState.STOPPED:
            return
        self.state = EngineState.STOPPED
        for q in self._queues.values():
            q.put_nowait(EngineUnavailableError("the server is shutting down"))
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(EngineUnavailableError("the server is shutting down"))
        for call in self._calls.values():
            if not call.done():
                call.set_exception(EngineUnavailableError("the server is shutting down"))
        await self._transport.close(timeout)

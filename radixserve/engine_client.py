"""The API process's handle on the engine: start it, stream tokens per request, abort, stop.

Owns: EngineClient (per-rid asyncio queues, engine state, latest stats) and ProcessTransport
(the engine in its own spawned process, talking over two pipes). Does not know: HTTP,
tokenizers, what the engine does inside a step.

Threads: the pipes are read and written by two small daemon threads, so neither a large
GenerateMsg nor a burst of token batches ever blocks the event loop; everything they receive
is handed to the loop with call_soon_threadsafe, and all client state is touched on the loop only.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import multiprocessing as mp
import queue
import threading
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

from radixserve.config import EngineConfig
from radixserve.engine_proc import (
    DEFAULT_ENGINE_FACTORY,
    EngineFactory,
    run_engine_process,
)
from radixserve.messages import (
    AbortMsg,
    CacheEventsMsg,
    EngineErrorMsg,
    EngineReadyMsg,
    EngineStatsMsg,
    FlushCacheMsg,
    FlushCacheResultMsg,
    GenerateMsg,
    ShutdownMsg,
    TokenBatchMsg,
)
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


class Transport(Protocol):
    """How messages reach an engine loop and come back (a process, or inline in tests)."""

    def start(self, on_message: Callable[[Any], None], on_exit: Callable[[str], None]) -> None: ...
    def send(self, msg: Any) -> None: ...
    def is_alive(self) -> bool: ...
    async def close(self, timeout: float) -> None: ...


class ProcessTransport:
    """The engine in a spawned process (spawn: fork after CUDA or torch threads is unsafe)."""

    def __init__(self, cfg: EngineConfig, factory: EngineFactory = DEFAULT_ENGINE_FACTORY) -> None:
        self._cfg = cfg
        self._factory = factory
        self._outgoing: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._proc: Any = None
        self._threads: list[threading.Thread] = []

    def start(self, on_message: Callable[[Any], None], on_exit: Callable[[str], None]) -> None:
        ctx = mp.get_context("spawn")
        req_recv, req_send = ctx.Pipe(duplex=False)
        out_recv, out_send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=run_engine_process, args=(self._cfg, self._factory, req_recv, out_send),
            name="radixserve-engine",
        )
        self._proc.start()
        # Drop our copies of the child's ends: then the child's exit is an EOF on out_recv.
        req_recv.close()
        out_send.close()
        self._threads = [
            threading.Thread(target=self._read_loop, args=(out_recv, on_message, on_exit),
                             name="engine-reader", daemon=True),
            threading.Thread(target=self._write_loop, args=(req_send,), name="engine-writer",
                             daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    @staticmethod
    def _read_loop(conn: Any, on_message: Callable[[Any], None],
                   on_exit: Callable[[str], None]) -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                on_exit("the engine process exited")
                conn.close()
                return
            on_message(msg)

    def _write_loop(self, conn: Any) -> None:
        while (msg := self._outgoing.get()) is not None:
            try:
                conn.send(msg)
            except OSError:
                break  # the engine is gone; the reader reports it
        conn.close()

    def send(self, msg: Any) -> None:
        self._outgoing.put(msg)

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    async def close(self, timeout: float) -> None:
        if self._proc is None:
            return
        self._outgoing.put(ShutdownMsg())
        self._outgoing.put(None)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._proc.join, timeout)
        if self._proc.is_alive():
            logger.warning("engine did not stop in %.1fs; terminating it", timeout)
            self._proc.terminate()
            await loop.run_in_executor(None, self._proc.join, 2.0)
        if self._proc.is_alive():
            self._proc.kill()
            await loop.run_in_executor(None, self._proc.join, 2.0)
        for thread in self._threads:
            await loop.run_in_executor(None, thread.join, 2.0)


class EngineClient:
    """Async front of one engine. All methods run on the event loop that called start()."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self.state = EngineState.LOADING
        self.info: dict[str, Any] = {}
        self.stats: dict[str, Any] = {}
        self.error: str | None = None
        self.cache_event_sinks: list[Callable[[list[Any]], object]] = []
        self._queues: dict[str, asyncio.Queue[TokenOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[dict[str, Any]] | None = None
        self._flush_waiters: list[asyncio.Future[bool]] = []

    @classmethod
    def spawn(cls, cfg: EngineConfig,
              factory: EngineFactory = DEFAULT_ENGINE_FACTORY) -> EngineClient:
        return cls(ProcessTransport(cfg, factory))

    @property
    def transport(self) -> Transport:
        return self._transport

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    async def start(self) -> dict[str, Any]:
        """Start the engine and wait for it to be ready. Raises EngineUnavailableError."""
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._transport.start(self._from_thread(self._on_message), self._from_thread(self._on_exit))
        return await self._ready

    def _from_thread(self, fn: Callable[[Any], None]) -> Callable[[Any], None]:
        loop = self._loop
        assert loop is not None

        def call(arg: Any) -> None:
            try:
                loop.call_soon_threadsafe(fn, arg)
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

    async def flush_cache(self) -> bool:
        """Drop every cached prefix. False when requests are running (nothing flushed)."""
        self._check_ready()
        assert self._loop is not None
        fut: asyncio.Future[bool] = self._loop.create_future()
        self._flush_waiters.append(fut)
        self._transport.send(FlushCacheMsg())
        return await fut

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
        await self._transport.close(timeout)

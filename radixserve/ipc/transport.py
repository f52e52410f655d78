"""How messages reach the engine loop and come back: the Transport and the engine process.

The Transport contract, and the engine in its own spawned process (ProcessTransport).

Owns: the engine process's lifetime (spawn, shutdown, terminate) and the two pipe threads.
Does not know: what the messages mean (client.py), the engine itself: the child imports
ENGINE_ENTRY by name, so the API process never imports torch or the engine package.

Threads: the pipes are read and written by two small daemon threads, so neither a large
GenerateMsg nor a burst of token batches ever blocks the event loop.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import multiprocessing as mp
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

from radixserve.config import EngineConfig
from radixserve.ipc.messages import ShutdownMsg

logger = logging.getLogger(__name__)

# Imported only in the engine process (see _engine_main).
ENGINE_ENTRY = "radixserve.engine.loop:run_engine_process"

# Builds the engine object inside the engine process; must be picklable (a module-level
# function or a functools.partial of one). Tests pass fakes; None means the real Engine.
EngineFactory = Callable[[EngineConfig], Any]


def _engine_main(entry: str, *args: Any) -> None:
    """The spawned process's target: import the engine side there, and only there."""
    module_name, _, attr = entry.partition(":")
    getattr(importlib.import_module(module_name), attr)(*args)


class Transport(Protocol):
    """How messages reach an engine loop and come back (a process, or inline in tests)."""

    def start(self, on_message: Callable[[Any], None], on_exit: Callable[[str], None]) -> None: ...
    def send(self, msg: Any) -> None: ...
    def is_alive(self) -> bool: ...
    async def close(self, timeout: float) -> None: ...


class ProcessTransport:
    """The engine in a spawned process (spawn: fork after CUDA or torch threads is unsafe)."""

    def __init__(self, cfg: EngineConfig, factory: EngineFactory | None = None) -> None:
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
            target=_engine_main,
            args=(ENGINE_ENTRY, self._cfg, self._factory, req_recv, out_send),
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

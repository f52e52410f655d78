"""The engine's own process: receive messages, step the engine, send token batches back.

Owns: EngineLoop (message handling and one loop iteration around an engine object) and
run_engine_process (the process entry point; ipc/transport.py spawns it by name, so the API
process never imports this package's heavy side). Does not know: HTTP, tokenizers, asyncio.

Loop shape: drain the inbox (without blocking while the engine has work, blocking up to the
stats interval while idle, so an idle engine costs nothing), run one `step()`, send one
TokenBatchMsg with every output of that step, then cache events and (periodically, and when the
engine goes idle) an EngineStatsMsg. A per-request InvalidRequestError becomes
EngineErrorMsg(rid), and so does an output carrying an error (a grammar that failed to compile
in the engine: status 400); anything else is fatal: EngineErrorMsg(None), then the process exits.
"""

from __future__ import annotations

import logging
import signal
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, Protocol

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
    ListPinsMsg,
    LoadLoRAMsg,
    PinMsg,
    ShutdownMsg,
    TokenBatchMsg,
    UnloadLoRAMsg,
    UnpinMsg,
)
from radixserve.types import InvalidRequestError, TokenOutput

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.5


class EngineLike(Protocol):
    """The Engine contract this loop drives (radixserve.engine.Engine and test fakes)."""

    @property
    def info(self) -> dict[str, Any]: ...

    def add_request(self, msg: GenerateMsg) -> None: ...
    def abort(self, rid: str) -> None: ...
    def step(self) -> list[TokenOutput]: ...
    def has_work(self) -> bool: ...
    def flush_cache(self, include_pins: bool = False) -> bool: ...
    def call(self, msg: CacheCallMsg) -> None: ...
    def drain_replies(self) -> list[CallResultMsg]: ...
    def stats(self) -> dict[str, Any]: ...
    def check_integrity(self) -> None: ...
    def drain_cache_events(self) -> list[Any]: ...


class EngineLoop:
    """One engine plus the bookkeeping of what to send back; shared by the process and tests."""

    def __init__(self, engine: EngineLike, send: Callable[[Any], None],
                 stats_interval: float = STATS_INTERVAL_S) -> None:
        self.engine = engine
        self._send = send
        self._stats_interval = stats_interval
        self._last_stats: dict[str, Any] | None = None
        self._last_stats_time = 0.0
        self._integrity: dict[str, Any] = {}  # the last idle check's result, sent with stats

    def handle(self, msg: Any) -> bool:
        """Apply one incoming message. Returns False on ShutdownMsg."""
        if isinstance(msg, GenerateMsg):
            try:
                self.engine.add_request(msg)
            except InvalidRequestError as err:
                self._send(EngineErrorMsg(str(err), rid=msg.rid, status=err.status))
        elif isinstance(msg, AbortMsg):
            self.engine.abort(msg.rid)
        elif isinstance(msg, FlushCacheMsg):
            self._send(FlushCacheResultMsg(self.engine.flush_cache(msg.include_pins)))
            self.send_stats(force=True)
        elif isinstance(msg, (PinMsg, UnpinMsg, ListPinsMsg, LoadLoRAMsg, UnloadLoRAMsg)):
            self.engine.call(msg)
            self._send_replies()
            self.send_stats(force=True)
        elif isinstance(msg, ShutdownMsg):
            return False
        else:
            raise TypeError(f"unexpected message {type(msg).__name__}")
        return True

    def _send_replies(self) -> None:
        for reply in self.engine.drain_replies():
            self._send(reply)

    def step(self) -> None:
        outputs = self.engine.step()
        for out in outputs:
            if out.error is not None:
                self._send(EngineErrorMsg(out.error, rid=out.rid, status=400))
        outputs = [out for out in outputs if out.error is None]
        if outputs:
            self._send(TokenBatchMsg(outputs))
        self._send_replies()
        events = self.engine.drain_cache_events()
        if events:
            self._send(CacheEventsMsg(events))

    def check_when_idle(self) -> None:
        """The leak check SGLang runs when idle: every page free, cached or held, the tree's
        locks consistent. A failure is logged and reported in the stats, never raised: the
        engine keeps serving and the operator sees it (/server_info, /metrics)."""
        num_checks = self._integrity.get("integrity_checks", 0) + 1
        try:
            self.engine.check_integrity()
        except AssertionError as err:
            logger.error("engine integrity check FAILED: %s", err)
            self._integrity = {"integrity_ok": False, "integrity_error": str(err)[:500],
                               "integrity_checks": num_checks}
            return
        self._integrity = {"integrity_ok": True, "integrity_checks": num_checks}

    def send_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_stats_time < self._stats_interval:
            return
        stats = {**self.engine.stats(), **self._integrity}
        self._last_stats_time = now
        if force or stats != self._last_stats:
            self._last_stats = stats
            self._send(EngineStatsMsg(stats))

    def run(self, inbox: Connection) -> None:
        """Serve until ShutdownMsg or the API process goes away (EOF on the inbox)."""
        was_busy = False
        while True:
            timeout = 0.0 if self.engine.has_work() else self._stats_interval
            try:
                while inbox.poll(timeout):
                    if not self.handle(inbox.recv()):
                        return
                    timeout = 0.0
            except (EOFError, OSError):
                return
            busy = self.engine.has_work()
            if busy:
                self.step()
            going_idle = was_busy and not self.engine.has_work()
            if going_idle:
                self.check_when_idle()
            # Going idle: publish at once, so /metrics shows the freed pages without a lag.
            self.send_stats(force=going_idle)
            was_busy = busy


def run_engine_process(cfg: EngineConfig,
                       factory: Callable[[EngineConfig], EngineLike] | None,
                       inbox: Connection, outbox: Connection) -> None:
    """Process entry point. `factory` None builds the real Engine (tests pass fakes)."""
    # Ctrl-C and a supervisor's SIGTERM reach the whole process group; the API process owns
    # the shutdown (it drains, then sends ShutdownMsg). Dying on SIGTERM here would also skip
    # multiprocessing's exit finalizers, leaking the semaphore of tqdm's process-shared lock
    # (resource_tracker's "leaked semaphore" warning at shutdown).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine: %(message)s")
    try:
        engine: EngineLike
        if factory is None:
            from radixserve.engine.engine import Engine

            engine = Engine(cfg)
        else:
            engine = factory(cfg)
    except Exception as err:  # noqa: BLE001 - any start-up failure is reported, not raised
        logger.exception("engine start failed")
        outbox.send(EngineErrorMsg(f"engine failed to start: {type(err).__name__}: {err}"))
        return
    outbox.send(EngineReadyMsg(dict(engine.info)))
    loop = EngineLoop(engine, outbox.send)
    try:
        loop.run(inbox)
    except Exception as err:  # noqa: BLE001 - fatal: tell the API process, then exit
        traceback.print_exc()
        try:
            outbox.send(EngineErrorMsg(f"engine failed: {type(err).__name__}: {err}"))
        except OSError:
            pass
        raise SystemExit(1) from err
    close = getattr(engine, "close", None)
    if close is not None:  # a clean exit: the tiers persist the pool for the next process
        close()

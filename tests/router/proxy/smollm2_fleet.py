"""The failover end-to-end tests' fleet: 3 real `radixserve serve` replicas (SmolLM2, fp32)
and a router in front of them, and the SIGKILL of the replica with most streams.

Owns: starting and stopping them (by handle). Does not know: what the tests send.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from aiohttp import web

from radixserve.testing.fake_replica import start_app
from router.app import ROUTER_KEY, create_app
from router.config import RouterConfig
from router.core import Router
from router.workers import Worker
from tests.server_proc import ServerProc, running_server
from tests.waiting import wait_until

T = TypeVar("T")

ARGS = ["--kv-cache-tokens", "4096", "--max-model-len", "1024"]
CFG = RouterConfig(health_interval_s=0.2, health_timeout_s=1.0, retry_backoff_s=0.01)


@dataclass
class Fleet:
    servers: list[ServerProc]
    app: web.Application
    url: str  # the router's

    @property
    def router(self) -> Router:
        return self.app[ROUTER_KEY]

    def kill_busiest(self) -> Worker:
        """SIGKILL the replica with the most requests in flight (at least one)."""
        victim = max(self.router.pool.all(), key=lambda w: w.in_flight)
        assert victim.in_flight >= 1
        next(x for x in self.servers if x.url == victim.url).proc.kill()
        return victim

    async def kill_when(self, tasks: Sequence[asyncio.Task[T]], ready: Callable[[], bool],
                        what: str) -> list[T]:
        """Once `ready()`, SIGKILL the busiest replica; the tasks' results, every stream
        resumed where it broke (none ended with an error event)."""
        await wait_until(ready, timeout=300, what=what)
        self.kill_busiest()
        results = list(await asyncio.gather(*tasks))
        assert self.router.stream_counts["resumed"] >= 1
        assert self.router.stream_counts["failed"] == 0
        return results


@contextlib.asynccontextmanager
async def smollm2_fleet(tmp: Path) -> AsyncIterator[Fleet]:
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(running_server("smollm2-135m", tmp / f"r{i}.log", ARGS))
                   for i in range(3)]
        app = create_app(dataclasses.replace(CFG, workers=tuple(x.url for x in servers)))
        runner, url = await start_app(app)
        try:
            yield Fleet(servers, app, url)
        finally:
            await runner.cleanup()

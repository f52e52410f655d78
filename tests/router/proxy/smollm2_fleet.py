"""The failover end-to-end tests' fleet: 3 real `radixserve serve` replicas (SmolLM2, fp32)
and a router in front of them, and the SIGKILL of the replica with most streams.

Owns: starting and stopping the replicas (by handle), the router in front of them, and
running the reference requests one at a time per replica. Does not know: what the tests send.

The replicas are shared by this package's failover tests (`Replicas`, the package-scoped
`smollm2_replicas` fixture in conftest.py): a replica start is most of such a test's time. Each
test gets a fresh router over the three live replicas; the one it killed is replaced when its
fleet closes (started then, waited for by whichever test comes next), so no test depends on
another having run, or on the order.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from aiohttp import web

from radixserve.testing.fake_replica import start_app
from router.app import ROUTER_KEY, create_app
from router.config import RouterConfig
from router.core import Router
from router.workers import Worker
from tests.server_proc import ServerProc, running_server, wait_all_healthy
from tests.waiting import wait_until

T = TypeVar("T")

ARGS = ["--kv-cache-tokens", "4096", "--max-model-len", "1024"]
CFG = RouterConfig(health_interval_s=0.2, health_timeout_s=1.0, retry_backoff_s=0.01)
NUM_REPLICAS = 3


class Replicas:
    """NUM_REPLICAS SmolLM2 servers; `live()` replaces any that died, starting them side by
    side (a start is mostly one core's import and load: two cores start two at once)."""

    def __init__(self, tmp: Path, stack: contextlib.ExitStack) -> None:
        self._tmp, self._stack = tmp, stack
        self._servers: list[ServerProc | None] = [None] * NUM_REPLICAS
        self._starts = 0

    def _start(self) -> ServerProc:
        self._starts += 1
        log = self._tmp / f"replica{self._starts}.log"
        return self._stack.enter_context(running_server("smollm2-135m", log, ARGS,
                                                        healthy=False))

    def replace_dead(self) -> None:
        """Start a replacement for every replica not running (without waiting for it)."""
        for i, server in enumerate(self._servers):
            if server is None or server.proc.poll() is not None:
                self._servers[i] = self._start()

    def live(self) -> list[ServerProc]:
        self.replace_dead()
        servers = [s for s in self._servers if s is not None]
        wait_all_healthy(servers)
        return servers


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

    async def each_alone(self, n: int, run: Callable[[str, int], Awaitable[T]]) -> list[T]:
        """`run(url, i)` for i < n straight to the replicas (no router): each request alone
        on its replica, as an uninterrupted reference run; the replicas side by side."""
        results: dict[int, T] = {}

        async def lane(k: int) -> None:
            for i in range(k, n, len(self.servers)):
                results[i] = await run(self.servers[k].url, i)

        await asyncio.gather(*(lane(k) for k in range(len(self.servers))))
        return [results[i] for i in range(n)]


@contextlib.asynccontextmanager
async def smollm2_fleet(replicas: Replicas) -> AsyncIterator[Fleet]:
    servers = replicas.live()
    app = create_app(dataclasses.replace(CFG, workers=tuple(x.url for x in servers)))
    runner, url = await start_app(app)
    try:
        yield Fleet(servers, app, url)
    finally:
        await runner.cleanup()
        replicas.replace_dead()

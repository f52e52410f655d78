"""End to end: the router in front of real `radixserve serve` replicas on a tiny model.

Skipped until the server exists. Each replica is a subprocess on a free loopback port, stopped
by its handle; the router runs in-process on a free port.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from radixserve.kv_events.publisher import block_hashes
from radixserve.testing.fake_replica import start_app
from router.app import ROUTER_KEY, create_app
from router.config import RouterConfig
from router.routing.route_key import HFPromptEncoder
from tests.waiting import wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        importlib.util.find_spec("radixserve.cli") is None
        or importlib.util.find_spec("radixserve.__main__") is None,
        reason="radixserve.server / the `radixserve serve` CLI is not written yet",
    ),
]

PREFIX = "You are a helpful assistant that answers in short sentences. " * 3


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Replica:
    def __init__(self, model_dir: Path, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "radixserve", "serve", "--model", str(model_dir),
             "--port", str(self.port), "--dtype", "float32", "--enable-kv-events"],
            stdout=self._log, stderr=subprocess.STDOUT,
        )
        self.log_path = log_path

    def wait_ready(self, timeout: float = 180.0) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"replica exited: {self.log_path.read_text()[-2000:]}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            time.sleep(0.25)
        raise TimeoutError(f"replica not ready: {self.log_path.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self._log.close()


@pytest.fixture(scope="module")
def replicas(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    logs = tmp_path_factory.mktemp("replica_logs")
    started = [Replica(tiny_llama, logs / f"r{i}.log") for i in range(2)]
    try:
        for r in started:
            r.wait_ready()
        yield started
    finally:
        for r in started:
            r.stop()


@contextlib.asynccontextmanager
async def router(urls: list[str], model_dir: Path, **kw: Any) -> AsyncIterator[tuple[str, Any]]:
    cfg = RouterConfig(workers=tuple(urls), health_interval_s=0.2, **kw)
    app = create_app(cfg, encoder=HFPromptEncoder(model_dir))
    runner, url = await start_app(app)
    try:
        yield url, app[ROUTER_KEY]
    finally:
        await runner.cleanup()


async def complete(s: aiohttp.ClientSession, url: str, prompt: str,
                   max_tokens: int = 4) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    async with s.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return dict(await resp.json())


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


async def test_shared_prefix_lands_on_one_replica(replicas: list[Replica], tiny_llama: Path) -> None:
    async with router([r.url for r in replicas], tiny_llama) as (url, _), \
            aiohttp.ClientSession() as s:
        answers = [await complete(s, url, PREFIX + f"Question {i}?") for i in range(4)]
    # Only the replica that served the first one can have its prefix cached.
    assert all(cached(a) >= len(PREFIX) // 2 for a in answers[1:]), [cached(a) for a in answers]


async def test_precise_mode_routes_by_what_replicas_report(
    replicas: list[Replica], tiny_llama: Path
) -> None:
    prompt = "Precise routing probe: " + "the quick brown fox jumps. " * 6
    enc = HFPromptEncoder(tiny_llama)
    want = set(block_hashes(enc.encode_prompt(prompt), 16))
    async with router([r.url for r in replicas], tiny_llama, kv_events=True,
                      kv_stream_timeout_s=30.0) as (url, core), aiohttp.ClientSession() as s:
        precise = core.precise
        await wait_until(lambda: all(precise.is_live(r.url) for r in replicas), timeout=30)
        target = replicas[1]  # a miss would rotate to replicas[0] first
        await complete(s, target.url, prompt)  # directly: only its events can tell the router
        await wait_until(lambda: want <= precise.state(target.url).hashes, timeout=30)
        answer = await complete(s, url, prompt)
    assert cached(answer) >= 16 * len(want) - 16


async def test_killed_replica_loses_no_unstreamed_request(
    replicas: list[Replica], tiny_llama: Path, tmp_path: Path
) -> None:
    victim = Replica(tiny_llama, tmp_path / "victim.log")
    try:
        victim.wait_ready()
        urls = [r.url for r in replicas] + [victim.url]
        async with router(urls, tiny_llama, retry_backoff_s=0.02) as (url, core), \
                aiohttp.ClientSession() as s:
            tasks = [asyncio.create_task(complete(s, url, f"Request {i}: " + PREFIX, 48))
                     for i in range(18)]
            worker = core.pool.get(victim.url)
            await wait_until(lambda: worker.in_flight > 0, timeout=30)
            victim.proc.kill()  # with requests in flight on it
            answers = await asyncio.gather(*tasks)
            assert worker.num_errors >= 1  # the router did see it die mid-run
        assert len(answers) == 18 and all(a["usage"]["completion_tokens"] > 0 for a in answers)
    finally:
        victim.stop()



"""A timeout on every wait (router/proxy/relay.py): a replica that accepts and never answers
gets every route a 504 (or, once headers came, an SSE error event and [DONE]) within the
timeout plus 1 s, frees the key's concurrency slot, counts one fault, and the other replicas
keep serving."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from radixserve.testing.fake_replica import FakeReplicaConfig, fake_cluster
from radixserve.testing.hang import Hang
from router.app import ROUTER_KEY
from router.config import RouterConfig

pytestmark = pytest.mark.timeout(90)

KEY = "sk-tenant-1"
FIRST_BYTE_S, REQUEST_S, STALL_S = 1.0, 2.0, 1.0
CFG = RouterConfig(health_interval_s=0.05, health_timeout_s=1.0, retry_backoff_s=0.01,
                   first_byte_timeout_s=FIRST_BYTE_S, request_timeout_s=REQUEST_S,
                   stream_stall_timeout_s=STALL_S, breaker_cooldown_s=30.0,
                   breaker_max_cooldown_s=30.0)
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
# (method, path, body): every route the router proxies, streamed and not where it streams.
ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/v1/completions", {"prompt": "a", "max_tokens": 3}),
    ("POST", "/v1/completions", {"prompt": "b", "max_tokens": 3, "stream": True}),
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/chat/completions", {**CHAT, "stream": True}),
    ("POST", "/v1/responses", {"input": "c", "max_output_tokens": 3}),
    ("POST", "/v1/responses", {"input": "d", "max_output_tokens": 3, "stream": True}),
    ("POST", "/generate", {"text": "e", "sampling_params": {"max_new_tokens": 3}}),
    ("POST", "/generate", {"text": "f", "stream": True}),
    ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"prompt": "g"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
]
NUM_LIMITED = 8  # the routes with a request kind (the others pass without a key check)


def keys_file(tmp: Path) -> str:
    path = tmp / "keys.json"
    path.write_bytes(orjson.dumps({"keys": [{"name": "tenant-1", "key": KEY,
                                             "max_concurrency": 20}]}))
    return str(path)


async def call(s: aiohttp.ClientSession, url: str, method: str, path: str,
               body: dict[str, Any] | None) -> tuple[int, float, list[bytes], bytes]:
    """(status, seconds, SSE payloads, raw body) as the client sees them."""
    start = time.monotonic()
    async with s.request(method, url + path, json=body,
                         headers={"Authorization": f"Bearer {KEY}"}) as resp:
        raw = b""
        with contextlib.suppress(aiohttp.ClientPayloadError):  # dropped after [DONE]
            async for chunk in resp.content.iter_any():
                raw += chunk
        payloads = [ln[6:].strip() for ln in raw.split(b"\n") if ln.startswith(b"data: ")]
        return resp.status, time.monotonic() - start, payloads, raw


async def key_in_flight(s: aiohttp.ClientSession, url: str) -> float:
    async with s.get(f"{url}/metrics") as resp:
        text = await resp.text()
    m = re.search(r'^radixserve_router:key_requests_in_flight\{key_name="tenant-1"\} (\S+)$',
                  text, re.M)
    assert m is not None, text
    return float(m.group(1))


def assert_timed_out(status: int, payloads: list[bytes], raw: bytes, streamed: bool,
                     hang: Hang) -> None:
    if hang is Hang.BEFORE_HEADERS or not streamed:
        assert status == 504, raw
        error = orjson.loads(raw)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == "upstream_timeout"
        return
    assert status == 200
    assert payloads[-1] == b"[DONE]" and payloads.count(b"[DONE]") == 1
    error = orjson.loads(payloads[-2])["error"]
    assert error["code"] == "stream_interrupted" and "within" in error["message"]


@pytest.mark.parametrize("hang", list(Hang))
async def test_a_replica_that_never_answers_gets_every_route_a_timeout(
        tmp_path: Path, hang: Hang) -> None:
    cfg = dataclasses.replace(CFG, api_keys_file=keys_file(tmp_path))
    rcfg = [FakeReplicaConfig(name=f"r{i}", decode_s_per_token=0.01) for i in range(2)]
    async with fake_cluster(cfg, rcfg) as c, aiohttp.ClientSession() as s:
        router = c.router_app[ROUTER_KEY]
        silent, good = (router.pool.get(r.url) for r in c.replicas)
        assert silent is not None and good is not None
        c.replicas[0].hang = hang
        good.draining = True  # every route goes to the silent replica
        tasks = [asyncio.create_task(call(s, c.url, m, p, b)) for m, p, b in ROUTES]
        await asyncio.sleep(FIRST_BYTE_S / 2)
        assert await key_in_flight(s, c.url) == NUM_LIMITED  # the slots are held meanwhile
        results = await asyncio.gather(*tasks)
        for (_, path, body), (status, seconds, payloads, raw) in zip(ROUTES, results,
                                                                      strict=True):
            streamed = bool(body and body.get("stream"))
            bound = FIRST_BYTE_S if hang is Hang.BEFORE_HEADERS or streamed else REQUEST_S
            assert seconds < bound + 1.0, (path, seconds)
            assert_timed_out(status, payloads, raw, streamed, hang)
        assert await key_in_flight(s, c.url) == 0
        assert silent.num_errors == len(ROUTES)  # one fault per timed-out request
        assert silent.in_flight == 0
        # The other replica serves while this one still never answers.
        good.draining = False
        start = time.monotonic()
        answers = await asyncio.gather(*(call(s, c.url, "POST", "/v1/completions",
                                              {"prompt": f"z{i}", "max_tokens": 2})
                                         for i in range(6)))
        assert [a[0] for a in answers] == [200] * 6
        assert time.monotonic() - start < FIRST_BYTE_S
        assert c.replicas[1].num_requests == 6

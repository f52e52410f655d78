"""Auth, per-key cache namespaces, admission limits, client disconnects and engine failure,
against the in-process fake engine."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
from aiohttp.test_utils import TestClient

from radixserve.api.api_keys import cache_salt_for_api_key
from radixserve.kv_events.publisher import block_hashes
from radixserve.server.stats_log import StatsLogger
from tests.server.test_app import GREEDY, TOKENIZER, call, serve

LONG = {"prompt": "a shared system prompt that is long enough", "max_tokens": 2, **GREEDY}


def cached(out: dict[str, Any]) -> int:
    n: int = out["usage"]["prompt_tokens_details"]["cached_tokens"]
    return n


async def stats(tc: TestClient, key: str | None = None) -> dict[str, Any]:
    _, info = await call(tc, "/server_info", method="GET", key=key)
    result: dict[str, Any] = info["stats"]
    return result


async def wait_idle(tc: TestClient, key: str | None = None) -> dict[str, Any]:
    for _ in range(300):
        s = await stats(tc, key)
        if s.get("num_running") == 0 and s.get("kv_held_tokens") == 0:
            return s
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine never went idle: {s}")


async def test_auth_required_except_public_routes(model_dir: Path) -> None:
    async with serve(model_dir, api_keys=("k1", "k2")) as tc:
        for key in (None, "wrong", "k1x", ""):
            status, out = await call(tc, "/v1/completions", LONG, key=key)
            assert status == 401 and out["error"]["code"] == "invalid_api_key"
        assert (await tc.post("/v1/completions", data=orjson.dumps(LONG),
                              headers={"Authorization": "Basic k1"})).status == 401
        assert (await call(tc, "/v1/models", method="GET"))[0] == 401
        assert (await call(tc, "/v1/completions", LONG, key="k2"))[0] == 200
        for path in ("/health", "/metrics", "/version"):
            assert (await tc.get(path)).status == 200, path


async def test_prefix_cache_is_namespaced_per_key(model_dir: Path) -> None:
    async with serve(model_dir, api_keys=("alice", "bob")) as tc:
        _, first = await call(tc, "/v1/completions", LONG, key="alice")
        _, again = await call(tc, "/v1/completions", LONG, key="alice")
        _, other = await call(tc, "/v1/completions", LONG, key="bob")
        assert cached(first) == 0 and cached(again) > 0 and cached(other) == 0
    async with serve(model_dir, api_keys=("alice", "bob"), shared_cache=True) as tc:
        await call(tc, "/v1/completions", LONG, key="alice")
        _, other = await call(tc, "/v1/completions", LONG, key="bob")
        assert cached(other) > 0


async def test_max_concurrent_per_key(model_dir: Path) -> None:
    slow = {"prompt": "abc", "max_tokens": 100, "stream": True}
    async with serve(model_dir, step_interval=0.01, api_keys=("a", "b"),
                     max_concurrent_per_key=1) as tc:
        resp = await tc.post("/v1/completions", data=orjson.dumps(slow),
                             headers={"Authorization": "Bearer a"})
        await resp.content.readline()  # the first chunk: request admitted and running
        status, out = await call(tc, "/v1/completions", LONG, key="a")
        assert status == 429 and out["error"]["type"] == "rate_limit_error"
        assert (await call(tc, "/v1/completions", LONG, key="b"))[0] == 200
        await resp.read()
        assert (await call(tc, "/v1/completions", LONG, key="a"))[0] == 200


async def test_queue_limit_sends_retry_after(model_dir: Path) -> None:
    async with serve(model_dir, max_queue=2) as tc:
        resp = await tc.post("/v1/completions", data=orjson.dumps({**LONG, "n": 3}))
        assert resp.status == 429 and resp.headers["Retry-After"] == "1"
        assert (await resp.json())["error"]["code"] == "queue_full"
        assert (await call(tc, "/v1/completions", {**LONG, "n": 2}))[0] == 200


async def test_client_disconnect_aborts_and_frees(model_dir: Path) -> None:
    body = {"prompt": "abcdefgh", "max_tokens": 400, "stream": True}
    async with serve(model_dir, step_interval=0.01) as tc:
        resp = await tc.post("/v1/completions", data=orjson.dumps(body))
        await resp.content.readline()
        assert (await stats(tc))["num_running"] == 1
        resp.close()  # drop the connection mid-stream
        idle = await wait_idle(tc)
        assert idle["generation_tokens"] < 400  # stopped early, not run to completion
        text = await (await tc.get("/metrics")).text()
        assert 'radixserve:request_success_total{finished_reason="abort"} 1.0' in text


async def test_non_streaming_disconnect_aborts(model_dir: Path) -> None:
    body = {"prompt": "abcdefgh", "max_tokens": 400}
    async with serve(model_dir, step_interval=0.01) as tc:
        task = asyncio.create_task(tc.post("/v1/completions", data=orjson.dumps(body)))
        for _ in range(200):
            if (await stats(tc)).get("num_running") == 1:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        idle = await wait_idle(tc)
        assert idle["generation_tokens"] < 400


async def test_engine_crash_fails_pending_and_health(model_dir: Path) -> None:
    async with serve(model_dir, engine={"fail_at_step": 3}) as tc:
        status, out = await call(tc, "/v1/completions", {"prompt": "abc", "max_tokens": 10})
        assert status == 500 and "engine" in out["error"]["message"]
        status, health = await call(tc, "/health", method="GET")
        assert status == 503 and health["status"] == "dead"
        status, out = await call(tc, "/v1/completions", LONG)
        assert status == 503 and out["error"]["code"] == "engine_dead"


def test_stats_log_line() -> None:
    snapshot: dict[str, Any] = {}
    log = StatsLogger(lambda: snapshot, 5.0)
    assert log.line() is None  # idle: nothing to say
    snapshot.update(prompt_tokens=100, generation_tokens=50, prefix_cache_queries=100,
                    prefix_cache_hits=75, num_running=2, num_waiting=1, kv_total_tokens=1000,
                    kv_held_tokens=250, kv_cached_tokens=100)
    line = log.line()
    assert line is not None
    assert "Running: 2 reqs, Waiting: 1 reqs" in line and "25.0% held" in line
    assert "Prefix cache hit rate: 75.0%" in line and "Avg prompt throughput" in line


async def test_kv_events_stream_block_hashes(model_dir: Path) -> None:
    prompt = "0123456789abcdefghijklmnopqrstuvwxyz"  # 36 byte tokens: 2 full blocks of 16
    ids = TOKENIZER.encode(prompt, add_special_tokens=False)
    async with serve(model_dir, engine_cfg={"enable_kv_events": True},
                     api_keys=("tenant",)) as tc:
        _, out = await call(tc, "/v1/completions", {"prompt": prompt, "max_tokens": 2, **GREEDY},
                            key="tenant")
        resp = await tc.get("/kv_events?since=0", headers={"Authorization": "Bearer tenant"})
        assert resp.status == 200
        line = await asyncio.wait_for(resp.content.readline(), 10)
        resp.close()
    batch = orjson.loads(line.removeprefix(b"data: "))
    (event,) = batch["events"]
    assert event["type"] == "BlockStored" and event["parent_block_hash"] is None
    salt = cache_salt_for_api_key("tenant")
    assert salt and event["block_hashes"] == block_hashes(ids[:32], 16, salt)
    assert event["token_ids"] == ids[:32]


async def test_kv_events_off_by_default(model_dir: Path) -> None:
    async with serve(model_dir) as tc:
        status, out = await call(tc, "/kv_events", method="GET")
        assert status == 404 and out["error"]["code"] == "kv_events_disabled"

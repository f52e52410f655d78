"""Stored-response affinity behind the router: two real replica apps (fake engine) and the
router in-process. A chain through previous_response_id stays on the replica that holds it,
GET / DELETE reach it, a restarted router finds it again, and a replica that lost it answers
a clear 404 through the router (never a 5xx)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from radixserve.testing.fake_replica import start_app
from router.app import ROUTER_KEY, create_app
from router.config import RouterConfig
from router.core import Router
from router.fleet.response_owners import ResponseOwners
from tests.server.test_tools import model_dir, serve

__all__ = ["model_dir"]
BODY: dict[str, Any] = {"model": "m", "temperature": 0, "max_output_tokens": 16}


@contextlib.asynccontextmanager
async def routed(urls: list[str]) -> AsyncIterator[tuple[str, Router]]:
    app = create_app(RouterConfig(workers=tuple(urls), health_interval_s=0.2))
    runner, url = await start_app(app)
    try:
        yield url, app[ROUTER_KEY]
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def two_replicas(model_dir: Path) -> AsyncIterator[list[str]]:
    async with serve(model_dir) as a, serve(model_dir) as b:
        yield [str(tc.make_url("")).rstrip("/") for tc in (a, b)]


async def call(s: aiohttp.ClientSession, method: str, url: str,
               body: dict[str, Any] | None = None) -> tuple[int, Any]:
    async with s.request(method, url, json=body) as resp:
        return resp.status, await resp.json()


def test_the_table_is_bounded_and_forgets_a_removed_replica() -> None:
    owners = ResponseOwners(3)
    for i in range(5):
        owners.note(f"resp_{i}", "http://a" if i % 2 else "http://b")
    assert len(owners) == 3 and owners.owner("resp_0") is None
    assert owners.owner("resp_4") == "http://b"
    assert owners.order("resp_3", ["http://b", "http://a"]) == ["http://a", "http://b"]
    owners.forget_worker("http://b")
    assert owners.owner("resp_4") is None and owners.owner("resp_3") == "http://a"


async def test_a_chain_stays_on_the_replica_that_holds_it(model_dir: Path) -> None:
    async with two_replicas(model_dir) as urls, routed(urls) as (url, router), \
            aiohttp.ClientSession() as s:
        prev = None
        ids = []
        for turn in range(6):  # distinct inputs: without the pin they would be spread
            body = {**BODY, "input": f"turn {turn} " * (turn + 1), "previous_response_id": prev}
            status, out = await call(s, "POST", f"{url}/v1/responses", body)
            assert status == 200, out
            prev = out["id"]
            ids.append(prev)
        holders = {u for u in urls for rid in ids
                   if (await call(s, "GET", f"{u}/v1/responses/{rid}"))[0] == 200}
        assert len(holders) == 1  # the whole chain on one replica
        assert {router.responses.owner(rid) for rid in ids} == holders
        status, out = await call(s, "GET", f"{url}/v1/responses/{prev}/input_items")
        assert status == 200 and len(out["data"]) == 11  # 6 inputs + 5 outputs
        assert (await call(s, "DELETE", f"{url}/v1/responses/{prev}"))[0] == 200
        status, out = await call(s, "GET", f"{url}/v1/responses/{prev}")
        assert status == 404 and out["error"]["code"] == "response_not_found"


async def test_a_restarted_router_finds_the_replica_and_a_lost_one_is_a_404(
        model_dir: Path) -> None:
    async with two_replicas(model_dir) as urls, aiohttp.ClientSession() as s:
        async with routed(urls) as (url, _):
            status, first = await call(s, "POST", f"{url}/v1/responses", {**BODY, "input": "a"})
            assert status == 200
        async with routed(urls) as (url, router):  # a new router: an empty table
            for turn in range(3):
                body = {**BODY, "input": f"next {turn}", "previous_response_id": first["id"]}
                status, out = await call(s, "POST", f"{url}/v1/responses", body)
                assert status == 200, out
            owner = router.responses.owner(first["id"])
            assert owner in urls
            # The holder loses it (deleted there directly): a clear 404, on every try.
            assert (await call(s, "DELETE", f"{owner}/v1/responses/{first['id']}"))[0] == 200
            body = {**BODY, "input": "again", "previous_response_id": first["id"]}
            status, out = await call(s, "POST", f"{url}/v1/responses", body)
            assert status == 404 and out["error"]["param"] == "previous_response_id"
            status, out = await call(s, "GET", f"{url}/v1/responses/{first['id']}")
            assert status == 404


@pytest.mark.parametrize("method", ["GET", "DELETE"])
async def test_an_unknown_id_is_a_404_through_the_router(model_dir: Path, method: str) -> None:
    async with two_replicas(model_dir) as urls, routed(urls) as (url, _), \
            aiohttp.ClientSession() as s:
        status, out = await call(s, method, f"{url}/v1/responses/resp_nope")
        assert status == 404 and out["error"]["type"] == "not_found_error"

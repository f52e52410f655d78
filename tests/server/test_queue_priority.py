"""Who a full queue refuses (issue 14): the least important request, which may be one already
admitted but still waiting for its first token; and priority per API key (default and floor).
Against a real aiohttp server over the fake engine (`max_running` makes requests wait)."""

from __future__ import annotations

import asyncio
import functools
import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import ClientResponse, web
from aiohttp.test_utils import TestClient

from radixserve.api.api_keys import parse_keys
from radixserve.config import ConfigError
from radixserve.server.access.auth import ANONYMOUS_CALLER, ApiKeys, Caller
from radixserve.server.access.limits import Admission
from radixserve.server.app_state import STATE_KEY
from radixserve.server.error_responses import APIError
from tests.server.test_app import GREEDY, TOKENIZER, serve
from tests.server_proc import running_server
from tests.waiting import wait_until

BATCH_KEY, VIP_KEY, PLAIN_KEY = "sk-batch-0123456789", "sk-vip-0123456789", "sk-plain-012345"
LONG_RUN = {"prompt": "abc", "max_tokens": 400, "stream": True, **GREEDY}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fake_model")
    TOKENIZER.save_pretrained(path)
    return path


def headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def post(tc: TestClient[Any, Any], body: dict[str, Any],
               key: str | None = None) -> ClientResponse:
    return await tc.post("/v1/completions", data=orjson.dumps(body), headers=headers(key))


async def queued(tc: TestClient[Any, Any], key: str | None = None) -> tuple[int, int]:
    """(engine requests admitted by the API process, requests waiting in the engine)."""
    resp = await tc.get("/server_info", headers=headers(key))
    info = await resp.json()
    return info["num_queued"], info["stats"].get("num_waiting", 0)


async def fill(tc: TestClient[Any, Any], waiting: list[dict[str, Any]],
               key: str | None = None) -> tuple[ClientResponse, list[asyncio.Task[Any]]]:
    """One long streaming request running (its first chunk read: started), then `waiting`
    posted one after the other, each admitted and waiting in the engine before the next."""
    running = await post(tc, LONG_RUN, key)
    assert running.status == 200
    await running.content.readline()
    tasks: list[asyncio.Task[Any]] = []
    for i, body in enumerate(waiting, 1):
        tasks.append(asyncio.create_task(post(tc, body, key)))

        async def admitted(n: int = i) -> bool:
            return await queued(tc, key) == (1 + n, n)

        await wait_until(admitted, what=f"{i} request(s) waiting")
    return running, tasks


async def metric(tc: TestClient[Any, Any], line_start: str) -> str | None:
    text = await (await tc.get("/metrics")).text()
    return next((ln for ln in text.splitlines() if ln.startswith(line_start)), None)


def low(priority: int, stream: bool = False) -> dict[str, Any]:
    return {"prompt": "xyz", "max_tokens": 2, "priority": priority, "stream": stream, **GREEDY}


async def test_important_request_displaces_the_least_important_waiting_one(
        model_dir: Path) -> None:
    async with serve(model_dir, step_interval=0.01, max_queue=3,
                     engine={"max_running": 1}) as tc:
        running, (older, newer) = await fill(tc, [low(5), low(5, stream=True)])
        high = asyncio.create_task(
            post(tc, {"prompt": "hello", "max_tokens": 2, "priority": 0, **GREEDY}))
        # Admitted at once: the newest of the least important waiting requests gave way
        # (a stream that had not started gets a real 429: its headers were not sent yet).
        displaced = await newer
        assert displaced.status == 429 and displaced.headers["Retry-After"] == "1"
        error = (await displaced.json())["error"]
        assert error["code"] == "queue_full" and error["type"] == "rate_limit_error"
        assert "displaced by a more important request" in error["message"]
        # Its engine request was aborted: only the older low one and the new one wait.
        await wait_until(lambda: _is(queued(tc), (3, 2)), what="the displaced request aborted")
        running.close()  # end the long one early (a disconnect)
        admitted = await high
        assert admitted.status == 200 and (await admitted.json())["choices"][0]["text"] == "he"
        assert (await older).status == 200
        assert await metric(tc, "radixserve:requests_displaced_total") == \
            'radixserve:requests_displaced_total{key_name="anonymous"} 1.0'

        async def two_aborted() -> bool:  # the displaced one and the disconnected one
            stats = (await (await tc.get("/server_info")).json())["stats"]
            return bool(stats["num_aborted_requests"] == 2 and stats["kv_held_tokens"] == 0)

        await wait_until(two_aborted, what="2 aborted requests, nothing held")


async def _is(coro: Any, expected: Any) -> bool:
    return bool(await coro == expected)


async def test_equal_or_lower_priority_newcomer_is_refused(model_dir: Path) -> None:
    async with serve(model_dir, step_interval=0.01, max_queue=3,
                     engine={"max_running": 1}) as tc:
        running, waiting = await fill(tc, [low(0), low(0)])
        for priority in (0, 7):
            resp = await post(tc, low(priority))
            assert resp.status == 429 and (await resp.json())["error"]["code"] == "queue_full"
            assert resp.headers["Retry-After"] == "1"
        assert await queued(tc) == (3, 2)
        running.close()
        assert [(await t).status for t in waiting] == [200, 200]
        assert await metric(tc, "radixserve:requests_displaced_total") is None


async def test_a_started_request_is_never_displaced(model_dir: Path) -> None:
    async with serve(model_dir, step_interval=0.01, max_queue=2,
                     engine={"max_running": 2}) as tc:
        streams = []
        for _ in range(2):
            resp = await post(tc, {**LONG_RUN, "max_tokens": 200, "priority": 9})
            assert resp.status == 200
            await resp.content.readline()  # producing tokens
            streams.append(resp)
        resp = await post(tc, low(-5))
        assert resp.status == 429 and (await resp.json())["error"]["code"] == "queue_full"
        for stream in streams:  # both run to their end, untouched
            events = [ln for ln in (await stream.text()).split("\n\n") if ln]
            assert events[-1] == "data: [DONE]" and '"error"' not in "".join(events)
            assert '"finish_reason":"length"' in events[-2]


def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [
        {"name": "batch", "key": BATCH_KEY, "priority": 5},
        {"name": "vip", "key": VIP_KEY, "priority": -3},
        {"name": "plain", "key": PLAIN_KEY}]}))
    return path


def record_priorities(seen: list[int]) -> Any:
    def hook(app: web.Application) -> None:
        client = app[STATE_KEY].client
        generate = client.generate

        def recording(msg: Any) -> Any:
            seen.append(msg.priority)
            return generate(msg)

        client.generate = recording  # type: ignore[method-assign]
    return hook


async def test_key_priority_is_the_default_and_the_floor(model_dir: Path,
                                                         tmp_path: Path) -> None:
    seen: list[int] = []
    async with serve(model_dir, api_keys_file=str(keys_file(tmp_path)),
                     app_hook=record_priorities(seen)) as tc:
        cases = [(BATCH_KEY, None, 5), (BATCH_KEY, 8, 8), (BATCH_KEY, -10, 5),
                 (VIP_KEY, None, -3), (VIP_KEY, -1, -1), (VIP_KEY, -9, -3),
                 (PLAIN_KEY, None, 0), (PLAIN_KEY, 3, 3), (PLAIN_KEY, -2, 0)]
        for key, asked, _ in cases:
            body = {"prompt": "abc", "max_tokens": 1, **GREEDY}
            if asked is not None:
                body["priority"] = asked
            assert (await post(tc, body, key)).status == 200
        assert seen == [expected for _, _, expected in cases]


async def test_key_priority_decides_who_a_full_queue_refuses(model_dir: Path,
                                                             tmp_path: Path) -> None:
    async with serve(model_dir, step_interval=0.01, max_queue=3, engine={"max_running": 1},
                     api_keys_file=str(keys_file(tmp_path))) as tc:
        no_priority = {"prompt": "xyz", "max_tokens": 2, **GREEDY}
        running, (first, second) = await fill(tc, [no_priority, no_priority], BATCH_KEY)
        # A batch request claiming priority -10 is held to its key's 5: an equal, refused.
        claim = await post(tc, {**no_priority, "priority": -10}, BATCH_KEY)
        assert claim.status == 429 and (await claim.json())["error"]["code"] == "queue_full"
        assert await queued(tc, BATCH_KEY) == (3, 2) and not second.done()
        # The vip key (priority -3, none in the request) displaces the newest batch request.
        vip = asyncio.create_task(post(tc, no_priority, VIP_KEY))
        assert (await second).status == 429
        running.close()
        assert (await vip).status == 200 and (await first).status == 200
        assert await metric(tc, "radixserve:requests_displaced_total") == \
            'radixserve:requests_displaced_total{key_name="batch"} 1.0'


@pytest.mark.parametrize("value", [True, 1.5, "1", 1_000_001, -1_000_001])
def test_keys_file_priority_is_validated(value: Any) -> None:
    with pytest.raises(ConfigError, match="'priority' must be an integer"):
        parse_keys({"keys": [{"name": "a", "key": "sk-a-0123456789", "priority": value}]})


def test_flag_and_admin_keys_priority() -> None:
    keys = ApiKeys(["sk-flag-0123456789"], admin_key="sk-admin-0123456789")
    flag = keys.authenticate("Bearer sk-flag-0123456789")
    admin = keys.authenticate("Bearer sk-admin-0123456789")
    assert (flag.priority_for(None), flag.priority_for(-4), flag.priority_for(4)) == (0, 0, 4)
    assert (admin.priority_for(None), admin.priority_for(-4)) == (0, -4)
    assert ANONYMOUS_CALLER.priority_for(-7) == -7 and ANONYMOUS_CALLER.priority_for(None) == 0


def caller(name: str) -> Caller:
    return Caller(name, ANONYMOUS_CALLER.limits, "")


def test_admission_displaces_least_important_newest_first_and_never_partially() -> None:
    adm = Admission(None, max_queue=4)
    with ExitStack() as stack:
        a = stack.enter_context(adm.admit(caller("a"), 1, priority=5))
        b = stack.enter_context(adm.admit(caller("b"), 1, priority=9))
        c = stack.enter_context(adm.admit(caller("c"), 1, priority=9))
        d = stack.enter_context(adm.admit(caller("d"), 1, priority=2))
        d.started = True
        # Two slots for a priority-5 newcomer: only b and c (9) are less important.
        e = stack.enter_context(adm.admit(caller("e"), 2, priority=5))
        assert (b.displaced, c.displaced, a.displaced, d.displaced) == (True, True, False, False)
        assert adm.num_queued == 4 and e.num_engine_requests == 2
        # Full again: a priority-1 request needing 3 slots would have to take a (5) and e (5)
        # (d started): that frees 3, so it fits; needing 4 it cannot, and nobody is displaced.
        with pytest.raises(APIError) as err:
            stack.enter_context(adm.admit(caller("f"), 4, priority=1))
        assert err.value.status == 429 and err.value.code == "queue_full"
        assert not a.displaced and not e.displaced
        g = stack.enter_context(adm.admit(caller("g"), 1, priority=1))
        assert e.displaced and not a.displaced  # e: same priority as a, but newer
        assert adm.num_queued == 4 - 2 + 1 and g.priority == 1
    assert adm.num_queued == 0 and adm.num_requests == 0


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_displacement_with_the_real_scheduler(tiny_llama: Path, tmp_path: Path) -> None:
    """`radixserve serve` on the tiny model, one running slot, a queue of 3: the displaced
    request leaves the engine's waiting queue at once and, at the end, every page is back
    (free + cached + held == total, nothing held, the engine's own integrity check passes)."""
    args = ["--max-queue", "3", "--max-running-requests", "1", "--kv-cache-tokens", "4096"]
    with running_server(tiny_llama, tmp_path / "server.log", args) as server:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
            async def state() -> tuple[int, int]:
                async with session.get(server.url + "/server_info") as resp:
                    info = await resp.json()
                return info["num_queued"], info["stats"].get("num_waiting", 0)

            async def aborted_once() -> bool:
                async with session.get(server.url + "/server_info") as resp:
                    stats = (await resp.json())["stats"]
                return bool(stats.get("num_aborted_requests") == 1
                            and stats.get("num_waiting", 0) <= 2)

            async def admitted(n: int) -> bool:  # API side: exact at once (engine stats lag)
                return (await state())[0] == n

            def send(body: dict[str, Any]) -> Any:
                return session.post(server.url + "/v1/completions", data=orjson.dumps(body))

            body = {"prompt": "hello there", "max_tokens": 4, "ignore_eos": True, **GREEDY}
            # The running one must outlast what follows (< 1 s); 1000 steps take several.
            running = await send({**body, "max_tokens": 1000, "stream": True, "priority": 5})
            assert running.status == 200
            await running.content.readline()
            waiting = []
            for n in (1, 2):
                waiting.append(asyncio.create_task(send({**body, "priority": 5})))
                await wait_until(functools.partial(admitted, 1 + n), timeout=60,
                                 what=f"{n} admitted")
            high = asyncio.create_task(send({**body, "priority": -1}))
            displaced = await waiting[1]
            assert displaced.status == 429
            assert (await displaced.json())["error"]["code"] == "queue_full"
            # The engine aborts it (its own counter, not the API's), whether or not the running
            # request is still decoding by then (its 1000 steps take ~1-2 s on a fast CPU).
            await wait_until(aborted_once, timeout=60,
                             what="the displaced request gone from the engine")
            running.close()
            for task in (waiting[0], high):
                resp = await task
                assert resp.status == 200
                assert (await resp.json())["usage"]["completion_tokens"] == 4
        idle = server.wait_idle()
        # The close aborts the running request unless all its 1000 tokens were out by then (a
        # fast CPU decodes them in ~1-2 s): the displaced one, and that one if it still ran.
        ran_out = idle["generation_tokens"] == 1000 + 2 * 4
        assert idle["num_aborted_requests"] == (1 if ran_out else 2), idle
        assert idle["kv_held_tokens"] == 0

        def integrity_ok() -> bool:
            return server.info()["stats"].get("integrity_ok") is True

        await wait_until(integrity_ok, what="the engine's idle integrity check")
        out = server.output()
        assert "Traceback" not in out, out

"""Stateful Responses against the fake engine, in-process: `store` (default true),
`previous_response_id` (the chained prompt is exactly the full-history request's), GET /
DELETE /v1/responses/{id} and input_items through the openai SDK, one key's responses hidden
from another, the bounded store (LRU), and streaming through a chain."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from radixserve.ipc.messages import GenerateMsg
from tests.server.routes.test_responses import RESP_BODY, WEATHER_TOOL, sse
from tests.server.test_tools import CALL_TEXT, model_dir, post, serve

__all__ = ["model_dir"]


async def get(tc: Any, path: str, key: str | None = None, method: str = "GET"
              ) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    resp = await tc.request(method, path, headers=headers)
    return resp.status, orjson.loads(await resp.read())


async def post_as(tc: Any, body: dict[str, Any], key: str) -> tuple[int, Any]:
    resp = await tc.post("/v1/responses", data=orjson.dumps(body),
                         headers={"Authorization": f"Bearer {key}"})
    return resp.status, orjson.loads(await resp.read())


async def test_a_chain_renders_as_the_full_history_request(model_dir: Path) -> None:
    seen: list[GenerateMsg] = []
    turns = ["Hello there", [{"role": "user", "content": "And then?"}], "Last one"]
    async with serve(model_dir, seen) as tc:
        client = openai.AsyncOpenAI(base_url=str(tc.make_url("/v1")), api_key="x")
        history: list[Any] = []
        prev = None
        for turn in turns:
            items = [{"role": "user", "content": turn}] if isinstance(turn, str) else turn
            chained = await client.responses.create(
                model="m", input=turn, instructions="Be brief.", temperature=0,
                max_output_tokens=40, previous_response_id=prev)  # type: ignore[arg-type]
            full = await client.responses.create(
                model="m", input=[*history, *items], instructions="Be brief.", temperature=0,
                max_output_tokens=40, store=False)
            assert seen[-2].prompt_ids == seen[-1].prompt_ids  # exactly the same prompt
            assert chained.output_text == full.output_text
            assert (chained.store, full.store) == (True, False)
            assert chained.previous_response_id == prev
            history += [*items, *[o.model_dump(exclude_none=True) for o in chained.output]]
            prev = chained.id
        got = await client.responses.retrieve(prev)
        assert got.id == prev and got.output_text == chained.output_text
        listed = await client.responses.input_items.list(prev, order="asc")
        assert [i.type for i in listed.data] == ["message"] * 5
        assert [i.model_dump()["role"] for i in listed.data] == ["user", "assistant", "user",
                                                                    "assistant", "user"]
        assert (await get(tc, f"/v1/responses/{full.id}"))[0] == 404  # store: false
        newest = await get(tc, f"/v1/responses/{prev}/input_items?limit=2")
        assert newest[1]["has_more"] and newest[1]["data"][0]["id"] == listed.data[-1].id
        await client.responses.delete(prev)
        status, body = await get(tc, f"/v1/responses/{prev}")
        assert status == 404 and body["error"]["code"] == "response_not_found"
        with pytest.raises(openai.NotFoundError) as info:
            await client.responses.create(model="m", input="more", previous_response_id=prev)
        assert info.value.body["param"] == "previous_response_id"  # type: ignore[index]
        await client.close()


async def test_tools_and_streaming_through_a_chain(model_dir: Path) -> None:
    async with serve(model_dir) as tc:
        body = {**RESP_BODY, "tools": [WEATHER_TOOL], "input": [
            {"role": "system", "content": CALL_TEXT}, {"role": "user", "content": "Paris?"}]}
        resp = await tc.post("/v1/responses", data=orjson.dumps(body))
        first = orjson.loads(await resp.read())
        assert resp.headers["X-Response-Id"] == first["id"]
        call = next(o for o in first["output"] if o["type"] == "function_call")
        follow = {**RESP_BODY, "tools": [WEATHER_TOOL], "previous_response_id": first["id"],
                  "input": [{"type": "function_call_output", "call_id": call["call_id"],
                             "output": '{"temp": 21}'}]}
        events = await sse(tc, follow)
        done = events[-1]["response"]
        assert done["status"] == "completed" and done["previous_response_id"] == first["id"]
        status, again = await get(tc, f"/v1/responses/{done['id']}")
        assert status == 200 and again == done  # stored as streamed
        status, items = await get(tc, f"/v1/responses/{done['id']}/input_items?order=asc")
        kinds = [i["type"] for i in items["data"]]
        assert kinds == ["message", "message", "message", "function_call",
                         "function_call_output"]


async def test_a_response_is_visible_only_to_its_key(model_dir: Path) -> None:
    async with serve(model_dir, api_keys=("key-a", "key-b")) as tc:
        status, mine = await post_as(tc, {**RESP_BODY, "input": "secret"}, "key-a")
        assert status == 200
        rid = mine["id"]
        assert (await get(tc, f"/v1/responses/{rid}", "key-a"))[0] == 200
        for path in (f"/v1/responses/{rid}", f"/v1/responses/{rid}/input_items"):
            status, body = await get(tc, path, "key-b")
            assert status == 404 and body["error"]["type"] == "not_found_error"
        assert (await get(tc, f"/v1/responses/{rid}", "key-b", "DELETE"))[0] == 404
        status, body = await post_as(tc, {**RESP_BODY, "input": "go on",
                                          "previous_response_id": rid}, "key-b")
        assert status == 404 and body["error"]["param"] == "previous_response_id"
        status, _ = await post_as(tc, {**RESP_BODY, "input": "go on",
                                       "previous_response_id": rid}, "key-a")
        assert status == 200  # still there for its owner


async def test_a_bounded_store_drops_the_least_recently_used(model_dir: Path) -> None:
    async with serve(model_dir, responses_store_size=4) as tc:
        ids = []
        for i in range(10):
            status, out = await post(tc, {**RESP_BODY, "input": f"turn {i}"}, "/v1/responses")
            assert status == 200
            ids.append(out["id"])
        codes = [(await get(tc, f"/v1/responses/{rid}"))[0] for rid in ids]
        assert codes == [404] * 6 + [200] * 4
        for rid in ids[:6]:
            status, body = await post(tc, {**RESP_BODY, "input": "more",
                                           "previous_response_id": rid}, "/v1/responses")
            assert status == 404 and body["error"]["param"] == "previous_response_id"
        await get(tc, f"/v1/responses/{ids[6]}")  # a read is a use: ids[7] is now the oldest
        status, out = await post(tc, {**RESP_BODY, "input": "x"}, "/v1/responses")
        assert status == 200
        assert (await get(tc, f"/v1/responses/{ids[7]}"))[0] == 404
        assert (await get(tc, f"/v1/responses/{ids[6]}"))[0] == 200


@pytest.mark.parametrize(("query", "param"), [("limit=0", "limit"), ("order=up", "order"),
                                              ("after=nope", "after")])
async def test_bad_input_items_query_is_a_400(model_dir: Path, query: str, param: str) -> None:
    async with serve(model_dir) as tc:
        _, out = await post(tc, {**RESP_BODY, "input": "hi"}, "/v1/responses")
        status, body = await get(tc, f"/v1/responses/{out['id']}/input_items?{query}")
        assert status == 400 and body["error"]["param"] == param

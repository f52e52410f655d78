"""POST /v1/responses (the OpenAI Responses API) against the fake engine, in-process: the
openai SDK as the client (`client.responses.create`, whole and streamed), what reaches the
engine (the same prompt and constraints as the equivalent chat request), the Response object
and its typed events, and every unsupported or malformed input as OpenAI's 400 body.

The fake engine echoes its prompt: a system message holding a call makes the "model" answer
with that call (test_tools_server.py's trick).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from radixserve.constraints import ConstraintKind
from radixserve.ipc.messages import GenerateMsg
from tests.server.test_tools import CALL_TEXT, WEATHER, model_dir, post, serve

__all__ = ["model_dir"]  # the module-scoped fixture, shared

WEATHER_TOOL = {"type": "function", **WEATHER["function"]}  # the Responses API's flat shape
CHAT_BODY: dict[str, Any] = {"model": "m", "temperature": 0, "max_tokens": 120}
RESP_BODY: dict[str, Any] = {"model": "m", "temperature": 0, "max_output_tokens": 120}


async def sse(tc: Any, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The typed events of a streamed response; checks that each SSE event name is its type."""
    resp = await tc.post("/v1/responses", data=orjson.dumps({**body, "stream": True}))
    assert resp.status == 200, await resp.text()
    out = []
    for block in (await resp.text()).strip().split("\n\n"):
        name, data = block.split("\n")
        event = orjson.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        out.append(event)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


@pytest.mark.parametrize(("items", "messages"), [
    ("Hello there", [{"role": "user", "content": "Hello there"}]),
    ([{"role": "developer", "content": "Be brief."},
      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
      {"role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
      {"type": "function_call", "call_id": "call_1", "name": "get_weather",
       "arguments": '{"city": "Paris"}'},
      {"type": "function_call_output", "call_id": "call_1", "output": '{"temp": 21}'}],
     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Checking.", "tool_calls": [
          {"id": "call_1", "type": "function",
           "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]),
], ids=["string", "items"])
async def test_input_reaches_the_engine_as_the_chat_request_does(
        model_dir: Path, items: Any, messages: list[dict[str, Any]]) -> None:
    seen: list[GenerateMsg] = []
    async with serve(model_dir, seen) as tc:
        status, out = await post(tc, {**RESP_BODY, "input": items, "instructions": "Rule 1.",
                                      "tools": [WEATHER_TOOL]}, "/v1/responses")
        assert status == 200, out
        chat = {**CHAT_BODY, "tools": [WEATHER],
                "messages": [{"role": "system", "content": "Rule 1."}, *messages]}
        status, _ = await post(tc, chat)
        assert status == 200
    assert seen[0].prompt_ids == seen[1].prompt_ids
    assert seen[0].params == seen[1].params
    assert out["usage"]["input_tokens"] == len(seen[0].prompt_ids)


async def test_sdk_response_object(model_dir: Path) -> None:
    async with serve(model_dir) as tc:
        client = openai.AsyncOpenAI(base_url=str(tc.make_url("/v1")), api_key="x")
        resp = await client.responses.create(model="m", input="Say hi", instructions="Greet.",
                                             temperature=0, max_output_tokens=200,
                                             metadata={"run": "7"})
        assert resp.id.startswith("resp_") and resp.object == "response"
        assert resp.status == "completed" and resp.incomplete_details is None
        assert (resp.instructions, resp.metadata, resp.store) == ("Greet.", {"run": "7"}, True)
        (item,) = resp.output
        assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
        # the fake engine echoes the rendered prompt up to its first end of turn
        assert resp.output_text == "system\nGreet."
        u = resp.usage
        assert u is not None and u.total_tokens == u.input_tokens + u.output_tokens
        assert u.output_tokens > 0 and u.input_tokens_details.cached_tokens == 0
        cut = u.output_tokens - 1  # the same request, stopped one token short
        short = await client.responses.create(model="m", input="Say hi", instructions="Greet.",
                                              temperature=0, max_output_tokens=cut)
        assert short.status == "incomplete" and short.output[0].status == "incomplete"
        assert short.incomplete_details is not None
        assert short.incomplete_details.reason == "max_output_tokens"
        assert short.usage is not None and short.usage.output_tokens == cut
        await client.close()


async def test_streamed_text_matches_the_whole_response(model_dir: Path) -> None:
    body = {**RESP_BODY, "input": "Tell me about Paris"}
    async with serve(model_dir) as tc:
        status, whole = await post(tc, body, "/v1/responses")
        events = await sse(tc, body)
        assert status == 200
        client = openai.AsyncOpenAI(base_url=str(tc.make_url("/v1")), api_key="x")
        stream = await client.responses.create(stream=True, **body)
        sdk_text = "".join([e.delta async for e in stream if e.type == "response.output_text.delta"])
        await client.close()
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == sdk_text == whole["output"][0]["content"][0]["text"]
    final = events[-1]["response"]
    assert final["status"] == "completed"
    for key in ("input_tokens", "output_tokens", "total_tokens"):
        assert final["usage"][key] == whole["usage"][key]
    assert final["usage"]["input_tokens_details"]["cached_tokens"] > 0  # the same prompt again
    assert final["output"][0]["content"][0]["text"] == text
    assert events[0]["response"]["status"] == "in_progress"


async def test_tool_call_is_a_function_call_item_whole_and_streamed(model_dir: Path) -> None:
    body = {**RESP_BODY, "tools": [WEATHER_TOOL], "input": [
        {"role": "system", "content": CALL_TEXT}, {"role": "user", "content": "Paris?"}]}
    seen: list[GenerateMsg] = []
    async with serve(model_dir, seen) as tc:
        client = openai.AsyncOpenAI(base_url=str(tc.make_url("/v1")), api_key="x")
        resp = await client.responses.create(**body)
        events = await sse(tc, body)
        await client.close()
    constraint = seen[0].params.constraint
    assert constraint is not None and constraint.kind is ConstraintKind.TOOL_CALLS
    msg, call = resp.output
    assert msg.type == "message" and resp.output_text == "system"  # the text before the call
    assert call.type == "function_call" and call.call_id.startswith("call_")
    assert (call.name, json.loads(call.arguments), call.status) == (
        "get_weather", {"city": "Paris"}, "completed")
    kinds = [e["type"] for e in events]
    opened = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert opened == ["message", "function_call"]
    at = kinds.index("response.function_call_arguments.done")
    assert kinds[at + 1:] == ["response.output_item.done", "response.completed"]
    args = "".join(e["delta"] for e in events
                   if e["type"] == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"} == json.loads(events[at]["arguments"])
    done = events[-1]["response"]["output"]
    assert [o["type"] for o in done] == ["message", "function_call"]
    assert done[1]["name"] == "get_weather" and done[1]["arguments"] == args


async def test_text_format_json_schema_constrains_the_output(model_dir: Path) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    seen: list[GenerateMsg] = []
    async with serve(model_dir, seen) as tc:
        status, out = await post(tc, {**RESP_BODY, "input": "JSON please", "text": {"format": {
            "type": "json_schema", "name": "answer", "schema": schema, "strict": True}}},
            "/v1/responses")
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                      "strict": True}}
        chat = {**CHAT_BODY, "messages": [{"role": "user", "content": "JSON please"}],
                "response_format": fmt}
        assert (await post(tc, chat))[0] == 200
    assert status == 200, out
    constraint = seen[0].params.constraint
    assert constraint is not None and constraint.kind is ConstraintKind.JSON_SCHEMA
    assert seen[0].params == seen[1].params  # as chat's response_format
    assert out["text"]["format"]["name"] == "answer"


async def test_text_logprobs_whole_and_streamed_match_chat(model_dir: Path) -> None:
    body = {**RESP_BODY, "input": "Count to three", "top_logprobs": 2,
            "include": ["message.output_text.logprobs"]}
    seen: list[GenerateMsg] = []
    async with serve(model_dir, seen) as tc:
        status, whole = await post(tc, body, "/v1/responses")
        events = await sse(tc, body)
        chat = {**CHAT_BODY, "messages": [{"role": "user", "content": "Count to three"}],
                "logprobs": True, "top_logprobs": 2}
        status_chat, chat_out = await post(tc, chat)
    assert status == status_chat == 200, whole
    assert seen[0].params == seen[2].params and seen[0].params.logprobs == 2
    lps = whole["output"][0]["content"][0]["logprobs"]
    assert lps == chat_out["choices"][0]["logprobs"]["content"]
    assert len(lps) == whole["usage"]["output_tokens"]
    assert all(len(e["top_logprobs"]) == 2 for e in lps)
    streamed = [e for ev in events if ev["type"] == "response.output_text.delta"
                for e in ev["logprobs"]]
    done = next(ev for ev in events if ev["type"] == "response.output_text.done")
    assert streamed == done["logprobs"] == lps


@pytest.mark.parametrize(("fields", "param"), [
    ({"input": None}, "input"),
    ({"input": []}, "input"),
    ({"previous_response_id": 5}, "previous_response_id"),
    ({"store": "yes"}, "store"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 7}]},
     "input[0].output"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
     "input[0].arguments"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"tool_choice": {"type": "mcp"}}, "tool_choice"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"instructions": 5}, "instructions"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without include: nothing would show them
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
    ({"include": ["message.output_text.logprobs"], "tools": [WEATHER_TOOL]}, "include"),
    ({"frobnicate": 1}, "frobnicate"),
])
async def test_bad_input_is_openais_400(model_dir: Path, fields: dict[str, Any],
                                        param: str) -> None:
    async with serve(model_dir) as tc:
        status, out = await post(tc, {**RESP_BODY, "input": "hi", **fields}, "/v1/responses")
        assert status == 400, out
        assert out["error"]["type"] == "invalid_request_error" and out["error"]["param"] == param
        status, _ = await post(tc, {**RESP_BODY, "input": "hi"}, "/v1/responses")
        assert status == 200  # still serving

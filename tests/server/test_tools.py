"""Tools and response_format over HTTP against the fake engine (in-process), driven with raw
requests and with the openai SDK: the wire format of calls (whole and streamed), what reaches
the engine, cache hits on repeated tools, and every bad input as OpenAI's 400 body.

The fake engine echoes its prompt, so a system message that holds a call makes the "model"
answer with that call (after the word "system": the template's role line).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from radixserve.config import EngineConfig, ServerConfig
from radixserve.constraints import Constraint, ConstraintKind, ToolMode
from radixserve.ipc.client import EngineClient
from radixserve.ipc.messages import GenerateMsg
from radixserve.server.app import create_app
from radixserve.testing.fake_engine import FakeEngine, InlineTransport
from tests.tiny_models import make_tokenizer
from tests.waiting import wait_until

TOKENIZER = make_tokenizer()
EOS = int(TOKENIZER.convert_tokens_to_ids("<|im_end|>"))  # type: ignore[arg-type]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ECHO_CALL = [{"role": "system", "content": CALL_TEXT},
             {"role": "user", "content": "Weather in Paris?"}]
BODY = {"model": "m", "messages": ECHO_CALL, "tools": [WEATHER], "temperature": 0,
        "max_tokens": 120}


class RecordingEngine(FakeEngine):
    """The fake engine, keeping every request it was given."""

    def __init__(self, cfg: EngineConfig, seen: list[GenerateMsg]) -> None:
        super().__init__(cfg, eos_token_ids=(EOS,))
        self.seen = seen

    def add_request(self, msg: GenerateMsg) -> None:
        self.seen.append(msg)
        super().add_request(msg)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fake_model") / "m"
    TOKENIZER.save_pretrained(path)
    return path


@contextlib.asynccontextmanager
async def serve(model_dir: Path, seen: list[GenerateMsg] | None = None,
                **server_kwargs: Any) -> AsyncIterator[TestClient[Any, Any]]:
    cfg = ServerConfig(engine=EngineConfig(model=str(model_dir), max_model_len=4096),
                       **server_kwargs)
    record: list[GenerateMsg] = [] if seen is None else seen
    transport = InlineTransport(lambda c: RecordingEngine(c, record), cfg.engine, 0.0)
    app = create_app(cfg, EngineClient(transport))
    async with TestClient(TestServer(app)) as tc:
        async def healthy() -> bool:
            return (await tc.get("/health")).status == 200

        await wait_until(healthy, what="a healthy server")
        yield tc


async def post(tc: TestClient[Any, Any], body: Any, path: str = "/v1/chat/completions") -> tuple[int, Any]:
    resp = await tc.post(path, data=orjson.dumps(body))
    return resp.status, orjson.loads(await resp.read())


async def events(tc: TestClient[Any, Any], body: Any) -> list[dict[str, Any]]:
    resp = await tc.post("/v1/chat/completions", data=orjson.dumps({**body, "stream": True}))
    assert resp.status == 200, await resp.text()
    lines = [x[6:] for x in (await resp.text()).split("\n\n") if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [orjson.loads(x) for x in lines[:-1]]


async def test_a_call_in_the_output_becomes_message_tool_calls(model_dir: Path) -> None:
    seen: list[GenerateMsg] = []
    async with serve(model_dir, seen) as tc:
        status, out = await post(tc, BODY)
    assert status == 200, out
    (choice,) = out["choices"]
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_")
    assert choice == {"index": 0, "logprobs": None, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "system", "tool_calls": [
            {"id": call["id"], "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}}
    constraint = seen[0].params.constraint
    assert constraint is not None and constraint.kind is ConstraintKind.TOOL_CALLS
    assert constraint.tool_calls is not None and constraint.tool_calls.mode is ToolMode.AUTO
    assert constraint.tool_calls.call_format == "hermes"


async def test_streamed_call_deltas(model_dir: Path) -> None:
    async with serve(model_dir) as tc:
        chunks = await events(tc, BODY)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    at = next(i for i, d in enumerate(deltas) if "tool_calls" in d)
    assert "".join(d["content"] for d in deltas[1:at]) == "system"  # streamed as it came
    header = deltas[at]["tool_calls"][0]
    assert header["id"].startswith("call_") and header["index"] == 0
    assert header == {"index": 0, "id": header["id"], "type": "function",
                      "function": {"name": "get_weather", "arguments": ""}}
    fragments = [d["tool_calls"][0]["function"]["arguments"] for d in deltas[at + 1:] if d]
    assert len(fragments) > 1 and "".join(fragments) == '{"city": "Paris"}'
    assert all(set(d) <= {"tool_calls"} for d in deltas[at + 1:])
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "tool_calls" and set(finishes[:-1]) == {None}


async def test_openai_sdk_reads_calls_whole_and_streamed(model_dir: Path) -> None:
    async with serve(model_dir) as tc:
        client = openai.AsyncOpenAI(base_url=str(tc.make_url("/v1")), api_key="x")
        kwargs: dict[str, Any] = {"model": "m", "messages": ECHO_CALL, "tools": [WEATHER],
                                  "tool_choice": "auto", "temperature": 0, "max_tokens": 120}
        resp = await client.chat.completions.create(**kwargs)
        call = resp.choices[0].message.tool_calls[0]
        assert resp.choices[0].finish_reason == "tool_calls"
        assert call.type == "function" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        names, args, finish = [], "", None
        async for chunk in await client.chat.completions.create(stream=True, **kwargs):
            for part in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                names += [part.function.name] if part.function and part.function.name else []
                args += part.function.arguments or "" if part.function else ""
            finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
        assert (names, json.loads(args), finish) == (["get_weather"], {"city": "Paris"},
                                                     "tool_calls")
        await client.close()


async def test_tool_choice_none_shows_tools_but_returns_text(model_dir: Path) -> None:
    seen: list[GenerateMsg] = []
    async with serve(model_dir, seen) as tc:
        _, out = await post(tc, {**BODY, "tool_choice": "none"})
    assert out["choices"][0]["message"] == {"role": "assistant",
                                            "content": out["choices"][0]["message"]["content"]}
    assert out["choices"][0]["message"]["content"].startswith("system\n" + CALL_TEXT)
    assert out["choices"][0]["finish_reason"] == "length"
    assert seen[0].params.constraint is None
    prompt = TOKENIZER.decode(seen[0].prompt_ids)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt


async def test_constraints_reach_the_engine(model_dir: Path) -> None:
    seen: list[GenerateMsg] = []
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    async with serve(model_dir, seen, tool_call_parser="llama3_json") as tc:
        await post(tc, {**BODY, "tool_choice": {"type": "function",
                                                "function": {"name": "get_weather"}}})
        await post(tc, {"prompt": "x", "max_tokens": 2, "response_format": {
            "type": "json_schema", "json_schema": {"name": "a", "schema": schema}}},
            "/v1/completions")
        await post(tc, {"messages": ECHO_CALL, "max_tokens": 2,
                        "response_format": {"type": "json_object"}})
    named, schema_c, obj = (m.params.constraint for m in seen)
    assert named is not None and named.tool_calls is not None
    assert named.tool_calls.mode is ToolMode.NAMED and named.tool_calls.call_format == "llama3_json"
    assert schema_c == Constraint(ConstraintKind.JSON_SCHEMA, orjson.dumps(schema).decode())
    assert obj == Constraint(ConstraintKind.JSON_OBJECT)


async def test_repeated_tools_hit_the_cache(model_dir: Path) -> None:
    body = {**BODY, "messages": ECHO_CALL[1:], "max_tokens": 4}
    async with serve(model_dir) as tc:
        _, first = await post(tc, body)
        _, second = await post(tc, {**body, "messages": [
            *ECHO_CALL[1:], {"role": "assistant", "content": "Let me see."},
            {"role": "user", "content": "And in Rome?"}]})
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 500


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
     "tools[0].function.parameters"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "file_search"}]}, "tools[0].type"),
    ({"messages": [{"role": "tool", "content": "21C"}]}, "messages[0].tool_call_id"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objct"}}},
      "tool_choice": "none"}, "response_format"),
])
async def test_bad_input_is_openais_400(model_dir: Path, fields: dict[str, Any],
                                        param: str) -> None:
    async with serve(model_dir) as tc:
        status, out = await post(tc, {**BODY, **fields})
        assert status == 400, out
        assert set(out["error"]) == {"message", "type", "param", "code"}
        assert out["error"]["type"] == "invalid_request_error" and out["error"]["param"] == param
        status, _ = await post(tc, BODY)  # still serving
        assert status == 200

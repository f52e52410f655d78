"""Tool calls and structured output end to end: the real server with the default model
(SmolLM2-135M, whose template has no tool support: the Hermes fallback), the engine's grammar
enforcement, and the openai SDK as the client. One server for the module; small max_tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from tests.repo import DOCS
from tests.server.tool_server import MODEL, SCHEMAS, TOOLS, smollm2_sdk, weather_agent

pytestmark = [pytest.mark.slow, pytest.mark.smollm2]
QUESTIONS = ["What is the weather like in Paris?", "What is 12 plus 30?",
             "Tell me a joke about cats."]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    with smollm2_sdk(tmp_path_factory.mktemp("tools_server") / "server.log") as sdk:
        yield sdk


def chat(client: openai.OpenAI, messages: list[Any], **kwargs: Any) -> Any:
    args = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 60,
            "tools": TOOLS, **kwargs}
    return client.chat.completions.create(**args)


def streamed(client: openai.OpenAI, messages: list[Any], **kwargs: Any
             ) -> tuple[str, list[dict[str, str]], str | None]:
    """(content, calls, finish_reason), assembled from the deltas as an SDK user does."""
    content, finish = "", None
    calls: list[dict[str, str]] = []
    for chunk in chat(client, messages, stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            if part.id is not None:
                assert part.index == len(calls) and part.type == "function"
                assert part.function is not None and part.function.name
                calls.append({"id": part.id, "name": part.function.name, "arguments": ""})
            assert part.function is not None
            calls[part.index]["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


def check_call(name: str, arguments: str, allowed: set[str]) -> None:
    assert name in allowed
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("parallel", [False, True])
def test_required_always_calls_with_valid_arguments(client: openai.OpenAI,
                                                    parallel: bool) -> None:
    for question in QUESTIONS:
        resp = chat(client, [{"role": "user", "content": question}], tool_choice="required",
                    parallel_tool_calls=parallel)
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        assert len(choice.message.tool_calls) == 1 or parallel
        for call in choice.message.tool_calls:
            assert call.id.startswith("call_")
            check_call(call.function.name, call.function.arguments, {"get_weather", "add"})


def test_named_always_calls_that_function(client: openai.OpenAI) -> None:
    for question, name in zip(QUESTIONS, ["add", "get_weather", "add"], strict=True):
        choice = {"type": "function", "function": {"name": name}}
        resp = chat(client, [{"role": "user", "content": question}], tool_choice=choice,
                    parallel_tool_calls=False)
        (call,) = resp.choices[0].message.tool_calls
        assert resp.choices[0].finish_reason == "tool_calls"
        check_call(call.function.name, call.function.arguments, {name})
        content, calls, finish = streamed(client, [{"role": "user", "content": question}],
                                          tool_choice=choice, parallel_tool_calls=False)
        assert (content, finish, len(calls)) == ("", "tool_calls", 1)
        assert [calls[0]["name"], calls[0]["arguments"]] == [call.function.name,
                                                             call.function.arguments]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_round_trip(client: openai.OpenAI, stream: bool) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the weather like in Paris?"}]
    first = chat(client, messages, tool_choice="required", parallel_tool_calls=False)
    if stream:
        _, calls, finish = streamed(client, messages, tool_choice="required",
                                    parallel_tool_calls=False)
        assert finish == "tool_calls" and len(calls) == 1
        call_id, name, arguments = calls[0]["id"], calls[0]["name"], calls[0]["arguments"]
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": arguments}}]})
    else:
        messages.append(first.choices[0].message)  # the SDK's own object goes back as-is
        call = first.choices[0].message.tool_calls[0]
        call_id, name, arguments = call.id, call.function.name, call.function.arguments
    check_call(name, arguments, {"get_weather", "add"})
    result = json.dumps({"temperature": 21, "unit": "celsius", "sky": "sunny"})
    messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
    if stream:
        content, calls, finish = streamed(client, messages, max_tokens=40)
    else:
        final = chat(client, messages, max_tokens=40)
        content, calls = final.choices[0].message.content, final.choices[0].message.tool_calls
        finish = final.choices[0].finish_reason
        # The tools, the question and the start of the call come from the cache. (The call is
        # written back as the model wrote it, but the grammar may have made the model spell it
        # in other tokens than the tokenizer does, so the match may stop inside the call.)
        cached = final.usage.prompt_tokens_details.cached_tokens
        assert cached > first.usage.prompt_tokens
    assert finish in ("stop", "length") and not calls
    assert isinstance(content, str) and content.strip()


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}
FORECAST = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "days": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "additionalProperties": False, "required": ["day", "temp"],
        "properties": {"day": {"enum": ["mon", "tue", "wed"]},
                       "temp": {"type": "integer", "minimum": -30, "maximum": 50}}}}},
    "required": ["city", "days"], "additionalProperties": False}
CODE = {"type": "object", "properties": {"code": {"type": "string",
                                                  "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"], "additionalProperties": False}


@pytest.mark.parametrize("schema", [PERSON, FORECAST, CODE], ids=["person", "forecast", "code"])
def test_response_format_json_schema_validates(client: openai.OpenAI,
                                               schema: dict[str, Any]) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                  "strict": True}}
    messages = [{"role": "user", "content": "Describe the weather in Paris as JSON."}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          max_tokens=100, response_format=fmt)  # type: ignore
    assert resp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(resp.choices[0].message.content or ""), schema)
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=100, response_format=fmt,
        stream=True) if c.choices)  # type: ignore
    assert text == resp.choices[0].message.content
    completion = client.completions.create(model=MODEL, prompt="A JSON answer:", max_tokens=100,
                                           temperature=0, extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(completion.choices[0].text), schema)


def test_repeated_tools_request_hits_the_cache(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Add 2 and 2, please."}]
    first = chat(client, messages, max_tokens=4, tool_choice="none")
    again = chat(client, messages, max_tokens=4, tool_choice="none")
    tokens = first.usage.prompt_tokens
    assert again.usage.prompt_tokens == tokens and tokens > 200  # the tool list is in the prompt
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.usage.prompt_tokens_details.cached_tokens >= tokens - 1


def test_bad_tool_input_is_a_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, [{"role": "user", "content": "hi"}],
             tool_choice={"type": "function", "function": {"name": "nope"}})
    assert info.value.body["param"] == "tool_choice"  # type: ignore[index]
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objct"}}}]
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, [{"role": "user", "content": "hi"}], tools=bad)
    assert info.value.body["param"] == "tools[0].function.parameters"  # type: ignore[index]


def run_docs_example(client: openai.OpenAI, heading: str) -> dict[str, Any]:
    """The first python block under `heading` in docs/agents.md, run as written against this
    server (its documented base_url swapped for the test server's); returns its globals."""
    page = (DOCS / "agents.md").read_text()
    code = page.split(heading, 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert 'base_url="http://127.0.0.1:30000/v1"' in code
    code = code.replace("http://127.0.0.1:30000/v1", str(client.base_url))
    scope: dict[str, Any] = {}
    exec(compile(code, "docs/agents.md", "exec"), scope)  # noqa: S102
    return scope


def test_docs_agents_example_runs_as_written(client: openai.OpenAI) -> None:
    """docs/agents.md's openai SDK example, pointed at this server: the calls and checks it
    promises."""
    scope = run_docs_example(client, "# Agents: tool calls and structured output")
    assert scope["call"].function.name == "get_weather"
    assert isinstance(json.loads(scope["call"].function.arguments)["city"], str)
    assert scope["final"].usage.prompt_tokens_details.cached_tokens > 0
    jsonschema.validate(json.loads(scope["r"].choices[0].message.content), scope["person"])


def test_docs_responses_example_runs_as_written(client: openai.OpenAI) -> None:
    """docs/agents.md's Responses API example: a call through /v1/responses, its output items passed
    back as input with the result, a final answer from the cache, and a schema-valid JSON."""
    scope = run_docs_example(client, "## The Responses API")
    call = scope["call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), scope["tools"][0]["parameters"])
    final = scope["final"]
    assert final.status in ("completed", "incomplete") and final.output_text.strip()
    assert not [item for item in final.output if item.type == "function_call"]
    assert final.usage.input_tokens_details.cached_tokens > 0  # the history was cached
    assert scope["r"].status == "completed"
    jsonschema.validate(json.loads(scope["r"].output_text), scope["person"])


@pytest.mark.parametrize("streamed", [False, True])
async def test_openai_agents_sdk_runs_a_tool_loop(client: openai.OpenAI, streamed: bool) -> None:
    """The OpenAI Agents SDK (its default model class calls /v1/responses): the model calls
    the tool, the SDK runs it and sends the result back, the model answers."""
    import agents

    seen: list[str] = []
    sdk, agent = weather_agent(
        client, seen,
        agents.ModelSettings(temperature=0, max_tokens=80, tool_choice="required",
                             parallel_tool_calls=False),
        reset_tool_choice=True)  # after the call, the model may answer in text
    question = "What is the weather like in Paris?"
    if streamed:
        run = agents.Runner.run_streamed(agent, question, max_turns=4)
        kinds = [e.type async for e in run.stream_events()]
        assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
        result: Any = run
    else:
        result = await agents.Runner.run(agent, question, max_turns=4)
    await sdk.close()
    items = [type(item).__name__ for item in result.new_items]
    assert items == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert seen == ["Paris"]
    assert isinstance(result.final_output, str) and result.final_output.strip()


async def test_openai_agents_sdk_structured_output(client: openai.OpenAI) -> None:
    """An Agents SDK agent with a typed output: the SDK sends text.format json_schema (strict),
    the grammar makes the model's answer valid, the SDK parses it into the model class."""
    import agents
    import pydantic

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=30)
        country: str = pydantic.Field(max_length=30)

    agents.set_tracing_disabled(True)
    sdk = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="unused", max_retries=0)
    agent = agents.Agent(
        name="geo", instructions="Answer with the city and its country.", output_type=City,
        model=agents.OpenAIResponsesModel(model=MODEL, openai_client=sdk),
        model_settings=agents.ModelSettings(temperature=0, max_tokens=60))
    result = await agents.Runner.run(agent, "Which city is the Eiffel Tower in?", max_turns=1)
    await sdk.close()
    assert isinstance(result.final_output, City) and result.final_output.name

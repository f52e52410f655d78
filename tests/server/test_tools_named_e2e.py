"""A named tool choice yields exactly one call, end to end: the real server with the default
model (SmolLM2-135M, which left to itself repeats a call until max_tokens), the openai SDK,
instructor in Mode.TOOLS, and the OpenAI Agents SDK. `required` with parallel_tool_calls
false is one call too. One server for the module."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from tests.server.tool_server import MODEL, SCHEMAS, TOOLS, smollm2_sdk, weather_agent

pytestmark = [pytest.mark.slow, pytest.mark.smollm2]
MAX_TOKENS = 160  # room for three calls: a repeat would show as a second call or a cut-off
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Quito", "Rome", "Seoul", "Dakar", "Perth"]
TRIES = [("get_weather", f"What is the weather like in {c}?") for c in CITIES] + \
        [("add", f"What is {a} plus {b}?") for a, b in zip(range(3, 40, 4), range(50, 10, -4), strict=True)]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    with smollm2_sdk(tmp_path_factory.mktemp("tools_named") / "server.log") as sdk:
        yield sdk


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def assert_one_call(choice: Any, name: str, completion_tokens: int | None = None) -> None:
    calls = choice.message.tool_calls or []
    assert len(calls) == 1, [c.function for c in calls]
    assert calls[0].function.name == name
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS[name])
    assert choice.finish_reason == "tool_calls"  # ended by the grammar, not by max_tokens
    if completion_tokens is not None:
        assert completion_tokens < MAX_TOKENS


def test_tries_cover_both_tools() -> None:
    assert len(TRIES) == 20 and {n for n, _ in TRIES} == {"get_weather", "add"}


def test_named_choice_is_one_call_in_20_of_20_greedy(client: openai.OpenAI) -> None:
    def ask(t: tuple[str, str]) -> Any:
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": t[1]}], tools=TOOLS,
            tool_choice=named(t[0]), temperature=0, max_tokens=MAX_TOKENS)

    with ThreadPoolExecutor(len(TRIES)) as pool:  # concurrent: the engine batches them
        replies = list(pool.map(ask, TRIES))
    for (name, _), r in zip(TRIES, replies, strict=True):
        assert_one_call(r.choices[0], name, r.usage.completion_tokens)


@pytest.mark.parametrize("name", ["get_weather", "add"])
def test_named_choice_is_one_call_in_20_of_20_sampled(client: openai.OpenAI, name: str) -> None:
    question = next(q for n, q in TRIES if n == name)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], tools=TOOLS,
        tool_choice=named(name), temperature=0.7, seed=1234, n=20, max_tokens=MAX_TOKENS)
    assert len(r.choices) == 20
    for choice in r.choices:
        assert_one_call(choice, name)
    assert r.usage.completion_tokens < 20 * MAX_TOKENS


def test_named_choice_streamed_is_one_call(client: openai.OpenAI) -> None:
    ids, finish = set(), None
    for chunk in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": TRIES[0][1]}], tools=TOOLS,
            tool_choice=named("get_weather"), temperature=0.7, seed=7, stream=True,
            max_tokens=MAX_TOKENS):
        for part in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            assert part.index == 0
            if part.id is not None:
                ids.add(part.id)
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    assert len(ids) == 1 and finish == "tool_calls"


def test_required_without_parallel_calls_is_one_call(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
        tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0.7,
        seed=3, n=8, max_tokens=MAX_TOKENS)
    for choice in r.choices:
        calls = choice.message.tool_calls or []
        assert len(calls) == 1 and choice.finish_reason == "tool_calls"


def test_instructor_tools_mode_returns_the_readme_person(client: openai.OpenAI) -> None:
    """instructor's Mode.TOOLS sends the model's schema as a tool with a named tool_choice and
    reads the one call back; a repeated call would run into max_tokens and fail it."""
    import instructor  # a test dependency (pyproject.toml)
    import pydantic

    class Person(pydantic.BaseModel):  # the README's `person` schema
        model_config = pydantic.ConfigDict(extra="forbid")
        name: str = pydantic.Field(max_length=40)
        age: int = pydantic.Field(ge=0)

    patched = instructor.from_openai(client, mode=instructor.Mode.TOOLS)
    for temperature in (0.0, 0.7):
        person = patched.chat.completions.create(
            model=MODEL, response_model=Person, max_retries=1, max_tokens=60,
            temperature=temperature, messages=[{"role": "user", "content": "Invent a person."}])
        assert isinstance(person, Person) and person.name and person.age >= 0


async def test_agents_sdk_named_tool_choice_runs_the_tool_once(client: openai.OpenAI) -> None:
    """The Agents SDK with tool_choice naming the tool and parallel calls allowed (its
    default), stopping at the first tool turn: that turn is one call, so the tool runs once."""
    import agents

    seen: list[str] = []
    sdk, agent = weather_agent(
        client, seen,
        agents.ModelSettings(temperature=0, max_tokens=MAX_TOKENS, tool_choice="get_weather"),
        tool_use_behavior="stop_on_first_tool")
    result = await agents.Runner.run(agent, "What is the weather like in Paris?", max_turns=2)
    await sdk.close()
    calls = [item for item in result.new_items if type(item).__name__ == "ToolCallItem"]
    assert len(calls) == 1 and len(seen) == 1
    assert json.loads(result.final_output)["city"] == seen[0]


# "Invent a person" is the case: with objects left open the model adds "gender",
# "gender_type", ... until max_tokens (14 of 20 greedy, 3 of 20 at 0.7, measured).
INVENT = [f"Invent a person from {c}." for c in CITIES + [
    "Berlin", "Lagos", "Hanoi", "Denver", "Porto", "Delhi", "Sofia", "Tunis", "Riga", "Kyoto"]]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_instructor_tools_mode_plain_model_20_of_20(client: openai.OpenAI,
                                                    temperature: float) -> None:
    """A plain pydantic model (its schema says nothing about other properties): objects are
    closed as vLLM's default backend closes them, so the model cannot add properties until
    max_tokens (IncompleteOutputException before)."""
    import instructor
    import pydantic

    class Person(pydantic.BaseModel):
        name: str
        age: int

    assert "additionalProperties" not in Person.model_json_schema()
    patched = instructor.from_openai(client, mode=instructor.Mode.TOOLS)

    def invent(item: tuple[int, str]) -> Person:
        person: Person = patched.chat.completions.create(
            model=MODEL, response_model=Person, max_retries=1, max_tokens=60,  # one attempt
            temperature=temperature, seed=item[0],
            messages=[{"role": "user", "content": item[1]}])
        return person

    with ThreadPoolExecutor(len(INVENT)) as pool:
        people = list(pool.map(invent, enumerate(INVENT)))
    assert len(people) == 20 and all(isinstance(p, Person) and p.name for p in people)


def only_named(value: Any, schema: dict[str, Any]) -> bool:
    """Every object in `value` carries only properties its schema names."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        return set(value) <= set(props) and all(only_named(v, props[k])
                                                for k, v in value.items())
    if isinstance(value, list):
        return all(only_named(v, schema.get("items", {})) for v in value)
    return True


OPEN_PERSON: dict[str, Any] = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                "required": ["city"]}},
    "required": ["name", "age", "address"]}  # no additionalProperties anywhere


def test_response_format_outputs_carry_only_named_properties_over_50(
        client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": OPEN_PERSON}}

    def ask(seed: int) -> Any:
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}],
            temperature=1.0, seed=seed, max_tokens=80, response_format=fmt)  # type: ignore

    with ThreadPoolExecutor(25) as pool:
        replies = list(pool.map(ask, range(50)))
    outputs = [json.loads(r.choices[0].message.content or "") for r in replies]
    assert all(r.choices[0].finish_reason == "stop" for r in replies)
    assert all(only_named(o, OPEN_PERSON) for o in outputs)
    for o in outputs:
        jsonschema.validate(o, OPEN_PERSON)

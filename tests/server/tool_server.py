"""The tool-calling e2e tests' shared pieces: the SmolLM2 server, its tools, a weather agent.

The server comes with an openai SDK client; the tools are get_weather and add, with their
parameter schemas; the agent is an Agents SDK one with a get_weather tool.

Owns: how those tests start and stop their server (one per test module). Does not know: what
any test asserts.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai

from tests.server_proc import running_server

SERVER_ARGS = ("--dtype", "auto", "--kv-cache-tokens", "16384", "--max-tokens-cap", "512")
MODEL = "SmolLM2-135M-Instruct"
WEATHER_PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"], "additionalProperties": False}
ADD_PARAMS = {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
    "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
    "required": ["a", "b"], "additionalProperties": False}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS,
                                      "description": "Get the current weather in a city"}},
    {"type": "function", "function": {"name": "add", "parameters": ADD_PARAMS,
                                      "description": "Add two integers"}},
]
SCHEMAS: dict[str, Any] = {"get_weather": WEATHER_PARAMS, "add": ADD_PARAMS}


@contextlib.contextmanager
def smollm2_sdk(log: Path) -> Iterator[openai.OpenAI]:
    """`radixserve serve` on the default model, and an SDK client on its /v1; the server must
    exit cleanly when stopped."""
    with running_server("smollm2-135m", log, list(SERVER_ARGS)) as srv, \
            openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk
    assert srv.proc.returncode == 0, srv.output()


def weather_agent(client: openai.OpenAI, seen: list[str], settings: Any, **agent_kwargs: Any
                  ) -> tuple[openai.AsyncOpenAI, Any]:
    """An Agents SDK agent with one `get_weather` tool (it appends each city to `seen`) on
    the server's /v1/responses; the caller closes the returned async client."""
    import agents  # openai-agents, a test dependency (pyproject.toml)

    agents.set_tracing_disabled(True)  # no export to OpenAI's tracing service

    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        seen.append(city)
        return json.dumps({"city": city, "temperature": 21, "sky": "sunny"})

    sdk = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="unused", max_retries=0)
    agent = agents.Agent(
        name="weather", instructions="Answer weather questions with the tool.",
        tools=[agents.function_tool(get_weather)],
        model=agents.OpenAIResponsesModel(model=MODEL, openai_client=sdk),
        model_settings=settings, **agent_kwargs)
    return sdk, agent

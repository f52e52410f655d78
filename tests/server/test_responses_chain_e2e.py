"""Stateful Responses end to end with the default model (SmolLM2-135M, fp32, greedy): a
6-turn conversation through previous_response_id answers exactly as full-history requests do,
with the history served from the radix tree; the OpenAI Agents SDK chains a tool-using agent
over several runs. One server for the module."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.server.tool_server import MODEL, weather_agent
from tests.server_proc import ServerProc, running_server

pytestmark = [pytest.mark.slow, pytest.mark.smollm2]
# An agent's system prompt is long (rules, tools); the turns are short.
INSTRUCTIONS = " ".join(
    f"Rule {i}: answer in one short sentence, stay polite, and never invent facts about "
    f"topic number {i}." for i in range(1, 16))
TURNS = ["Hi! Who are you?", "What is the capital of France?", "And of Italy?",
         "Name a color.", "Name an animal.", "Thanks, goodbye!"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    log = tmp_path_factory.mktemp("responses_chain") / "server.log"
    args = ["--dtype", "float32", "--kv-cache-tokens", "16384", "--max-tokens-cap", "512"]
    with running_server("smollm2-135m", log, args) as srv:
        yield srv
    assert srv.proc.returncode == 0, srv.output()


@pytest.fixture(scope="module")
def client(server: ServerProc) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as sdk:
        yield sdk


def test_six_turns_chained_equal_full_history_and_come_from_the_cache(
        client: openai.OpenAI, server: ServerProc) -> None:
    history: list[Any] = []
    prev: str | None = None
    ratios = []
    for turn in TURNS:
        new = [{"role": "user", "content": turn}]
        chained = client.responses.create(
            model=MODEL, input=new, instructions=INSTRUCTIONS, temperature=0,
            max_output_tokens=24, previous_response_id=prev)  # type: ignore[arg-type]
        full = client.responses.create(
            model=MODEL, input=[*history, *new], instructions=INSTRUCTIONS, temperature=0,
            max_output_tokens=24, store=False)
        assert chained.output_text == full.output_text, turn
        usage, full_usage = chained.usage, full.usage
        assert usage is not None and full_usage is not None
        assert usage.input_tokens == full_usage.input_tokens  # the same prompt
        ratios.append(usage.input_tokens_details.cached_tokens / usage.input_tokens)
        history += [*new, *[o.model_dump(exclude_none=True) for o in chained.output]]
        prev = chained.id
    assert all(r >= 0.9 for r in ratios[1:]), ratios
    server.wait_idle()


async def test_agents_sdk_chains_a_tool_using_agent(client: openai.OpenAI) -> None:
    """Two runs of a tool-using agent, each model call sending only its new items: within a
    run (auto_previous_response_id) and across runs (previous_response_id)."""
    import agents

    seen: list[str] = []
    sdk, agent = weather_agent(
        client, seen,
        agents.ModelSettings(temperature=0, max_tokens=80, tool_choice="required",
                             parallel_tool_calls=False),
        reset_tool_choice=True)
    first = await agents.Runner.run(agent, "What is the weather like in Paris?", max_turns=4,
                                    auto_previous_response_id=True)
    assert len(seen) == 1 and isinstance(first.final_output, str) and first.final_output
    run = agents.Runner.run_streamed(agent, "And what is the weather like in Tokyo?",
                                     max_turns=4, previous_response_id=first.last_response_id)
    kinds = [e.type async for e in run.stream_events()]
    assert "raw_response_event" in kinds and len(seen) == 2
    assert isinstance(run.final_output, str) and run.final_output
    last = run.last_response_id
    assert last is not None
    items = await sdk.responses.input_items.list(last, order="asc", limit=100)
    await sdk.close()
    kinds_in = [i.type for i in items.data]
    # the whole conversation is on the server: both questions, both calls and their results
    assert kinds_in.count("function_call") == 2 and kinds_in.count("function_call_output") == 2
    texts = [str(i.model_dump().get("content")) for i in items.data if i.type == "message"]
    assert any("Paris" in t for t in texts) and any("Tokyo" in t for t in texts)

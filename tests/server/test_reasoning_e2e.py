"""--reasoning-parser qwen3 and deepseek_r1 over real HTTP (a `radixserve serve` process, the
openai SDK as client): a tiny Llama carrying Qwen3's chat template (tests/chat_templates.py),
its output steered by a regex constraint so that it thinks, answers and calls a tool as a
real Qwen3 does. Streamed and whole responses agree; thinking off, max_tokens inside the
thinking, tool calls after it, the prompt cache on a repeat, return_token_ids via extra_body.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.chat_templates import QWEN3_TEMPLATE, R1_TEMPLATE, make_templated_model
from tests.server.test_chat_template_options import WEATHER
from tests.server_proc import running_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
THINK_THEN_ANSWER = r"<think>\n[a-z]{2,6}\n</think>\n\n[a-z]{2,6}"
LONG_THINKING = r"<think>\n[a-z]{20,30}\n</think>\n\n[a-z]{2,6}"




def _sdk(tmp_path_factory: pytest.TempPathFactory, template: str,
         parser: str) -> Iterator[openai.OpenAI]:
    root = tmp_path_factory.mktemp(parser)
    model = make_templated_model(root / "m", template)
    with running_server(model, root / "server.log", ["--reasoning-parser", parser]) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        yield client
        client.close()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    yield from _sdk(tmp_path_factory, QWEN3_TEMPLATE, "qwen3")


@pytest.fixture(scope="module")
def r1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    yield from _sdk(tmp_path_factory, R1_TEMPLATE, "deepseek_r1")


def chat(client: openai.OpenAI, regex: str, **kwargs: Any) -> Any:
    extra = {"structured_outputs": {"regex": regex}, **kwargs.pop("extra_body", {})}
    return client.chat.completions.create(
        model=client.models.list().data[0].id, messages=ASK,  # type: ignore[arg-type]
        temperature=0, max_tokens=kwargs.pop("max_tokens", 60), extra_body=extra, **kwargs)


def streamed(client: openai.OpenAI, regex: str, **kwargs: Any) -> tuple[str, str, str | None]:
    """(reasoning_content, content, finish_reason) joined from the deltas."""
    reasoning, content, finish = "", "", None
    for chunk in chat(client, regex, stream=True, **kwargs):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return reasoning, content, finish


def test_qwen3_thinking_split_streamed_and_whole(qwen3: openai.OpenAI) -> None:
    resp = chat(qwen3, THINK_THEN_ANSWER, extra_body={"return_token_ids": True})
    msg = resp.choices[0].message
    reasoning = msg.model_extra["reasoning_content"]
    assert re.fullmatch(r"\n[a-z]{2,6}\n", reasoning), msg
    assert re.fullmatch(r"\n\n[a-z]{2,6}", msg.content), msg
    assert resp.choices[0].finish_reason == "stop"
    assert streamed(qwen3, THINK_THEN_ANSWER) == (reasoning, msg.content, "stop")
    # return_token_ids (vLLM's extra_body field): the raw output, tags and all
    ids = resp.choices[0].model_extra["token_ids"]
    prompt = resp.model_extra["prompt_token_ids"]
    assert len(prompt) == resp.usage.prompt_tokens and len(ids) == resp.usage.completion_tokens
    # The same prompt again: its pages come from the radix cache.
    again = chat(qwen3, THINK_THEN_ANSWER)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].message.model_extra["reasoning_content"] == reasoning


def test_qwen3_enable_thinking_false_has_no_reasoning(qwen3: openai.OpenAI) -> None:
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    resp = chat(qwen3, r"[a-z]{2,6}", extra_body=off)
    msg = resp.choices[0].message
    assert msg.model_extra["reasoning_content"] is None
    assert re.fullmatch(r"[a-z]{2,6}", msg.content), msg
    assert streamed(qwen3, r"[a-z]{2,6}", extra_body=off) == ("", msg.content, "stop")
    # Off means off: even tags the model writes stay in the content.
    tagged = chat(qwen3, THINK_THEN_ANSWER, extra_body=off).choices[0].message
    assert tagged.content.startswith("<think>\n") and tagged.model_extra[
        "reasoning_content"] is None


def test_qwen3_max_tokens_inside_the_thinking(qwen3: openai.OpenAI) -> None:
    resp = chat(qwen3, LONG_THINKING, max_tokens=12)
    msg = resp.choices[0].message
    assert resp.choices[0].finish_reason == "length"
    assert msg.content is None and msg.model_extra["reasoning_content"]
    assert streamed(qwen3, LONG_THINKING, max_tokens=12) == (
        msg.model_extra["reasoning_content"], "", "length")


@pytest.mark.parametrize("thinking", [True, False])
def test_qwen3_tool_call_hermes(qwen3: openai.OpenAI, thinking: bool) -> None:
    """tool_choice "required": the engine's grammar writes Qwen3's `<tool_call>` JSON from the
    first token, so there is no thinking (a constraint with tools is refused unless
    tool_choice is "none"; a thinking model's reasoning before a call is in
    test_family_templates.py); the call parses through the hermes parser either way."""
    args = {"model": qwen3.models.list().data[0].id, "messages": ASK, "temperature": 0,
            "max_tokens": 80, "tools": [WEATHER], "tool_choice": "required",
            "extra_body": {"chat_template_kwargs": {"enable_thinking": thinking}}}
    choice = qwen3.chat.completions.create(**args).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.model_extra["reasoning_content"] is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    streamed_args, finish = "", None
    for chunk in qwen3.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            assert not getattr(c.delta, "reasoning_content", None)
            for part in c.delta.tool_calls or []:
                streamed_args += part.function.arguments or ""
            finish = c.finish_reason or finish
    assert (streamed_args, finish) == (call.function.arguments, "tool_calls")


def test_deepseek_r1_thinking_opened_by_the_template(r1: openai.OpenAI) -> None:
    answer = r"[a-z]{2,6}\n</think>\n\n[a-z]{2,6}"
    msg = chat(r1, answer).choices[0].message
    assert re.fullmatch(r"[a-z]{2,6}\n", msg.model_extra["reasoning_content"]), msg
    assert re.fullmatch(r"\n\n[a-z]{2,6}", msg.content), msg
    assert streamed(r1, answer) == (msg.model_extra["reasoning_content"], msg.content, "stop")

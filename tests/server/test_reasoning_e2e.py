"""--reasoning-parser qwen3 and deepseek_r1 over real HTTP (a `radixserve serve` process, the
openai SDK as client). Qwen3: a tiny `Qwen3ForCausalLM` with Qwen3's added tokens (`<think>`,
`<tool_call>`, ... one token each, not special) and Qwen3's own chat template
(tests/chat_templates.py), its output steered by a regex constraint (or the tool-call grammar)
so that it thinks, answers and calls a tool as a real Qwen3 does, and a logit bias towards the
tags so that it writes them as Qwen3 does: as their added tokens, which the grammar must allow
(grammar/llg_tokenizer.py). Streamed and whole responses agree; thinking off, max_tokens inside
the thinking, tool calls (required and named), a JSON schema with thinking on, the prompt
cache on a repeat, return_token_ids via extra_body. DeepSeek-R1: a tiny Llama whose template
opens `<think>` in the prompt.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.chat_templates import (
    QWEN3_TAGS,
    R1_TEMPLATE,
    make_qwen3_model,
    make_qwen3_tokenizer,
    make_templated_model,
)
from tests.server.test_chat_template_options import WEATHER
from tests.server_proc import running_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
THINK_THEN_ANSWER = r"<think>\n[a-z]{2,6}\n</think>\n\n[a-z]{2,6}"
LONG_THINKING = r"<think>\n[a-z]{20,30}\n</think>\n\n[a-z]{2,6}"
TAG = dict(zip(QWEN3_TAGS, make_qwen3_tokenizer().convert_tokens_to_ids(list(QWEN3_TAGS)),
               strict=True))
# Wherever the grammar allows a tag's added token, the model writes it (a real Qwen3's habit;
# a random model's argmax would as often spell the tag byte by byte).
TAGS_FIRST = {str(i): 100 for i in TAG.values()}


def _sdk(tmp_path_factory: pytest.TempPathFactory, model: Path,
         parser: str) -> Iterator[openai.OpenAI]:
    with running_server(model, model.parent / "server.log", ["--reasoning-parser", parser]) \
            as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        yield client
        client.close()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    model = make_qwen3_model(tmp_path_factory.mktemp("qwen3") / "m")
    yield from _sdk(tmp_path_factory, model, "qwen3")


@pytest.fixture(scope="module")
def r1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    model = make_templated_model(tmp_path_factory.mktemp("r1") / "m", R1_TEMPLATE)
    yield from _sdk(tmp_path_factory, model, "deepseek_r1")


def chat(client: openai.OpenAI, regex: str, **kwargs: Any) -> Any:
    """A chat request steered by `regex` (Qwen3's tags first unless `logit_bias` is given)."""
    extra = {"structured_outputs": {"regex": regex}, **kwargs.pop("extra_body", {})}
    kwargs.setdefault("logit_bias", TAGS_FIRST)
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
    # the tags are Qwen3's added tokens, allowed by the regex as the text they are
    assert ids[0] == TAG["<think>"] and TAG["</think>"] in ids, ids
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


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(("choice", "thinking"), [("required", True), ("required", False),
                                                  (NAMED, True)])
def test_qwen3_tool_call_hermes(qwen3: openai.OpenAI, choice: Any, thinking: bool) -> None:
    """tool_choice "required" or named: the engine's grammar writes Qwen3's `<tool_call>` JSON
    from the first token, so there is no thinking (a constraint with tools is refused unless
    tool_choice is "none"; a thinking model's reasoning before a call is in
    test_family_templates.py); the call parses through the hermes parser either way, and its
    tags are Qwen3's added tokens."""
    args = {"model": qwen3.models.list().data[0].id, "messages": ASK, "temperature": 0,
            "max_tokens": 80, "tools": [WEATHER], "tool_choice": choice,
            "logit_bias": TAGS_FIRST,
            "extra_body": {"chat_template_kwargs": {"enable_thinking": thinking},
                           "return_token_ids": True}}
    choice = qwen3.chat.completions.create(**args).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.model_extra["reasoning_content"] is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    ids = choice.model_extra["token_ids"]
    assert ids[0] == TAG["<tool_call>"] and TAG["</tool_call>"] in ids, ids
    streamed_args, finish = "", None
    for chunk in qwen3.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            assert not getattr(c.delta, "reasoning_content", None)
            for part in c.delta.tool_calls or []:
                streamed_args += part.function.arguments or ""
            finish = c.finish_reason or finish
    assert (streamed_args, finish) == (call.function.arguments, "tool_calls")


def test_qwen3_json_schema_with_thinking_on(qwen3: openai.OpenAI) -> None:
    """response_format json_schema while the template lets the model think: the schema holds
    from the first token (no `<think>`: reasoning_content null) and the JSON is whole."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris"]},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema}}
    resp = qwen3.chat.completions.create(
        model=qwen3.models.list().data[0].id, messages=ASK,  # type: ignore[arg-type]
        temperature=0, max_tokens=60, logit_bias=TAGS_FIRST,  # type: ignore[arg-type]
        response_format=fmt,  # type: ignore[arg-type]
        extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    msg = resp.choices[0].message
    assert resp.choices[0].finish_reason == "stop", resp
    assert msg.model_extra["reasoning_content"] is None
    assert json.loads(msg.content)["city"] == "Paris"


def test_deepseek_r1_thinking_opened_by_the_template(r1: openai.OpenAI) -> None:
    answer = r"[a-z]{2,6}\n</think>\n\n[a-z]{2,6}"
    msg = chat(r1, answer, logit_bias=None).choices[0].message  # a Llama: no Qwen3 tags
    assert re.fullmatch(r"[a-z]{2,6}\n", msg.model_extra["reasoning_content"]), msg
    assert re.fullmatch(r"\n\n[a-z]{2,6}", msg.content), msg
    assert streamed(r1, answer, logit_bias=None) == (msg.model_extra["reasoning_content"],
                                                    msg.content, "stop")

"""Request parsing: every accepted shape, and a named 400 for everything malformed."""

from __future__ import annotations

from typing import Any

import pytest

from radixserve.api.lengths import check_token_ids
from radixserve.api.protocol import (
    parse_chat,
    parse_completion,
    parse_generate,
)
from radixserve.types import InvalidRequestError

MSGS = [{"role": "user", "content": "hi"}]


def bad(fn: Any, body: Any, param: str | None) -> str:
    with pytest.raises(InvalidRequestError) as exc:
        fn(body)
    assert exc.value.status == 400
    assert exc.value.param == param, str(exc.value)
    return str(exc.value)


def test_completion_prompt_shapes() -> None:
    assert parse_completion({"prompt": "a"}).prompts == ("a",)
    assert parse_completion({"prompt": ["a", "b"]}).prompts == ("a", "b")
    assert parse_completion({"prompt": [1, 2]}).prompts == ((1, 2),)
    assert parse_completion({"prompt": [[1], [2, 3]]}).prompts == ((1,), (2, 3))


def test_completion_defaults() -> None:
    req = parse_completion({"model": "m", "prompt": "a"})
    assert req.opts.params.max_tokens == 16  # OpenAI's default for /v1/completions
    assert req.opts.n == 1 and not req.opts.stream and req.opts.stop == ()
    assert req.opts.params.logprobs is None and not req.echo


def test_completion_full() -> None:
    req = parse_completion({
        "prompt": "a", "max_tokens": 5, "temperature": 0, "top_p": 0.5, "top_k": 3, "min_p": 0.1,
        "presence_penalty": 1, "frequency_penalty": -1, "repetition_penalty": 1.2,
        "stop": ["x", "y", "x"], "stop_token_ids": [7], "seed": 3, "n": 2, "logprobs": 2,
        "ignore_eos": True, "min_tokens": 2, "stream": True,
        "stream_options": {"include_usage": True}, "user": "u", "best_of": 1, "suffix": None,
        "logit_bias": {},
    })
    p = req.opts.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (5, 0, 0.5, 3, 0.1)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (1, -1, 1.2)
    assert p.stop_token_ids == (7,) and p.seed == 3 and p.logprobs == 2
    assert p.ignore_eos and p.min_tokens == 2
    assert req.opts.stop == ("x", "y") and req.opts.n == 2 and req.opts.include_usage


@pytest.mark.parametrize(("body", "param"), [
    ([1, 2], None),
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": ["a", 1]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "a", "max_tokens": True}, "max_tokens"),
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "temperature": "hot"}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "top_p": 1.5}, "top_p"),
    ({"prompt": "a", "top_k": -2}, "top_k"),
    ({"prompt": "a", "min_p": 2}, "min_p"),
    ({"prompt": "a", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "a", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "n": 1000}, "n"),
    ({"prompt": ["a"] * 200, "n": 2}, "n"),
    ({"prompt": "a", "stop": 3}, "stop"),
    ({"prompt": "a", "stop": [""]}, "stop"),
    ({"prompt": "a", "stop": ["s"] * 40}, "stop"),
    ({"prompt": "a", "stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"prompt": "a", "seed": 2**70}, "seed"),
    ({"prompt": "a", "logprobs": 50}, "logprobs"),
    ({"prompt": "a", "logprobs": 1, "echo": True}, "echo"),
    ({"prompt": "a", "stream": "yes"}, "stream"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "a", "stream": True, "stream_options": {"x": 1}}, "x"),
    ({"prompt": "a", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"prompt": "a", "model": 3}, "model"),
])
def test_completion_rejects(body: Any, param: str | None) -> None:
    bad(parse_completion, body, param)


@pytest.mark.parametrize("field", [
    {"tools": [{"type": "function"}]}, {"best_of": 2}, {"suffix": "x"},
    {"response_format": {"type": "yaml"}}, {"functions": [{}]}, {"whatever": 1},
    {"guided_json": ""}, {"tool_choice": "auto"},
])
def test_unsupported_fields_are_named(field: dict[str, Any]) -> None:
    (name,) = field
    message = bad(parse_completion, {"prompt": "a", **field}, name)
    assert name in message


def test_chat_shapes() -> None:
    req = parse_chat({"messages": [
        {"role": "developer", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
         "name": "bob"},
        {"role": "assistant", "content": "ok"},
    ], "max_completion_tokens": 4, "logprobs": True, "top_logprobs": 3})
    assert req.messages == ({"role": "system", "content": "sys"},
                            {"role": "user", "content": "a\nb"},
                            {"role": "assistant", "content": "ok"})
    assert req.opts.params.max_tokens == 4 and req.opts.params.logprobs == 3


def test_chat_defaults_fill_context() -> None:
    req = parse_chat({"messages": MSGS})
    assert req.opts.params.max_tokens is None and req.opts.params.logprobs is None
    assert parse_chat({"messages": MSGS, "logprobs": True}).opts.params.logprobs == 0


@pytest.mark.parametrize(("body", "param"), [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [1]}, "messages[0]"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "tool_calls"),
    ({"messages": MSGS, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": MSGS, "logprobs": 2}, "logprobs"),
    ({"messages": MSGS, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": MSGS, "echo": True}, "echo"),
])
def test_chat_rejects(body: Any, param: str) -> None:
    bad(parse_chat, body, param)


def test_generate_shapes() -> None:
    req = parse_generate({"text": "hi", "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert req.prompt == "hi" and req.opts.params.max_tokens == 3
    req = parse_generate({"input_ids": [1, 2], "stream": True})
    assert req.prompt == (1, 2) and req.opts.stream
    assert req.opts.params.max_tokens == 128  # SGLang's default for /generate


@pytest.mark.parametrize(("body", "param"), [
    ({}, "text"),
    ({"text": "a", "input_ids": [1]}, "text"),
    ({"text": ""}, "text"),
    ({"input_ids": []}, "input_ids"),
    ({"text": "a", "sampling_params": {"n": 2}}, "n"),
    ({"text": "a", "sampling_params": {"bogus": 1}}, "bogus"),
    ({"text": "a", "sampling_params": []}, "sampling_params"),
])
def test_generate_rejects(body: Any, param: str) -> None:
    bad(parse_generate, body, param)


def test_token_id_range() -> None:
    check_token_ids((0, 9), 10, "prompt")
    with pytest.raises(InvalidRequestError, match="out of range"):
        check_token_ids((10,), 10, "prompt")


def test_priority_field_on_every_route() -> None:
    assert parse_completion({"prompt": "a", "priority": -2}).opts.priority == -2
    # Not given: None (the caller's key decides; 0 without keys), see test_queue_priority.py.
    assert parse_chat({"messages": [{"role": "user", "content": "hi"}]}).opts.priority is None
    assert parse_generate({"text": "a", "priority": 7}).opts.priority == 7
    for bad_value in ("high", 1.5, 10**9, True):
        with pytest.raises(InvalidRequestError) as err:
            parse_completion({"prompt": "a", "priority": bad_value})
        assert err.value.param == "priority"


def test_logit_bias() -> None:
    """OpenAI's shape (string token ids -> numbers in [-100, 100]), on every route."""
    p = parse_completion({"prompt": "a", "logit_bias": {"50": -100, "7": 2.5}}).opts.params
    assert p.logit_bias == ((7, 2.5), (50, -100.0))
    assert parse_chat({"messages": MSGS, "logit_bias": {"3": 1}}).opts.params.bias_pairs == \
        ((3, 1.0),)
    gen = parse_generate({"text": "a", "sampling_params": {"logit_bias": {"4": 100}}})
    assert gen.opts.params.bias_pairs == ((4, 100.0),)
    assert parse_completion({"prompt": "a", "logit_bias": {}}).opts.params.logit_bias == ()
    for value, words in [([1], "object"), ({"x": 1}, "token ids"), ({"1.5": 1}, "token ids"),
                         ({"-1": 1}, ">= 0"), ({"1": "high"}, "numbers"), ({"1": True}, "numbers"),
                         ({"1": 100.5}, "[-100, 100]"), ({"1": -1e308}, "[-100, 100]")]:
        message = bad(parse_completion, {"prompt": "a", "logit_bias": value}, "logit_bias")
        assert words in message, (value, message)


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
])
def test_a_media_content_part_is_a_named_400(part: dict[str, Any]) -> None:
    """A multimodal checkpoint (Gemma3ForConditionalGeneration) is served text-only: an image
    (or audio) part is refused by its type, not read as text nor ignored."""
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                                      part]}]}
    message = bad(parse_chat, body, "messages[0].content")
    assert f"'messages[0].content[1]' is of type {part['type']!r}" in message
    assert "text only" in message

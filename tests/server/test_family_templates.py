"""The new families' chat templates as the server renders them (fake engine recording its
prompts): Gemma's (no system role: folded into the first user turn; a conversation it rejects
is a 400 naming the template's own message), Qwen3's (enable_thinking, its own tools block),
Qwen3's enable_thinking in the offline LLM.chat, and the chat route's reasoning split before
a tool call (the fake engine "writes" a thinking Qwen3's output)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from radixserve import LLM, SamplingParams
from tests.chat_templates import GEMMA_TEMPLATE, QWEN3_TEMPLATE, make_templated_model
from tests.server.test_chat_template_options import WEATHER, rendered, serve
from tests.server.test_tools import events, post
from tests.server.test_tools import serve as serve_recording
from tests.tiny_models import make_tokenizer

ASK = [{"role": "system", "content": "Answer in French."},
       {"role": "user", "content": "Weather in Rome?"}]


def _tokenizer_folder(path: Path, template: str) -> Path:
    tok = make_tokenizer()
    tok.chat_template = template
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tokenizer_folder(tmp_path_factory.mktemp("gemma") / "m", GEMMA_TEMPLATE)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tokenizer_folder(tmp_path_factory.mktemp("qwen3") / "m", QWEN3_TEMPLATE)


async def test_gemma_folds_the_system_message_into_the_first_user_turn(gemma: Path) -> None:
    async with serve(gemma) as srv:
        status, text = await rendered(srv, ASK)
        assert status == 200, text
        assert text == ("<start_of_turn>user\nAnswer in French.\n\nWeather in Rome?"
                        "<end_of_turn>\n<start_of_turn>model\n")
        # Tools on a template without its own tools block: the instruction joins the system
        # text, which Gemma's template folds in the same way.
        status, text = await rendered(srv, ASK, tools=[WEATHER])
        assert status == 200 and text.startswith("<start_of_turn>user\nAnswer in French."), text
        assert "get_weather" in text and text.count("<start_of_turn>user") == 1


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
    [{"role": "assistant", "content": "a"}],
])
async def test_a_conversation_the_template_rejects_is_a_400(gemma: Path,
                                                            messages: list[Any]) -> None:
    async with serve(gemma) as srv:
        status, body = await rendered(srv, messages)
        assert status == 400, body
        err = body["error"]
        assert err["param"] == "messages" and err["type"] == "invalid_request_error"
        assert err["message"] == ("chat template error: Conversation roles must alternate "
                                  "user/assistant/user/assistant/...")
        assert (await rendered(srv, ASK))[0] == 200  # and the server keeps serving


async def test_qwen3_enable_thinking_and_its_own_tools_block(qwen3: Path) -> None:
    async with serve(qwen3) as srv:
        status, on = await rendered(srv, ASK)
        assert status == 200 and on.endswith("<|im_start|>assistant\n"), on
        status, off = await rendered(srv, ASK, chat_template_kwargs={"enable_thinking": False})
        assert status == 200 and off == on + "<think>\n\n</think>\n\n", off
        status, tools = await rendered(srv, ASK, tools=[WEATHER])
        assert status == 200
        assert tools.startswith("<|im_start|>system\nAnswer in French.\n\n# Tools\n"), tools
        assert tools.count('"name": "get_weather"') == 1  # the template's block, no fallback


def test_offline_chat_enable_thinking(tmp_path: Path) -> None:
    llm = LLM(model=str(make_templated_model(tmp_path / "m", QWEN3_TEMPLATE)), dtype="float32")
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    (off,) = llm.chat(ASK, sp, chat_template_kwargs={"enable_thinking": False})
    (on,) = llm.chat(ASK, sp)
    assert llm.tokenizer.decode(off.prompt_token_ids).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert off.prompt_token_ids[:len(on.prompt_token_ids)] == on.prompt_token_ids


# The fake engine echoes its prompt; a template that renders only the last message's text
# makes the model "write" exactly that text: Qwen3's thinking, then its call.
ECHO_TEMPLATE = "{{ messages[-1]['content'] }}"
THOUGHT_CALL = ('<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n'
                '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')


async def test_reasoning_then_a_tool_call_streamed_and_whole(tmp_path: Path) -> None:
    model = _tokenizer_folder(tmp_path / "m", ECHO_TEMPLATE)
    body = {"model": "m", "messages": [{"role": "user", "content": THOUGHT_CALL}],
            "tools": [WEATHER], "temperature": 0, "ignore_eos": True,
            "max_tokens": len(make_tokenizer().encode(THOUGHT_CALL))}
    async with serve_recording(model, reasoning_parser="qwen3") as tc:
        status, whole = await post(tc, body)
        chunks = await events(tc, body)
        status_off, off = await post(tc, {**body, "chat_template_kwargs": {"thinking": False}})
    assert status == status_off == 200, whole
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "\nThe user wants the weather.\n"
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Rome"}
    deltas = [c["delta"] for e in chunks for c in e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == \
        choice["message"]["reasoning_content"]
    assert not "".join(d.get("content") or "" for d in deltas)
    args = "".join(t["function"].get("arguments") or "" for d in deltas
                   for t in d.get("tool_calls") or [])
    assert json.loads(args) == {"city": "Rome"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # Thinking off (DeepSeek's switch): no split; the tags stay in the content before the call.
    off_message = off["choices"][0]["message"]
    assert off_message["reasoning_content"] is None
    assert off_message["content"].startswith("<think>\nThe user")
    assert len(off_message["tool_calls"]) == 1


async def test_a_reply_sent_back_with_its_thinking(qwen3: Path) -> None:
    """An agent loop sends the assistant's message back as it came (`reasoning_content`,
    content null beside its calls): accepted, and Qwen3's template renders the thinking of
    the turns after the last user query."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    history = [ASK[1], {"role": "assistant", "content": None, "tool_calls": [call],
                        "reasoning_content": "I should look it up."},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    async with serve(qwen3) as srv:
        status, text = await rendered(srv, history, tools=[WEATHER])
        assert status == 200, text
        assert ("<|im_start|>assistant\n<think>\nI should look it up.\n</think>\n\n<tool_call>"
                in text), text
        assert "<tool_response>\nsunny\n</tool_response>" in text
        status, text = await rendered(srv, [ASK[1], {"role": "assistant", "content": None,
                                                     "reasoning": "cut off"}, ASK[1]])
        assert status == 200 and "cut off" not in text  # before the last query: dropped
        status, body = await rendered(srv, [ASK[1], {"role": "assistant", "content": "x",
                                                     "reasoning_content": 3}])
        assert status == 400 and body["error"]["param"] == "messages[1].reasoning_content"

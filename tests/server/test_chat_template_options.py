"""vLLM's chat extras (add_generation_prompt, continue_final_message, chat_template_kwargs)
over HTTP, with the openai SDK's extra_body as a client sends them, and bad values as 400s;
and the offline LLM.chat keywords (vLLM's), tools included.

The fake engine records the prompts it is given: they show exactly what the template rendered.
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
from aiohttp.test_utils import TestClient

from radixserve import LLM, SamplingParams
from radixserve.ipc.messages import GenerateMsg
from radixserve.types import InvalidRequestError, TemplateOptions
from tests.server.test_tools import TOKENIZER
from tests.server.test_tools import serve as serve_recording
from tests.tiny_models import CHAT_TEMPLATE, make_tokenizer

# A template with a variable of its own, as Qwen3's enable_thinking.
HINT_TEMPLATE = "{% if hint %}[hint: {{ hint }}]\n{% endif %}" + CHAT_TEMPLATE
PARTIAL = [{"role": "user", "content": "Name a colour."},
           {"role": "assistant", "content": "The colour is"}]


@pytest.fixture(scope="module")
def hint_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hint_model") / "m"  # served as model "m"
    tok = make_tokenizer()
    tok.chat_template = HINT_TEMPLATE
    tok.save_pretrained(path)
    return path


Served = tuple[TestClient[Any, Any], list[GenerateMsg]]  # the client, the prompts given


@contextlib.asynccontextmanager
async def serve(model: Path) -> AsyncIterator[Served]:
    """test_tools_server's in-process server (fake engine, recording what it is given)."""
    seen: list[GenerateMsg] = []
    async with serve_recording(model, seen) as tc:
        yield tc, seen


async def rendered(srv: Served, messages: list[dict[str, str]], **extra: Any
                   ) -> tuple[int, Any]:
    """(status, the prompt the engine was given, as text, or the error body)."""
    body = {"model": "m", "messages": messages, "temperature": 0, "max_tokens": 4, **extra}
    tc, seen = srv
    resp = await tc.post("/v1/chat/completions", data=orjson.dumps(body))
    out = orjson.loads(await resp.read())
    if resp.status != 200:
        return resp.status, out
    return 200, TOKENIZER.decode(seen[-1].prompt_ids)


async def test_continue_final_message_and_generation_prompt(hint_model: Path) -> None:
    async with serve(hint_model) as tc:
        status, text = await rendered(tc, PARTIAL)
        assert status == 200 and text.endswith("The colour is<|im_end|>\n<|im_start|>assistant\n")
        # The reply continues the assistant's own words: no end of turn, no new turn.
        status, text = await rendered(tc, PARTIAL, continue_final_message=True)
        assert status == 200 and text.endswith("<|im_start|>assistant\nThe colour is"), text
        status, text = await rendered(tc, PARTIAL, continue_final_message=True,
                                      add_generation_prompt=False)
        assert status == 200 and text.endswith("The colour is"), text
        status, text = await rendered(tc, PARTIAL[:1], add_generation_prompt=False)
        assert status == 200 and text.endswith("Name a colour.<|im_end|>\n"), text


async def test_openai_sdk_extra_body(hint_model: Path) -> None:
    """What a vLLM user writes: the extras in the SDK's extra_body."""
    async with serve(hint_model) as (tc, seen):
        client = openai.AsyncOpenAI(base_url=str(tc.make_url("/v1")), api_key="x",
                                    max_retries=0)
        resp = await client.chat.completions.create(
            model="m", messages=PARTIAL, max_tokens=4,  # type: ignore[arg-type]
            extra_body={"continue_final_message": True, "add_generation_prompt": False,
                        "chat_template_kwargs": {"hint": "short"}})
        assert resp.choices[0].message.role == "assistant"
        prompt = TOKENIZER.decode(seen[-1].prompt_ids)
        assert prompt.startswith("[hint: short]") and prompt.endswith("The colour is"), prompt
        with pytest.raises(openai.BadRequestError, match="cannot both be true"):
            await client.chat.completions.create(
                model="m", messages=PARTIAL,  # type: ignore[arg-type]
                extra_body={"continue_final_message": True, "add_generation_prompt": True})
        await client.close()


async def test_chat_template_kwargs_reach_the_template(hint_model: Path) -> None:
    async with serve(hint_model) as tc:
        status, text = await rendered(tc, PARTIAL[:1], chat_template_kwargs={"hint": "be brief"})
        assert status == 200 and "[hint: be brief]" in text, text
        status, text = await rendered(tc, PARTIAL[:1])
        assert status == 200 and "[hint:" not in text


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message",
     "cannot both be true"),
    ({"continue_final_message": "yes"}, "continue_final_message", "boolean"),
    ({"add_generation_prompt": 1}, "add_generation_prompt", "boolean"),
    ({"chat_template_kwargs": ["hint"]}, "chat_template_kwargs", "object"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "'tools'"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs",
     "add_generation_prompt"),
])
async def test_bad_template_options_are_400s(hint_model: Path, extra: dict[str, Any],
                                             param: str, words: str) -> None:
    async with serve(hint_model) as tc:
        status, body = await rendered(tc, PARTIAL, **extra)
        assert status == 400, body
        assert body["error"]["param"] == param and words in body["error"]["message"], body
        assert (await rendered(tc, PARTIAL))[0] == 200  # and the server keeps serving


async def test_continuing_a_user_message_is_a_400(hint_model: Path) -> None:
    async with serve(hint_model) as tc:
        status, body = await rendered(tc, PARTIAL[:1], continue_final_message=True)
    assert status == 400 and body["error"]["param"] == "continue_final_message"
    assert "last message to be an assistant" in body["error"]["message"]


async def test_a_template_that_cannot_use_a_kwarg_is_a_400(tmp_path: Path) -> None:
    tok = make_tokenizer()
    tok.chat_template = "{{ hint + 1 }}" + CHAT_TEMPLATE  # a string hint cannot be added to 1
    tok.save_pretrained(tmp_path / "m")
    async with serve(tmp_path / "m") as tc:
        status, body = await rendered(tc, PARTIAL[:1], chat_template_kwargs={"hint": "x"})
        assert status == 400 and "chat template error" in body["error"]["message"], body
        assert (await rendered(tc, PARTIAL[:1], chat_template_kwargs={"hint": 1}))[0] == 200


def test_template_options_rules() -> None:
    with pytest.raises(InvalidRequestError, match="cannot both be true"):
        TemplateOptions(add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(InvalidRequestError, match="'messages'"):
        TemplateOptions(kwargs={"messages": []})
    TemplateOptions(False, True).check_messages(["user", "assistant"])
    with pytest.raises(InvalidRequestError, match="assistant"):
        TemplateOptions(False, True).check_messages(["assistant", "user"])


# --- offline: vLLM's LLM.chat keywords -------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}}}


def test_offline_chat_with_vllm_keywords(tiny_llama: Path) -> None:
    llm = LLM(model=str(tiny_llama), dtype="float32")
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    plain = llm.chat(PARTIAL[:1], sampling_params=sp, use_tqdm=True)
    # continue_final_message: the prompt stops inside the assistant's turn
    cont = llm.chat(PARTIAL, sp, continue_final_message=True)
    want = make_tokenizer().apply_chat_template(PARTIAL, continue_final_message=True,
                                                tokenize=False)
    assert cont[0].prompt_token_ids == llm.tokenizer.encode(want, add_special_tokens=False)
    assert plain[0].prompt_token_ids != cont[0].prompt_token_ids
    assert len(plain[0].token_ids) == len(cont[0].token_ids) == 4
    same = llm.chat(PARTIAL[:1], params=sp)  # the older keyword still works
    assert same[0].token_ids == plain[0].token_ids
    with pytest.raises(TypeError, match="not both"):
        llm.chat(PARTIAL[:1], sampling_params=sp, params=sp)
    with pytest.raises(InvalidRequestError, match="assistant"):
        llm.chat(PARTIAL[:1], sp, continue_final_message=True)
    with pytest.raises(InvalidRequestError, match="messages"):
        llm.chat([{"role": "wizard", "content": "hi"}], sp)


def test_offline_chat_with_tools_reads_the_calls_back(tiny_llama: Path) -> None:
    llm = LLM(model=str(tiny_llama), dtype="float32")
    sp = SamplingParams(temperature=0, max_tokens=120)
    question = [{"role": "user", "content": "Weather in Rome?"}]
    # "required": the grammar makes even this random tiny model write a valid call
    (out,) = llm.chat(question, sp, tools=[WEATHER], tool_choice="required")
    assert out.tool_calls, out.text
    for call in out.tool_calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")
    assert "<tool_call>" in out.text  # the text stays raw, as vLLM's
    # The tools are in the prompt (SmolLM2-style templates: the system message), as over HTTP.
    assert "get_weather" in llm.tokenizer.decode(out.prompt_token_ids)
    (none,) = llm.chat(question, sp, tools=[WEATHER], tool_choice="none")
    assert none.tool_calls == []
    with pytest.raises(InvalidRequestError, match="tool_choice"):
        llm.chat(question, sp, tool_choice="required")  # no tools
    with pytest.raises(InvalidRequestError, match="tool-call parser"):
        llm.chat(question, sp, tools=[WEATHER], tool_call_parser="pythonic-ish")

"""`prompt_cache_key` and `safety_identifier`, OpenAI request fields that clients send, on
/v1/chat/completions, /v1/completions and /v1/responses against the fake engine (in-process):
each accepted (200) through the openai SDK (its own parameter where it has one, else
extra_body) and as raw JSON; `prompt_cache_key` must be a string (else a 400 naming it);
neither changes what reaches the engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from radixserve.ipc.messages import GenerateMsg
from tests.server.test_tools import model_dir, post, serve

__all__ = ["model_dir"]  # the module-scoped fixture, shared

FIELDS = {"prompt_cache_key": "tenant-7/support-bot", "safety_identifier": "user-1f2e3d"}
ROUTES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "m", "max_tokens": 8, "temperature": 0,
                             "messages": [{"role": "user", "content": "Hello there"}]},
    "/v1/completions": {"model": "m", "max_tokens": 8, "temperature": 0, "prompt": "Hello"},
    "/v1/responses": {"model": "m", "max_output_tokens": 8, "temperature": 0,
                      "input": "Hello there"},
}


def _engine_view(msg: GenerateMsg) -> tuple[Any, ...]:
    return (msg.prompt_ids, msg.params, msg.cache_salt, msg.priority)


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("name", list(FIELDS))
async def test_raw_json_is_served_and_reaches_the_engine_unchanged(
        model_dir: Path, route: str, name: str) -> None:
    seen: list[GenerateMsg] = []
    async with serve(model_dir, seen) as tc:
        status, plain = await post(tc, ROUTES[route], route)
        assert status == 200, plain
        status, out = await post(tc, {**ROUTES[route], name: FIELDS[name]}, route)
        assert status == 200, out
        both = {**ROUTES[route], **FIELDS}
        status, _ = await post(tc, both, route)
        assert status == 200
    assert len(seen) == 3
    assert _engine_view(seen[0]) == _engine_view(seen[1]) == _engine_view(seen[2])


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("value", [7, ["a"], {"key": "a"}, True])
async def test_prompt_cache_key_must_be_a_string(model_dir: Path, route: str,
                                                 value: Any) -> None:
    async with serve(model_dir) as tc:
        status, out = await post(tc, {**ROUTES[route], "prompt_cache_key": value}, route)
        assert status == 400, out
        assert out["error"]["type"] == "invalid_request_error"
        assert out["error"]["param"] == "prompt_cache_key"
        assert "prompt_cache_key" in out["error"]["message"]


async def test_openai_sdk_sends_both_on_every_route(model_dir: Path) -> None:
    async with serve(model_dir) as tc:
        client = openai.AsyncOpenAI(base_url=str(tc.make_url("/v1")), api_key="x",
                                    max_retries=0)
        chat = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hello there"}], max_tokens=8,
            temperature=0, prompt_cache_key=FIELDS["prompt_cache_key"],
            safety_identifier=FIELDS["safety_identifier"])
        assert chat.choices[0].message.content is not None
        # The SDK's completions.create has neither parameter: extra_body sends them.
        comp = await client.completions.create(model="m", prompt="Hello", max_tokens=8,
                                               temperature=0, extra_body=FIELDS)
        assert comp.choices[0].text is not None
        resp = await client.responses.create(
            model="m", input="Hello there", max_output_tokens=8, temperature=0,
            prompt_cache_key=FIELDS["prompt_cache_key"],
            safety_identifier=FIELDS["safety_identifier"])
        assert resp.status in ("completed", "incomplete")
        streamed = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hello there"}], max_tokens=8,
            temperature=0, stream=True, prompt_cache_key=FIELDS["prompt_cache_key"])
        assert [c async for c in streamed]
        await client.close()


def test_prompt_cache_key_is_kept_in_the_request_options() -> None:
    from radixserve.api.protocol import parse_chat, parse_completion
    from radixserve.api.responses import to_chat_body

    chat = parse_chat({**ROUTES["/v1/chat/completions"], **FIELDS})
    comp = parse_completion({**ROUTES["/v1/completions"], **FIELDS})
    assert chat.opts.prompt_cache_key == comp.opts.prompt_cache_key == FIELDS["prompt_cache_key"]
    # /v1/responses hands prompt_cache_key on to the chat body it becomes.
    resp = parse_chat(to_chat_body({**ROUTES["/v1/responses"], **FIELDS})[0])
    assert resp.opts.prompt_cache_key == FIELDS["prompt_cache_key"]
    assert parse_chat(ROUTES["/v1/chat/completions"]).opts.prompt_cache_key is None

"""vLLM's /tokenize and /detokenize against the server's own tokenizer and chat template
(fake engine, in-process): shapes, agreement with what a chat request is given, bad input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from tests.server.test_chat_template_options import PARTIAL, TOKENIZER, Served, hint_model, serve

__all__ = ["hint_model"]  # the fixture, shared with the template options tests
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


async def call(srv: Served, path: str, body: Any) -> tuple[int, Any]:
    resp = await srv[0].post(path, data=orjson.dumps(body))
    return resp.status, orjson.loads(await resp.read())


async def test_tokenize_a_prompt_and_back(hint_model: Path) -> None:
    async with serve(hint_model) as srv:
        status, out = await call(srv, "/tokenize", {"prompt": "Hello there", "model": "m",
                                                    "return_token_strs": True})
        assert status == 200, out
        assert out["tokens"] == TOKENIZER.encode("Hello there") and out["count"] == 11
        assert out["max_model_len"] == 4096
        assert out["token_strs"] == TOKENIZER.convert_ids_to_tokens(out["tokens"])
        status, back = await call(srv, "/detokenize", {"tokens": out["tokens"]})
        assert status == 200 and back == {"prompt": "Hello there"}
        status, raw = await call(srv, "/tokenize", {"prompt": "Hi", "add_special_tokens": False})
        assert status == 200 and raw["token_strs"] is None and raw["count"] == 2


async def test_tokenize_a_chat_counts_what_a_chat_request_is_given(hint_model: Path) -> None:
    async with serve(hint_model) as srv:
        extra = {"tools": [WEATHER], "chat_template_kwargs": {"hint": "x"},
                 "continue_final_message": True}
        status, out = await call(srv, "/tokenize", {"messages": PARTIAL, **extra})
        assert status == 200, out
        status, _ = await call(srv, "/v1/chat/completions",
                               {"messages": PARTIAL, "max_tokens": 2, **extra})
        assert status == 200
        assert out["tokens"] == srv[1][-1].prompt_ids  # exactly the prompt the engine got
        assert "get_weather" in TOKENIZER.decode(out["tokens"])


async def test_bad_tokenize_requests_are_400s(hint_model: Path) -> None:
    async with serve(hint_model) as srv:
        cases: list[tuple[str, Any, str | None]] = [
            ("/tokenize", {}, "prompt"),
            ("/tokenize", {"prompt": "a", "messages": PARTIAL}, "prompt"),
            ("/tokenize", {"prompt": 5}, "prompt"),
            ("/tokenize", {"prompt": "a", "n": 2}, "n"),
            ("/tokenize", {"messages": "hi"}, "messages"),
            ("/tokenize", {"messages": PARTIAL, "add_special_tokens": True}, "add_special_tokens"),
            ("/tokenize", {"messages": PARTIAL[:1], "continue_final_message": True},
             "continue_final_message"),
            ("/tokenize", [1], "prompt"),
            ("/detokenize", {}, "tokens"),
            ("/detokenize", {"tokens": [1, "a"]}, "tokens"),
            ("/detokenize", {"tokens": [10**9]}, "tokens"),
            ("/detokenize", {"tokens": [-1]}, "tokens"),
        ]
        for path, body, param in cases:
            status, out = await call(srv, path, body)
            assert status == 400 and out["error"]["param"] == param, (path, body, out)
        status, out = await call(srv, "/tokenize", {"prompt": "a", "model": "other"})
        assert status == 404 and out["error"]["code"] == "model_not_found"
        assert (await call(srv, "/tokenize", {"prompt": "still serving"}))[0] == 200

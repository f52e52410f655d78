"""The replica's `return_token_ids` (vLLM's field; the router resumes broken streams from it):
streamed chunks carry every generated token id, and a choice's first chunk the prompt's."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.server.test_app import GREEDY, TOKENIZER, call, serve, sse

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_stream_carries_all_token_ids(model_dir: Path, path: str) -> None:
    body = {"max_tokens": 7, "stream": True, "ignore_eos": True, **GREEDY,
            "stream_options": {"include_usage": True}}
    if path == "/v1/completions":
        body["prompt"] = "héllo wörld, echoed"  # multi-byte: some tokens have no text alone
    else:
        body["messages"] = [{"role": "user", "content": "héllo wörld"}]
    async with serve(model_dir) as tc:
        plain = await sse(tc, path, body)
        events = await sse(tc, path, {**body, "return_token_ids": True})
        status, err = await call(tc, path, {**body, "return_token_ids": "yes"})
    assert status == 400 and err["error"]["param"] == "return_token_ids"
    assert all("token_ids" not in c for e in plain for c in e["choices"])
    choices = [c for e in events for c in e["choices"]]
    prompt_ids = [c["prompt_token_ids"] for c in choices if "prompt_token_ids" in c]
    ids = [t for c in choices for t in c.get("token_ids", [])]
    usage = events[-1]["usage"]
    assert len(prompt_ids) == 1 and len(prompt_ids[0]) == usage["prompt_tokens"]
    assert len(ids) == usage["completion_tokens"] == 7
    assert ids == prompt_ids[0][:7]  # the fake engine echoes its prompt when greedy
    text = "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                   for c in choices)
    assert text == TOKENIZER.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("n", [1, 2])
async def test_whole_response_carries_token_ids_as_vllm(model_dir: Path, n: int) -> None:
    """Not streamed: a completion's choices each hold `prompt_token_ids` and `token_ids`; a
    chat response holds `prompt_token_ids` and each choice its `token_ids` (vLLM's
    placement); the ids equal the streamed ones."""
    common = {"max_tokens": 6, "ignore_eos": True, "n": n, **GREEDY, "return_token_ids": True}
    completion = {**common, "prompt": "héllo wörld, echoed"}
    chat = {**common, "messages": [{"role": "user", "content": "héllo wörld"}]}
    async with serve(model_dir) as tc:
        s1, whole = await call(tc, "/v1/completions", completion)
        s2, whole_chat = await call(tc, "/v1/chat/completions", chat)
        events = await sse(tc, "/v1/chat/completions", {**chat, "stream": True})
        s3, plain = await call(tc, "/v1/chat/completions", {**chat, "return_token_ids": False})
    assert s1 == s2 == s3 == 200
    prompt = TOKENIZER.encode("héllo wörld, echoed")
    assert len(whole["choices"]) == n
    for choice in whole["choices"]:
        assert choice["prompt_token_ids"] == prompt
        assert choice["token_ids"] == prompt[:6]  # the fake engine echoes its prompt
        assert choice["text"] == TOKENIZER.decode(prompt[:6])
    chat_prompt = whole_chat["prompt_token_ids"]
    assert len(chat_prompt) == whole_chat["usage"]["prompt_tokens"]
    assert "prompt_token_ids" not in whole_chat["choices"][0]
    for choice in whole_chat["choices"]:
        assert choice["token_ids"] == chat_prompt[:6]
        assert choice["message"]["content"] == TOKENIZER.decode(chat_prompt[:6],
                                                                skip_special_tokens=True)
    streamed = [t for e in events for c in e["choices"] if c["index"] == 0
                for t in c.get("token_ids", [])]
    assert streamed == whole_chat["choices"][0]["token_ids"]
    assert [e["prompt_token_ids"] for e in events if "prompt_token_ids" in e][0] == chat_prompt
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]

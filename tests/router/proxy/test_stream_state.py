"""A continuation's logprobs in the client's shape (router/proxy/stream_state.py): SGLang's
`output_token_logprobs` from /generate become completions' tokens / token_logprobs /
top_logprobs / text_offset (carried on from the broken stream) or chat's content entries."""

from __future__ import annotations

from typing import Any

import orjson

from router.proxy.stream_state import StreamState
from router.routing.route_key import RequestKind


def native(text: str, ids: list[int], chosen: list[list[Any]],
           tops: list[list[list[Any]]]) -> bytes:
    meta = {"finish_reason": None, "output_token_logprobs": chosen, "output_top_logprobs": tops}
    return orjson.dumps({"text": text, "output_ids": ids, "meta_info": meta})


def test_completions_logprobs_continue_their_text_offset() -> None:
    st = StreamState(RequestKind.COMPLETIONS, {"prompt": "x", "logprobs": 1, "max_tokens": 5},
                     strip_ids=True)
    first = {"id": "c", "created": 1, "model": "m", "choices": [{
        "index": 0, "text": "ab", "finish_reason": None, "token_ids": [5, 6],
        "prompt_token_ids": [1], "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-1, -2],
                                              "top_logprobs": [{"a": -1}, {"b": -2}],
                                              "text_offset": [0, 1]}}]}
    st.on_openai(orjson.dumps(first))
    body = orjson.loads(st.resume_body(0))
    assert body["return_logprob"] is True and body["top_logprobs_num"] == 1
    assert body["continue_output_tokens"] == 2
    out = st.on_native(native("cd", [7], [[-0.5, 7, "cd"]], [[[-0.5, 7, "cd"]]]))
    assert out is not None
    (choice,) = orjson.loads(out)["choices"]
    assert choice["logprobs"] == {"tokens": ["cd"], "token_logprobs": [-0.5],
                                  "top_logprobs": [{"cd": -0.5}], "text_offset": [2]}
    out = st.on_native(native("cde", [7, 8], [[-0.5, 7, "cd"], [-0.25, 8, "e"]],
                              [[[-0.5, 7, "cd"]], [[-0.25, 8, "e"], [-3.0, 9, "f"]]]))
    assert out is not None
    assert orjson.loads(out)["choices"][0]["logprobs"] == {
        "tokens": ["e"], "token_logprobs": [-0.25], "top_logprobs": [{"e": -0.25, "f": -3.0}],
        "text_offset": [4]}


def test_chat_logprobs_are_content_entries() -> None:
    st = StreamState(RequestKind.CHAT, {"messages": [], "logprobs": True, "top_logprobs": 1},
                     strip_ids=True)
    first = {"id": "c", "created": 1, "model": "m", "choices": [{
        "index": 0, "delta": {"content": "é"}, "finish_reason": None, "token_ids": [5],
        "prompt_token_ids": [1]}]}
    st.on_openai(orjson.dumps(first))
    body = orjson.loads(st.resume_body(0))
    assert body["return_logprob"] is True and body["top_logprobs_num"] == 1
    out = st.on_native(native("", [7], [[-0.5, 7, "\u00e9"]], [[[-0.5, 7, "\u00e9"]]]))
    assert out is not None  # no text yet, but the token's logprob is news
    (choice,) = orjson.loads(out)["choices"]
    entry = {"token": "é", "logprob": -0.5, "bytes": [195, 169]}
    assert choice["logprobs"] == {"content": [{**entry, "top_logprobs": [entry]}]}
    assert "token_ids" not in choice


def test_no_logprobs_asked_none_sent() -> None:
    st = StreamState(RequestKind.CHAT, {"messages": []}, strip_ids=True)
    st.on_openai(orjson.dumps({"id": "c", "choices": [{"index": 0, "token_ids": [5],
                                                       "prompt_token_ids": [1]}]}))
    assert "return_logprob" not in orjson.loads(st.resume_body(0))
    assert st.on_native(native("", [7], [], [])) is None

"""vLLM's /tokenize and /detokenize: the server's own tokenizer and chat template, over HTTP.

Owns: the two routes' request and response shapes (vLLM's):
- POST /tokenize {"prompt": str, "add_special_tokens": true} or {"messages": [...], "tools",
  "add_generation_prompt", "continue_final_message", "chat_template_kwargs"} (+ "model",
  "return_token_strs") -> {"count", "max_model_len", "tokens", "token_strs"}. Chat messages are
  rendered exactly as /v1/chat/completions renders them (tools included), so `count` is the
  prompt size a chat request would have.
- POST /detokenize {"tokens": [int, ...]} (+ "model") -> {"prompt": str}.
Does not know: the engine (no generation happens), sampling.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from radixserve.api.chat_messages import parse_messages, parse_template_options
from radixserve.api.fields import bad, check_fields, get_bool, parse_token_ids
from radixserve.api.lengths import check_token_ids
from radixserve.api.tools.tool_fields import parse_tools
from radixserve.server.app_state import STATE_KEY, read_json
from radixserve.server.error_responses import json_response

_COMMON = frozenset({"model", "return_token_strs", "add_special_tokens"})
_PROMPT_FIELDS = _COMMON | {"prompt"}
_CHAT_FIELDS = _COMMON | {"messages", "tools", "tool_choice", "add_generation_prompt",
                          "continue_final_message", "chat_template_kwargs"}


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    state.ensure_ready()
    body = await read_json(request)
    if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
        raise bad("give exactly one of 'prompt' (text) and 'messages' (a chat)", "prompt")
    state.check_model(body.get("model"))
    special = get_bool(body, "add_special_tokens")
    if "prompt" in body:
        check_fields(body, _PROMPT_FIELDS)
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise bad("'prompt' must be a string", "prompt")
        ids = await state.encode(prompt, add_special_tokens=special is not False)
    else:
        check_fields(body, _CHAT_FIELDS)
        if special:
            raise bad("'add_special_tokens' is only supported with 'prompt' (a chat template "
                      "writes its own special tokens)", "add_special_tokens")
        messages = parse_messages(body.get("messages"))
        template = parse_template_options(body, [m["role"] for m in messages])
        ids = await state.encode_messages(messages, parse_tools(body, state.check_constraint),
                                          template)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": state.max_model_len,
                           "tokens": ids, "token_strs": None}
    if get_bool(body, "return_token_strs"):
        out["token_strs"] = list(state.tokenizer.convert_ids_to_tokens(ids))
    return json_response(out)


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    state.ensure_ready()
    body = check_fields(await read_json(request), frozenset({"model", "tokens"}))
    state.check_model(body.get("model"))
    if "tokens" not in body:
        raise bad("'tokens' is required: a list of token ids", "tokens")
    ids = parse_token_ids(body["tokens"], "tokens")
    check_token_ids(ids, state.vocab_size, "tokens")
    return json_response({"prompt": state.tokenizer.decode(list(ids))})


def add_tokenize_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)

"""Prompts into token ids for the API server: loading the tokenizer, encoding text and chats.

Owns: where the tokenizer is loaded (a worker thread: transformers takes seconds to import),
encoding off the event loop for long inputs, and the chat template's errors as 400s. How
tools, calls and results reach the template is radixserve/api/tools/prompt.py's.
Does not know: HTTP, admission, the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from radixserve.api.errors import APIError
from radixserve.api.lengths import check_token_ids
from radixserve.api.protocol import PromptInput
from radixserve.api.tools.parsers import CallFormat
from radixserve.api.tools.prompt import template_messages
from radixserve.api.tools.tool_fields import ToolsSpec
from radixserve.types import TemplateOptions

OFFLOAD_CHARS = 2048  # tokenize longer inputs in a thread so one huge prompt stalls no one


def load_tokenizer(path: Path) -> Any:
    # NOTE: radixserve.tokenizer imports transformers (seconds): imported here, in a worker
    # thread, so the server binds and the engine starts loading without waiting for it.
    from radixserve.tokenizer import load_tokenizer as load

    return load(path)


def _encode_prompt(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    from radixserve.tokenizer import encode_prompt  # already imported by load_tokenizer

    return encode_prompt(tokenizer, text, add_special_tokens)


def _encode_chat(tokenizer: Any, messages: list[dict[str, Any]],
                 tools: list[dict[str, Any]] | None, template: TemplateOptions) -> list[int]:
    from radixserve.tokenizer import encode_chat

    return encode_chat(tokenizer, messages, tools=tools, options=template)


async def _offload(size: int, fn: Any, *args: Any) -> list[int]:
    if size <= OFFLOAD_CHARS:
        result: list[int] = fn(*args)
        return result
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def encode_prompt(tokenizer: Any, vocab_size: int, prompt: PromptInput,
                        add_special_tokens: bool = True) -> list[int]:
    """Text is tokenized; token ids are checked against the vocabulary."""
    if isinstance(prompt, str):
        return await _offload(len(prompt), _encode_prompt, tokenizer, prompt,
                              add_special_tokens)
    check_token_ids(prompt, vocab_size, "prompt")
    return list(prompt)


async def encode_messages(tokenizer: Any, messages: Sequence[dict[str, Any]],
                          tools: ToolsSpec | None, call_format: CallFormat, native_tools: bool,
                          template: TemplateOptions) -> list[int]:
    """The chat prompt; tools, calls and results rendered as api/tools/prompt.py says."""
    msgs, tool_list = template_messages(messages, tools, call_format, native_tools)
    size = sum(len(m["content"] or "") for m in msgs)
    if tool_list is not None:
        size += len(orjson.dumps(tool_list))
    size += len(orjson.dumps(template.kwargs)) if template.kwargs else 0
    try:
        return await _offload(size, _encode_chat, tokenizer, msgs, tool_list, template)
    except ValueError as err:  # no chat template
        raise APIError(400, str(err), param="messages") from err
    except Exception as err:  # a template that rejects the conversation (jinja raise)
        # TypeError: a chat_template_kwargs value the template cannot use
        if type(err).__module__.startswith("jinja2") or isinstance(err, TypeError):
            raise APIError(400, f"chat template error: {err}", param="messages") from err
        raise

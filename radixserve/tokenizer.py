"""Prompt encoding shared by the server, the offline API and the router's precise mode.

Owns: how text and chat messages become token ids (one place, so that a router that
tokenizes computes exactly the ids a replica caches). Does not know: HTTP, the engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from radixserve.types import RESERVED_TEMPLATE_KWARGS, TemplateOptions


def load_tokenizer(hf_dir: str | Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(hf_dir))


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str,
                  add_special_tokens: bool = True) -> list[int]:
    """Completions prompt: the tokenizer's own special-token handling (BOS where it has one),
    unless `add_special_tokens` is false (/tokenize's option)."""
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    options: TemplateOptions | None = None,
) -> str:
    """`tools` (OpenAI's tool list) only for templates that render tools themselves;
    `options` overrides `add_generation_prompt`."""
    if tokenizer.chat_template is None:
        raise ValueError("this model has no chat template; use /v1/completions")
    extra: dict[str, Any] = {} if tools is None else {"tools": tools}
    if options is not None:
        assert not RESERVED_TEMPLATE_KWARGS & options.kwargs.keys(), options.kwargs
        extra.update(options.kwargs)
        add_generation_prompt = options.add_generation_prompt
        if options.continue_final_message:
            extra["continue_final_message"] = True
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
    )
    assert isinstance(text, str)
    return text


def encode_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    options: TemplateOptions | None = None,
) -> list[int]:
    """Chat prompt: the rendered template already holds every special token it needs."""
    text = render_chat(tokenizer, messages, add_generation_prompt, tools, options)
    return list(tokenizer.encode(text, add_special_tokens=False))


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model_eos: Any = None) -> tuple[int, ...]:
    """EOS ids from the model config (int or list) and the tokenizer, deduplicated."""
    ids: list[int] = []
    if isinstance(model_eos, int):
        ids.append(model_eos)
    elif isinstance(model_eos, (list, tuple)):
        ids.extend(int(x) for x in model_eos)
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return tuple(dict.fromkeys(ids))

"""What a request is routed by: its prompt, cut into chained block hashes.

Owns: reading the prompt out of an OpenAI / native request body, the canonical form hashed
by the approximate index, the cache salt a replica will use for the request, and (precise
mode) the token-block hashes a replica would announce for it. Does not know: workers,
policies, HTTP handlers.

Approximate keys (router-internal, never compared with a replica):
  - token ids (`prompt: [int]`, `input_ids`): `block_hashes(ids, kv_block_size, salt)`
  - text (`prompt: str`, `text`): chained hashes of its UTF-8 bytes in `block_chars` blocks
  - chat: chained hashes of orjson([[role, content], ...]) over the WHOLE message list (keys
    sorted), so turn n+1 of a conversation extends turn n's bytes and matches its blocks.
    A Responses API request (`input` items, `instructions`) is keyed by the chat messages it
    amounts to (radixserve.api.responses), as the replica renders it.
Precise keys: `block_hashes(token ids, kv_block_size, salt, algo)`, the replica's own chain
(xxh64, or vLLM's sha256_cbor: `--prefix-caching-hash-algo`, the replicas' flag). A
request with a Bearer key gets two chains, salted and unsalted: a replica with auth on salts
by the key (and holds no unsalted blocks), one with auth off or --shared-cache salts nothing
(and holds no salted ones), so the better of the two matches is exact either way and the
router need not know how each replica is configured. The first chain is the namespace the
router is configured for (`salt_by_api_key`); only it is noted as pending after routing.
LoRA: a request's `model` may name an adapter, whose K/V differ from the base model's for the
same prompt. Approximate keys are namespaced by `model` (so one adapter's prefix goes to one
replica, and two adapters' never collide); precise mode adds the chains of the adapter
namespace (`salt + "\x00lora:" + model`, what a replica's events hash adapter blocks under,
radixserve/lora/namespace.py) first, and keeps the plain ones: if `model` is the base model's
name no replica announces the adapter chain, and the plain chain matches.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import orjson

from radixserve.api.api_keys import cache_salt_for_api_key
from radixserve.api.responses import input_messages
from radixserve.config.kv_events_config import HashAlgo
from radixserve.kv_events.publisher import block_hashes, chained_hashes
from radixserve.lora.namespace import routing_namespace
from radixserve.types import InvalidRequestError


class RequestKind(enum.Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"
    RESPONSES = "responses"  # OpenAI's Responses API: routed as the chat it amounts to
    GENERATE = "generate"


class Prompt(NamedTuple):
    """Exactly one field is set, or none when the body has no usable prompt."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True


class RouteKey(NamedTuple):
    approx_hashes: tuple[int, ...]
    # Precise mode: the replica-side chains, one per candidate salt, all the same length;
    # empty when the prompt was not tokenized (no tokenizer, or not in precise mode).
    token_chains: tuple[tuple[int, ...], ...] = ()
    # Canary groups: the session's point in [0, 1) (canary.py); None: any group may serve.
    split_point: float | None = None
    # Session affinity (session.py): the request's session id, None without one.
    session: str | None = None
    # A Responses chain: the replica holding its previous_response_id (fleet/response_owners.py)
    pinned: str | None = None


class PromptEncoder(Protocol):
    """Turns prompts into the token ids a replica computes (radixserve.tokenizer's rules)."""

    def encode_prompt(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        ...


class HFPromptEncoder:
    """The replicas' own encoding functions over a tokenizer folder."""

    def __init__(self, hf_dir: str | Path) -> None:
        from radixserve.tokenizer import load_tokenizer

        self._tok = load_tokenizer(hf_dir)

    def encode_prompt(self, text: str) -> list[int]:
        from radixserve.tokenizer import encode_prompt

        return encode_prompt(self._tok, text)

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        from radixserve.tokenizer import encode_chat

        return encode_chat(self._tok, messages, add_generation_prompt)


def load_prompt_encoder(spec: str) -> HFPromptEncoder:
    """`spec` as `radixserve serve --model` takes it, resolved to its HF folder."""
    from radixserve.model_source import resolve_model

    return HFPromptEncoder(resolve_model(spec).hf_dir)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def extract_prompt(kind: RequestKind, body: Any) -> Prompt:
    """The prompt to route by; a list of prompts routes by its first one."""
    if not isinstance(body, dict):
        return Prompt()
    if kind is RequestKind.RESPONSES:
        try:
            return Prompt(messages=input_messages(body.get("input"), body.get("instructions")))
        except InvalidRequestError:  # the replica answers it with its 400
            return Prompt()
    if kind is RequestKind.CHAT:
        messages = body.get("messages")
        if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
            agp = body.get("add_generation_prompt", True)
            return Prompt(messages=messages, add_generation_prompt=agp is not False)
        return Prompt()
    value: Any = body.get("prompt") if kind is RequestKind.COMPLETIONS else (
        body.get("text") if "text" in body else body.get("input_ids")
    )
    if isinstance(value, list) and value and (isinstance(value[0], (str, list))):
        value = value[0]
    if isinstance(value, str) and value:
        return Prompt(text=value)
    if _is_ids(value):
        return Prompt(token_ids=list(value))
    return Prompt()


def salt_for(authorization: str | None, salt_by_api_key: bool) -> str:
    """The salt a replica namespaces this request's cache with (its Bearer key's)."""
    if not salt_by_api_key or not authorization:
        return ""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return ""
    return cache_salt_for_api_key(token.strip())


def model_of(body: Any) -> str | None:
    """The request's `model` (a base model or a LoRA adapter name), if it names one."""
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) and model else None


def route_salts(salt: str, model: str | None) -> tuple[tuple[str, ...], str]:
    """(precise mode's candidate namespaces, the approximate key's namespace); see the
    module docstring."""
    plain = (salt,) if not salt else (salt, "")
    if model is None:
        return plain, salt
    return tuple(routing_namespace(s, model) for s in plain) + plain, routing_namespace(
        salt, model)


def canonical_chat(messages: list[dict[str, Any]]) -> bytes:
    pairs = [[m.get("role"), m.get("content")] for m in messages]
    return orjson.dumps(pairs, option=orjson.OPT_SORT_KEYS)


def approx_hashes(prompt: Prompt, salt: str, block_chars: int, kv_block_size: int) -> list[int]:
    if prompt.token_ids is not None:
        return block_hashes(prompt.token_ids, kv_block_size, salt)
    if prompt.text is not None:
        data = prompt.text.encode("utf-8")
    elif prompt.messages is not None:
        data = canonical_chat(prompt.messages)
    else:
        return []
    num_blocks = len(data) // block_chars
    return chained_hashes(
        (data[i * block_chars : (i + 1) * block_chars] for i in range(num_blocks)), salt
    )


def encoding_chars(prompt: Prompt) -> int:
    """Characters a tokenizer would read for this prompt (0: token ids, nothing to encode)."""
    if prompt.text is not None:
        return len(prompt.text)
    if prompt.messages is not None:
        return len(canonical_chat(prompt.messages))
    return 0


def token_chains(
    prompt: Prompt, salts: Sequence[str], kv_block_size: int, encoder: PromptEncoder | None,
    algo: HashAlgo = HashAlgo.XXH64,
) -> list[tuple[int, ...]]:
    """The replica's block hashes for this prompt under each salt; [] if not tokenizable here.

    Blocking (a tokenizer run): call it off the event loop for text and chat prompts.
    """
    ids: Sequence[int] | None = prompt.token_ids
    try:
        if ids is None and encoder is not None:
            if prompt.text is not None:
                ids = encoder.encode_prompt(prompt.text)
            elif prompt.messages is not None:
                ids = encoder.encode_chat(prompt.messages, prompt.add_generation_prompt)
    except Exception:
        # Tokenizers and chat templates raise many types (jinja2 errors, ValueError for a
        # model without a template, ...); the replica answers the 400, routing just goes on.
        return []
    if ids is None:
        return []
    return [tuple(block_hashes(ids, kv_block_size, salt, algo)) for salt in salts]

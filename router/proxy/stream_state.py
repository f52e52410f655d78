"""What a streamed OpenAI answer has delivered so far, and how it may be resumed exactly.

Owns: whether a request can be resumed token-exactly (`why_not_resumable`), the body sent
upstream (`return_token_ids` added: the replica's chunks then carry each token id and the
prompt's ids), StreamState (id, created, model, prompt and output token ids, finish, usage)
fed by the upstream's SSE events, the stripping of the token ids the client did not ask for,
the native /generate request that continues the stream, and the OpenAI chunks written for
that continuation's events. Does not know: HTTP, workers, retries (resume.py drives it).

Exactness: the continuation is `/generate` with `input_ids` = prompt ids + the output ids
already sent and the same sampling parameters, so greedy decoding continues identically, and
so does seeded sampling (the engine reseeds from (seed, tokens so far)). What cannot continue
exactly is refused up front (an error event if the stream breaks): n > 1, several prompts,
echo, logprobs, penalties (they count output tokens, which the continuation sees as prompt),
tool calls (their parser's state), output constraints (their grammar's state), and any field
this module does not know.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson

from radixserve.api.protocol import COMPLETIONS_DEFAULT_MAX_TOKENS  # the replica's default
from router.routing.route_key import RequestKind

ID_FIELDS = ("token_ids", "prompt_token_ids")
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
             "ignore_eos", "logit_bias")
# Fields that change nothing a continuation must reproduce beyond what the ids carry.
_NEUTRAL = frozenset({"model", "prompt", "messages", "stream", "stream_options", "max_tokens",
                      "max_completion_tokens", "min_tokens", "priority", "timeout", "user",
                      "prompt_cache_key", "safety_identifier", "return_token_ids",
                      "add_generation_prompt", "continue_final_message",
                      "chat_template_kwargs", *_SAMPLING})
_OFF_VALUES: dict[str, tuple[Any, ...]] = {  # a field that is harmless at these values
    "n": (None, 1), "echo": (None, False), "logprobs": (None, False),
    "top_logprobs": (None, 0), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0),
    "response_format": (None, {"type": "text"}), "parallel_tool_calls": (None, True, False),
}


class NotContinuable(StrEnum):
    """Why the stream so far cannot be continued on another replica (the value: for logs)."""

    ANSWER_COMPLETE = "the answer was complete"  # only the usage / [DONE] was lost
    NO_TOKEN_IDS = "the replica's stream carries no token ids"


def why_not_resumable(kind: RequestKind, body: dict[str, Any]) -> str | None:
    """None when a broken stream of this request can be continued exactly; else why not."""
    for name, value in body.items():
        if name in _NEUTRAL:
            continue
        if name in _OFF_VALUES and value in _OFF_VALUES[name]:
            continue
        if name in ("tools", "tool_choice") and body.get("tool_choice") == "none":
            continue
        return f"'{name}' is set"
    if kind is RequestKind.COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) \
                and len(prompt) > 1:
            return "several prompts"
    return None


def upstream_body(body: dict[str, Any]) -> bytes:
    return orjson.dumps({**body, "return_token_ids": True})


@dataclass
class StreamState:
    kind: RequestKind
    body: dict[str, Any]
    strip_ids: bool  # the client did not ask for token ids: they are the router's
    id: Any = None
    created: Any = None
    model: Any = None
    prompt_ids: list[int] | None = None
    output_ids: list[int] = field(default_factory=list)
    ids_seen: bool = False  # the replica sent token ids (it supports return_token_ids)
    finish_reason: str | None = None
    usage_sent: bool = False
    done: bool = False  # [DONE] written
    cached_tokens: int = 0
    # The continuation being relayed: its cumulative text and ids seen so far.
    _cont_text: int = 0
    _cont_ids: int = 0

    @property
    def include_usage(self) -> bool:
        opts = self.body.get("stream_options")
        return isinstance(opts, dict) and opts.get("include_usage") is True

    def max_tokens(self) -> int | None:
        for name in ("max_completion_tokens", "max_tokens"):
            value = self.body.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return COMPLETIONS_DEFAULT_MAX_TOKENS if self.kind is RequestKind.COMPLETIONS else None

    def why_not_continuable(self) -> NotContinuable | None:
        """None when the stream so far carried what a continuation needs; else why not."""
        if self.finish_reason is not None:
            return NotContinuable.ANSWER_COMPLETE
        if self.prompt_ids is None or not self.ids_seen:
            return NotContinuable.NO_TOKEN_IDS
        return None

    # --- the original replica's OpenAI events --------------------------------------------

    def on_openai(self, payload: bytes) -> bytes:
        """Note one upstream event; the bytes to relay (token ids stripped if the router's)."""
        event = orjson.loads(payload)
        if not isinstance(event, dict):
            return payload
        if self.id is None:
            self.id, self.created, self.model = (event.get("id"), event.get("created"),
                                                 event.get("model"))
        if event.get("usage"):
            self.usage_sent = True
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if isinstance(choice.get("prompt_token_ids"), list):
                self.prompt_ids = choice["prompt_token_ids"]
            if isinstance(choice.get("token_ids"), list):
                self.ids_seen = True
                self.output_ids.extend(choice["token_ids"])
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
            if self.strip_ids:
                for name in ID_FIELDS:
                    choice.pop(name, None)
        return orjson.dumps(event) if self.strip_ids else payload

    # --- the continuation ----------------------------------------------------------------

    def remaining(self) -> int | None:
        limit = self.max_tokens()
        return None if limit is None else max(0, limit - len(self.output_ids))

    def resume_body(self) -> bytes:
        """The native /generate request that continues the stream (why_not_continuable None)."""
        assert self.prompt_ids is not None
        sp: dict[str, Any] = {k: self.body[k] for k in _SAMPLING if self.body.get(k) is not None}
        sp["max_new_tokens"] = self.remaining()
        min_tokens = self.body.get("min_tokens")
        if isinstance(min_tokens, int) and min_tokens > len(self.output_ids):
            sp["min_new_tokens"] = min_tokens - len(self.output_ids)
        out: dict[str, Any] = {"input_ids": [*self.prompt_ids, *self.output_ids],
                               "sampling_params": sp, "stream": True}
        for name in ("priority", "timeout"):
            if self.body.get(name) is not None:
                out[name] = self.body[name]
        self._cont_text = self._cont_ids = 0
        return orjson.dumps(out)

    def chunk(self, text: str, ids: list[int], finish: str | None) -> dict[str, Any]:
        if self.kind is RequestKind.CHAT:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text} if text else {},
                                      "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        if not self.strip_ids:
            choice["token_ids"] = ids
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": [choice]}

    def on_native(self, payload: bytes) -> bytes | None:
        """One event of the continuation (/generate: cumulative text and output_ids) as the
        OpenAI chunk the client would have got; None when it adds nothing."""
        event = orjson.loads(payload)
        text, ids = event.get("text", ""), event.get("output_ids", [])
        meta = event.get("meta_info") or {}
        new_ids = ids[self._cont_ids:]
        delta = text[self._cont_text:]
        self._cont_ids, self._cont_text = len(ids), len(text)
        self.output_ids.extend(new_ids)
        reason = meta.get("finish_reason")
        finish = reason.get("type") if isinstance(reason, dict) else None
        self.finish_reason = finish or self.finish_reason
        cached = meta.get("cached_tokens")
        if isinstance(cached, int):
            self.cached_tokens = min(cached, len(self.prompt_ids or ()))
        if not (delta or finish or (new_ids and not self.strip_ids)):
            return None
        return orjson.dumps(self.chunk(delta, new_ids, finish))

    def closing_events(self) -> list[bytes]:
        """After a continuation ended: the usage chunk (if asked for) for the whole answer."""
        if not self.include_usage or self.usage_sent:
            return []
        prompt = len(self.prompt_ids or ())
        usage = {"prompt_tokens": prompt, "completion_tokens": len(self.output_ids),
                 "total_tokens": prompt + len(self.output_ids),
                 "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        self.usage_sent = True
        return [orjson.dumps({"id": self.id, "object": self.chunk("", [], None)["object"],
                              "created": self.created, "model": self.model, "choices": [],
                              "usage": usage})]

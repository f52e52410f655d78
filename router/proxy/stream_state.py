"""What a streamed OpenAI answer has delivered so far, and how it may be resumed exactly.

Owns: whether a request can be resumed token-exactly (`why_not_resumable`), the body sent
upstream (`return_token_ids` added: the replica's chunks then carry each token id and the
prompt's ids), StreamState (id, created, model, prompt and output token ids, finish, usage)
fed by the upstream's SSE events, the stripping of the token ids the client did not ask for,
the native /generate request that continues the stream, and the OpenAI chunks written for
that continuation's events. Does not know: HTTP, workers, retries (resume.py drives it).

Exactness: the continuation is `/generate` with `input_ids` = prompt ids + the output ids
already sent, `continue_output_tokens` = how many of them are output, and the same sampling
parameters, so greedy decoding continues identically, and so does seeded sampling (the engine
reseeds from (seed, tokens so far)). The replica replays those output ids through its
detokenizer and stop matcher (radixserve/server/choice_stream.py), so the text the broken
stream still held back (a possible start of a stop string, a character's first bytes) comes
out of the continuation, and a stop string that straddles the break ends it. With `n` > 1
each unfinished choice continues on its own (seeded as the replica seeds choice i: seed + i).
Logprobs: the continuation returns SGLang's `output_token_logprobs` / `output_top_logprobs`,
written here in the client's shape (completions' text_offset carried on from the stream).
What cannot continue
exactly is refused up front (an error event if the stream breaks): several prompts,
echo, penalties (they count output tokens, which the continuation sees as prompt),
tool calls (their parser's state), output constraints (their grammar's state), and any field
this module does not know.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson

from radixserve.api.lengths import choice_seed
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
                      "chat_template_kwargs", "n", "logprobs", "top_logprobs", *_SAMPLING})
_OFF_VALUES: dict[str, tuple[Any, ...]] = {  # a field that is harmless at these values
    "echo": (None, False), "presence_penalty": (None, 0, 0.0),
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
class ChoiceProgress:
    """One choice (`n` > 1: one of several) as the client has it so far."""

    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    # Its continuation being relayed: the cumulative text and ids seen so far.
    cont_text: int = 0
    cont_ids: int = 0
    next_offset: int = 0  # completions logprobs: the text_offset of its next token


@dataclass
class StreamState:
    kind: RequestKind
    body: dict[str, Any]
    strip_ids: bool  # the client did not ask for token ids: they are the router's
    id: Any = None
    created: Any = None
    model: Any = None
    prompt_ids: list[int] | None = None
    choices: dict[int, ChoiceProgress] = field(default_factory=dict)
    ids_seen: bool = False  # the replica sent token ids (it supports return_token_ids)
    usage_sent: bool = False
    cached_tokens: int = 0
    current: int = 0  # the choice whose continuation is being relayed

    @property
    def include_usage(self) -> bool:
        opts = self.body.get("stream_options")
        return isinstance(opts, dict) and opts.get("include_usage") is True

    @property
    def num_choices(self) -> int:
        n = self.body.get("n")
        return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1

    def choice(self, index: int) -> ChoiceProgress:
        return self.choices.setdefault(index, ChoiceProgress())

    def unfinished(self) -> list[int]:
        return [i for i in range(self.num_choices) if self.choice(i).finish_reason is None]

    def max_tokens(self) -> int | None:
        for name in ("max_completion_tokens", "max_tokens"):
            value = self.body.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return COMPLETIONS_DEFAULT_MAX_TOKENS if self.kind is RequestKind.COMPLETIONS else None

    def why_not_continuable(self) -> NotContinuable | None:
        """None when the stream so far carried what a continuation needs; else why not."""
        if not self.unfinished():
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
            if not isinstance(choice, dict) or not isinstance(choice.get("index", 0), int):
                continue
            progress = self.choice(choice.get("index", 0))
            if isinstance(choice.get("prompt_token_ids"), list):
                self.prompt_ids = choice["prompt_token_ids"]
            if isinstance(choice.get("token_ids"), list):
                self.ids_seen = True
                progress.output_ids.extend(choice["token_ids"])
            if choice.get("finish_reason") is not None:
                progress.finish_reason = choice["finish_reason"]
            lp = choice.get("logprobs")
            if isinstance(lp, dict) and lp.get("text_offset") and lp.get("tokens"):
                progress.next_offset = lp["text_offset"][-1] + len(lp["tokens"][-1])
            if self.strip_ids:
                for name in ID_FIELDS:
                    choice.pop(name, None)
        return orjson.dumps(event) if self.strip_ids else payload

    # --- the continuation ----------------------------------------------------------------

    def remaining(self, index: int) -> int | None:
        limit = self.max_tokens()
        return None if limit is None else max(0, limit - len(self.choice(index).output_ids))

    def resume_body(self, index: int) -> bytes:
        """The native /generate request that continues choice `index` (why_not_continuable
        None); its events then go to on_native."""
        assert self.prompt_ids is not None
        progress = self.choice(index)
        sp: dict[str, Any] = {k: self.body[k] for k in _SAMPLING if self.body.get(k) is not None}
        if index and isinstance(sp.get("seed"), int):
            sp["seed"] = choice_seed(sp["seed"], index)  # as the replica seeds choice `index`
        sp["max_new_tokens"] = self.remaining(index)
        min_tokens = self.body.get("min_tokens")
        if isinstance(min_tokens, int) and min_tokens > len(progress.output_ids):
            sp["min_new_tokens"] = min_tokens - len(progress.output_ids)
        out: dict[str, Any] = {"input_ids": [*self.prompt_ids, *progress.output_ids],
                               "sampling_params": sp, "stream": True}
        if progress.output_ids:
            # The replica replays them through its detokenizer and stop matcher: the text it
            # held back is sent (or cut at a stop string that straddles the break).
            out["continue_output_tokens"] = len(progress.output_ids)
        for name in ("priority", "timeout"):
            if self.body.get(name) is not None:
                out[name] = self.body[name]
        top = self.top_logprobs()
        if top is not None:
            out["return_logprob"], out["top_logprobs_num"] = True, top
        self.current = index
        progress.cont_text = progress.cont_ids = 0
        return orjson.dumps(out)

    def top_logprobs(self) -> int | None:
        """How many alternatives per token the client asked for (None: no logprobs)."""
        if self.kind is RequestKind.CHAT:
            if self.body.get("logprobs") is not True:
                return None
            top = self.body.get("top_logprobs")
            return top if isinstance(top, int) else 0
        top = self.body.get("logprobs")
        return top if isinstance(top, int) and not isinstance(top, bool) else None

    def chunk(self, text: str, ids: list[int], finish: str | None, index: int = 0,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.kind is RequestKind.CHAT:
            choice: dict[str, Any] = {"index": index,
                                      "delta": {"content": text} if text else {},
                                      "logprobs": logprobs, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs,
                      "finish_reason": finish}
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
        progress = self.choice(self.current)
        new_ids = ids[progress.cont_ids:]
        delta = text[progress.cont_text:]
        progress.cont_ids, progress.cont_text = len(ids), len(text)
        progress.output_ids.extend(new_ids)
        reason = meta.get("finish_reason")
        finish = reason.get("type") if isinstance(reason, dict) else None
        progress.finish_reason = finish or progress.finish_reason
        cached = meta.get("cached_tokens")
        if isinstance(cached, int):
            self.cached_tokens = min(cached, len(self.prompt_ids or ()))
        lps = self._logprobs(progress, meta, len(ids) - len(new_ids), len(ids))
        if not (delta or finish or (new_ids and (not self.strip_ids or lps is not None))):
            return None
        return orjson.dumps(self.chunk(delta, new_ids, finish, self.current, lps))

    def _logprobs(self, progress: ChoiceProgress, meta: dict[str, Any], start: int,
                  end: int) -> dict[str, Any] | None:
        """The continuation's tokens start..end in the client's logprobs shape (the replica's
        own: radixserve/server/routes/openai.py), from SGLang's lists; None if not asked."""
        if self.top_logprobs() is None:
            return None
        chosen = (meta.get("output_token_logprobs") or [])[start:end]
        tops = (meta.get("output_top_logprobs") or [])[start:end]
        if self.kind is RequestKind.CHAT:
            def entry(logprob: float, text: str) -> dict[str, Any]:
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

            return {"content": [{**entry(lp, text), "top_logprobs": [
                entry(v, t) for v, _, t in top or ()]}
                for (lp, _, text), top in zip(chosen, tops, strict=True) if lp is not None]}
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                     "text_offset": []}
        for (lp, _, text), top in zip(chosen, tops, strict=True):
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(None if top is None else {t: v for v, _, t in top})
            out["text_offset"].append(progress.next_offset)
            progress.next_offset += len(text)
        return out

    def closing_events(self) -> list[bytes]:
        """After the continuations ended: the usage chunk (if asked for) for the whole
        answer, every choice counted."""
        if not self.include_usage or self.usage_sent:
            return []
        prompt = len(self.prompt_ids or ())
        completion = sum(len(self.choice(i).output_ids) for i in range(self.num_choices))
        usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                 "total_tokens": prompt + completion,
                 "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        self.usage_sent = True
        return [orjson.dumps({"id": self.id, "object": self.chunk("", [], None)["object"],
                              "created": self.created, "model": self.model, "choices": [],
                              "usage": usage})]

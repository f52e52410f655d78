"""Core request-level types shared by the scheduler, the model runner and the engine.

Owns: SamplingParams (frozen, validated), FinishReason, Phase, TokenOutput, TokenLogprobs,
TemplateOptions (how a chat is rendered) and InvalidRequestError: the types both sides of the
process boundary use (torch-free).
Does not know: HTTP, tokenizers, KV tensors, the engine's Req (radixserve/sched/req.py).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from radixserve.constraints import Constraint


class InvalidRequestError(ValueError):
    """A user error in a request (bad parameter, prompt too long). Servers map it to 4xx."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


# Names apply_chat_template (or tokenizer.py) sets itself: not overridable as template kwargs.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


@dataclass(frozen=True)
class TemplateOptions:
    """How a conversation is rendered: vLLM's chat extras, with its rules (checked here, so
    the HTTP and offline APIs refuse the same things)."""

    add_generation_prompt: bool = True  # open an assistant turn for the reply
    continue_final_message: bool = False  # leave the last (assistant) message open instead
    kwargs: dict[str, Any] = field(default_factory=dict)  # extra template variables

    def __post_init__(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidRequestError(
                "'continue_final_message' and 'add_generation_prompt' cannot both be true "
                "(set add_generation_prompt to false to continue the last message)",
                "continue_final_message")
        bad_keys = sorted(k for k in self.kwargs if not isinstance(k, str)
                          or k in RESERVED_TEMPLATE_KWARGS)
        if bad_keys:
            raise InvalidRequestError(
                f"'chat_template_kwargs' may not set {', '.join(map(repr, bad_keys))} (set by "
                "the request itself)", "chat_template_kwargs")

    def check_messages(self, roles: list[str]) -> None:
        if self.continue_final_message and (not roles or roles[-1] != "assistant"):
            raise InvalidRequestError("'continue_final_message' needs the last message to be "
                                      "an assistant message", "continue_final_message")


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # client went away or was cancelled


class Phase(enum.Enum):
    PREFILL = "prefill"  # (a chunk of) the uncomputed suffix of each request's prompt
    DECODE = "decode"  # one new token per request
    MIXED = "mixed"  # one new token for each running request, then prefill chunks


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, with vLLM's semantics.

    temperature < 1e-5 is greedy; top_k 0 or -1 disables top-k; top_p in (0, 1];
    min_p in [0, 1]; presence/frequency penalties in [-2, 2]; repetition_penalty in (0, 2].
    `max_tokens=None` means "fill the remaining context".
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # number of top logprobs per token; 0 = only the sampled one
    # Grammar-constrained decoding (JSON schema, regex, choice, EBNF, tool calls); None = free.
    constraint: Constraint | None = None
    # Added to the logits of these token ids before sampling (OpenAI's / vLLM's logit_bias:
    # -100 bans a token, +100 all but forces it). A {token_id: bias} mapping is accepted and
    # kept as ((token_id, bias), ...) sorted by id.
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    # Sequences per prompt (vLLM's offline n; the HTTP routes take OpenAI's `n` field instead):
    # LLM.generate runs n requests, sequence i of a seeded one sampling with seed + i. The
    # engine runs one sequence per request.
    n: int = 1

    def __post_init__(self) -> None:
        def bad(msg: str, param: str) -> InvalidRequestError:
            return InvalidRequestError(msg, param=param)

        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= 128:
            raise bad(f"n must be an integer in [1, 128], got {self.n!r}", "n")

        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)):
            raise bad("temperature must be a finite number", "temperature")
        if self.temperature < 0:
            raise bad(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise bad(f"top_k must be -1 (disabled), 0 (disabled) or >= 1, got {self.top_k}", "top_k")
        if not 0 <= self.min_p <= 1:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise bad(f"{name} must be in [-2, 2], got {value}", name)
        if not 0 < self.repetition_penalty <= 2:
            raise bad(
                f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
                "repetition_penalty",
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.min_tokens < 0:
            raise bad(f"min_tokens must be >= 0, got {self.min_tokens}", "min_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad(f"logprobs must be in [0, 20], got {self.logprobs}", "logprobs")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as ((token_id, bias), ...) (what __post_init__ normalized it to)."""
        assert isinstance(self.logit_bias, tuple)
        return self.logit_bias

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1.0
        )


def _bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    items = list(value.items()) if isinstance(value, Mapping) \
        else list(value)  # type: ignore[call-overload]
    pairs = []
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise InvalidRequestError("logit_bias must map token ids to numbers", "logit_bias")
        tok, bias = item
        if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
            raise InvalidRequestError(f"logit_bias keys must be token ids (integers >= 0), "
                                      f"got {tok!r}", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                or not -100 <= bias <= 100:
            raise InvalidRequestError(f"logit_bias values must be numbers in [-100, 100], got "
                                      f"{bias!r} for token {tok}", "logit_bias")
        pairs.append((tok, float(bias)))
    return tuple(sorted(pairs))


@dataclass(frozen=True)
class TokenLogprobs:
    token_logprob: float
    top: tuple[tuple[int, float], ...]  # (token_id, logprob), best first


@dataclass(slots=True)
class TokenOutput:
    """One new token (or a finish without one, on abort) for one request. Treated as
    immutable; not frozen because a decode step builds one per running request and a frozen
    dataclass's __init__ costs ~5x a plain one's (host work per request per step)."""

    rid: str
    token_id: int | None
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: TokenLogprobs | None = None
    error: str | None = None  # the request failed (a 400, e.g. its grammar did not compile)
    # Speculative decoding, over the request so far: draft tokens verified, and accepted.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0

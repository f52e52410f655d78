"""Core request-level types shared by the scheduler, the model runner and the engine.

Owns: SamplingParams (frozen, validated), Req (mutable, written only by the scheduler),
ReqStatus, FinishReason, Phase, Batch, TokenOutput.
Does not know: HTTP, tokenizers, KV tensors.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radixserve.constraints import Constraint

if TYPE_CHECKING:
    from radixserve.cache.radix_cache import TreeNode
    from radixserve.grammar.backend import Matcher


class InvalidRequestError(ValueError):
    """A user error in a request (bad parameter, prompt too long). Servers map it to 4xx."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # client went away or was cancelled


class Phase(enum.Enum):
    EXTEND = "extend"  # prefill of (part of) the uncached suffix of each request
    DECODE = "decode"  # one new token per request


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

    def __post_init__(self) -> None:
        def bad(msg: str, param: str) -> InvalidRequestError:
            return InvalidRequestError(msg, param=param)

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
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1.0
        )


@dataclass
class Req:
    """One request inside the engine. Only the scheduler mutates it.

    Layout of `token_ids`: [prompt ... | output ...]; `cached_len` tokens of it have KV in
    the pool (either matched from the radix tree or computed by this request). The slots of
    those tokens are in `slots[:cached_len]`; `slots[:prefix_len]` belong to the tree (locked
    through `cache_node`), the rest are held by this request.
    """

    rid: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    max_new_tokens: int  # resolved: params.max_tokens capped by the context
    cache_salt: str = ""
    arrival: float = 0.0
    status: ReqStatus = ReqStatus.WAITING
    cached_len: int = 0
    prefix_len: int = 0  # tokens whose slots are owned by the tree (locked)
    num_cached_tokens: int = 0  # prompt tokens served from the cache on first admission
    table_row: int = -1  # NOTE: -1 only while not running; asserted on use
    cache_node: TreeNode | None = None
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    slots: list[int] = field(default_factory=list)
    # The grammar state of a constrained request: set at admission once its grammar compiled,
    # advanced with each output token, dropped at finish. Kept across retraction (the output
    # tokens are kept too, so it stays exact).
    grammar: Matcher | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def extend_len(self) -> int:
        """Tokens still without KV (the next forward must compute them)."""
        return self.num_tokens - self.cached_len

    @property
    def remain_tokens(self) -> int:
        return self.max_new_tokens - self.num_output_tokens


@dataclass
class Batch:
    """What the scheduler hands to the model runner for one forward.

    For EXTEND, request i computes tokens [reqs[i].cached_len, + extend_lens[i]) and samples
    only when `sample[i]` (its last chunk). For DECODE, every request computes one token.
    """

    phase: Phase
    reqs: list[Req]
    extend_lens: list[int]
    sample: list[bool]

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)


@dataclass(frozen=True)
class TokenLogprobs:
    token_logprob: float
    top: tuple[tuple[int, float], ...]  # (token_id, logprob), best first


@dataclass(frozen=True)
class TokenOutput:
    """One new token (or a finish without one, on abort) for one request."""

    rid: str
    token_id: int | None
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    logprobs: TokenLogprobs | None = None
    error: str | None = None  # the request failed (a 400, e.g. its grammar did not compile)

"""LLM: the offline API, `LLM(model=...).generate(prompts, SamplingParams(...))`, as vLLM's.

Owns: turning prompts (text, token ids, chat conversations) into engine requests, running the
engine until they finish, and collecting one RequestOutput per prompt, in input order.
Does not know: HTTP, processes. Runs the engine in the calling thread.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from radixserve.config import EngineConfig
from radixserve.engine.engine import Engine
from radixserve.ipc.messages import GenerateMsg
from radixserve.types import SamplingParams, TokenLogprobs

Prompt = Union[str, Sequence[int]]
Message = dict[str, Any]
FinishReasonName = Literal["stop", "length", "abort"]


@dataclass
class RequestOutput:
    """One prompt's result. Field names follow vLLM (flattened: one sequence per prompt)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReasonName | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    ttft: float = 0.0  # seconds from submission to the first token
    latency: float = 0.0  # seconds from submission to the finish

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def outputs(self) -> list[RequestOutput]:
        """vLLM's `out.outputs[0].text` spelling: the one sequence of this prompt."""
        return [self]


class LLM:
    """Offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`.

    `engine_kwargs` are EngineConfig fields (dtype, kv_cache_tokens, page_size, ...).
    """

    def __init__(self, model: str = "smollm2-135m", show_progress: bool = False,
                 **engine_kwargs: Any) -> None:
        self.engine = Engine(EngineConfig(model=model, **engine_kwargs), show_progress)
        from radixserve.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(self.engine.runner.resolved.hf_dir)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | Sequence[str] = "",
        priority: int | Sequence[int] = 0,
    ) -> list[RequestOutput]:
        """Submit every prompt at once (one continuous batch) and run until all finish.

        `prompts`: one string, a list of strings, or a list of token-id lists. `params`,
        `cache_salt` and `priority` (lower = more important): one for all, or one per prompt
        (a length mismatch raises ValueError).
        """
        from radixserve.tokenizer import encode_prompt

        prompt_list = _as_prompt_list(prompts)
        n = len(prompt_list)
        params_list = _per_prompt(params if params is not None else SamplingParams(), n,
                                  SamplingParams, "params")
        salts = _per_prompt(cache_salt, n, str, "cache_salt")
        priorities = _per_prompt(priority, n, int, "priority")
        results: dict[str, RequestOutput] = {}
        try:
            for prompt, p, salt, prio in zip(prompt_list, params_list, salts, priorities,
                                             strict=True):
                ids = (encode_prompt(self.tokenizer, prompt) if isinstance(prompt, str)
                       else [int(t) for t in prompt])
                rid = f"offline-{next(self._ids)}"
                self.engine.add_request(GenerateMsg(rid, ids, p, salt, prio))
                results[rid] = RequestOutput(rid, ids)
        except Exception:
            for rid in results:  # all or nothing: withdraw the prompts already queued
                self.engine.abort(rid)
            while self.engine.has_work():
                self.engine.step()
            raise
        self._run(results)
        return list(results.values())

    def chat(
        self,
        conversations: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate; one conversation
        (a list of message dicts) is accepted too. Returns one output per conversation."""
        from radixserve.tokenizer import encode_chat

        if not conversations:
            return []
        convs = ([conversations] if isinstance(conversations[0], dict)
                 else list(conversations))
        prompts = [encode_chat(self.tokenizer, list(conv)) for conv in convs]  # type: ignore[arg-type]
        return self.generate(prompts, params)

    def kv_stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def _run(self, results: dict[str, RequestOutput]) -> None:
        start = time.perf_counter()
        while self.engine.has_work():
            for out in self.engine.step():
                res = results.get(out.rid)
                if res is None:
                    continue  # a request of an earlier call that was aborted
                now = time.perf_counter() - start
                if out.token_id is not None:
                    if not res.token_ids:
                        res.ttft = now
                    res.token_ids.append(out.token_id)
                    res.num_cached_tokens = out.num_cached_tokens
                if out.logprobs is not None:
                    res.logprobs.append(out.logprobs)
                if out.finish_reason is not None:
                    res.finish_reason, res.latency = out.finish_reason.value, now
        for res in results.values():
            text = self.tokenizer.decode(res.token_ids, skip_special_tokens=True)
            res.text = text if isinstance(text, str) else "".join(text)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        raise TypeError("pass token ids as a list of lists (one list per prompt), "
                        "e.g. generate([[1, 2, 3]])")
    return items


def _per_prompt(value: Any, n: int, kind: type, name: str) -> list[Any]:
    if isinstance(value, kind):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"got {n} prompts but {len(values)} {name}: pass one {name} for all "
                         f"prompts or exactly one per prompt")
    return values

"""Workloads that outgrow the KV pool (issue 21's bench): agent sessions and a RAG corpus.

Owns: building the traces (exact token counts, seeded) and replaying agent sessions against a
server. Does not know: which server or flags (bench/tiers.py starts them), the metrics
(bench/common/metrics.py summarizes the RequestResults).

Agent sessions: N sessions share one system prompt; each then has a first user message and
T turns. Turn t's prompt = system + user + (tool call + tool result) x t. The tool calls are
scripted text of `tool_call_len` tokens (the server still generates `output_len` tokens, which
are discarded), so every system under test sees exactly the same prompts. After each turn a
session "runs its tool" for `think_time_s`; all sessions run concurrently, so while one thinks
the others grow, and once their contexts exceed the pool, LRU has evicted a session's context
before its next turn comes.

RAG corpus: bench.common.workloads' `rag` with one document per request from a corpus larger than
the pool (zipf popularity), so documents come back after being evicted.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np
from transformers import PreTrainedTokenizerBase

from bench.common.client import ClientConfig, send_request
from bench.common.metrics import RequestResult
from bench.common.workloads import PiecePool, RagSpec, check_spec


@dataclass(frozen=True)
class AgentSpec:
    num_sessions: int = 32
    num_turns: int = 8
    system_prompt_len: int = 512
    user_len: int = 64
    tool_call_len: int = 24
    tool_result_len: int = 256
    output_len: int = 24
    think_time_s: float = 2.0
    stagger_s: float = 0.25  # session i starts at i * stagger_s

    def __post_init__(self) -> None:
        check_spec(self, non_negative=("think_time_s", "stagger_s"))

    @property
    def final_context_len(self) -> int:
        """Tokens of a session's last prompt (without the tokenizer's special tokens)."""
        per_turn = self.tool_call_len + self.tool_result_len
        return self.system_prompt_len + self.user_len + (self.num_turns - 1) * per_turn

    @property
    def live_tokens(self) -> int:
        """Distinct tokens of all sessions' last contexts (the system prompt counted once)."""
        return self.system_prompt_len + self.num_sessions * (
            self.final_context_len - self.system_prompt_len)


@dataclass(frozen=True)
class Session:
    prompts: tuple[str, ...]  # turn t's whole prompt
    prompt_lens: tuple[int, ...]  # as the server counts them


def build_agent_sessions(spec: AgentSpec, tokenizer: PreTrainedTokenizerBase, seed: int = 0
                         ) -> list[Session]:
    pool = PiecePool(tokenizer)
    rng = np.random.default_rng(seed)
    system = pool.text(rng, spec.system_prompt_len)
    users = pool.distinct_texts(rng, spec.num_sessions, spec.user_len)
    sessions = []
    for user in users:
        prompt, body = system + user, spec.system_prompt_len + spec.user_len
        prompts, lens = [prompt], [pool.checked(prompt, body)]
        for _ in range(spec.num_turns - 1):
            prompt += pool.text(rng, spec.tool_call_len) + pool.text(rng, spec.tool_result_len)
            body += spec.tool_call_len + spec.tool_result_len
            prompts.append(prompt)
            lens.append(pool.checked(prompt, body))
        sessions.append(Session(tuple(prompts), tuple(lens)))
    return sessions


async def _run_session(session: aiohttp.ClientSession, cfg: ClientConfig, model: str,
                       s: Session, spec: AgentSpec, delay: float) -> list[RequestResult]:
    await asyncio.sleep(delay)
    results = []
    for t, (prompt, n) in enumerate(zip(s.prompts, s.prompt_lens, strict=True)):
        res = await send_request(session, cfg, model, prompt, n, spec.output_len)
        results.append(res)
        if t + 1 < len(s.prompts):
            await asyncio.sleep(spec.think_time_s)  # the tool runs
    return results


async def run_agent_sessions(http: aiohttp.ClientSession, cfg: ClientConfig, model: str,
                             sessions: list[Session], spec: AgentSpec) -> list[RequestResult]:
    """Every session concurrently, each turn after the previous one's answer + think time."""
    done = await asyncio.gather(*(
        _run_session(http, cfg, model, s, spec, i * spec.stagger_s)
        for i, s in enumerate(sessions)))
    return [r for rs in done for r in rs]


def rag_corpus_spec(num_requests: int, num_docs: int, doc_len: int, system_prompt_len: int,
                    question_len: int, output_len: int, zipf_a: float) -> RagSpec:
    """One document per request out of `num_docs` (the corpus: num_docs * doc_len tokens)."""
    return RagSpec(num_requests, num_docs, doc_len, 1, system_prompt_len, question_len,
                   output_len, zipf_a)


def describe_agent(spec: AgentSpec) -> dict[str, Any]:
    return {"kind": "agent", **spec.__dict__, "final_context_len": spec.final_context_len,
            "live_tokens": spec.live_tokens}

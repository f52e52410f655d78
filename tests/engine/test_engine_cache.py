"""The radix cache and scheduler inside the real engine (tiny model, fp32): outputs identical
with the cache on/off, chunked prefill on/off, under preemption; exact hit rates; no leaks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve import LLM
from radixserve.config import ConfigError
from radixserve.ipc.messages import GenerateMsg
from radixserve.model_source import ModelLoadError
from radixserve.types import FinishReason, InvalidRequestError, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def shared_prefix_prompts(groups: int, per_group: int, system_len: int, question_len: int,
                          seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for gi in range(groups):
        system = [gi] + torch.randint(3, 250, (system_len - 1,), generator=g).tolist()
        for pi in range(per_group):
            # A distinct first question token, so prompts share exactly the system prompt.
            question = [pi + 3] + torch.randint(3, 250, (question_len - 1,), generator=g).tolist()
            prompts.append(system + question)
    return prompts


def run_checked(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY,
                ) -> list[list[int]]:
    """Drive the engine step by step, checking the page invariant after every step."""
    engine = llm.engine
    outs: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(GenerateMsg(f"r{i}", p, params))
        outs[f"r{i}"] = []
    while engine.has_work():
        for o in engine.step():
            if o.token_id is not None:
                outs[o.rid].append(o.token_id)
        engine.check_integrity()
    stats = llm.kv_stats()
    assert stats["kv_held_tokens"] == 0 and stats["num_running"] == 0
    assert stats["kv_free_tokens"] + stats["kv_cached_tokens"] == stats["kv_total_tokens"]
    return [outs[f"r{i}"] for i in range(len(prompts))]


def make_llm(model: Path, **kw: object) -> LLM:
    kw.setdefault("kv_cache_tokens", 8192)
    return LLM(model=str(model), dtype="float32", **kw)


def test_cache_on_off_and_chunking_give_identical_tokens(tiny_llama: Path) -> None:
    prompts = shared_prefix_prompts(2, 4, 60, 7)
    base = run_checked(make_llm(tiny_llama, disable_radix_cache=True), prompts)
    cached = make_llm(tiny_llama)
    assert run_checked(cached, prompts) == base
    assert run_checked(cached, prompts) == base  # second wave: fully warm
    chunked = make_llm(tiny_llama, chunked_prefill_size=16, max_prefill_tokens=24)
    assert run_checked(chunked, prompts) == base
    alternating = make_llm(tiny_llama, chunked_prefill_size=16, max_prefill_tokens=24,
                           mixed_chunk=False)
    assert run_checked(alternating, prompts) == base
    # decode tokens next to 64-token chunks: the cascade and the varlen path in one forward
    long_chunks = make_llm(tiny_llama, chunked_prefill_size=64, max_prefill_tokens=80,
                           disable_radix_cache=True)
    assert run_checked(long_chunks, prompts) == base
    paged = make_llm(tiny_llama, page_size=4)
    assert run_checked(paged, prompts) == base


def test_preemption_under_a_tiny_pool_loses_nothing(tiny_llama: Path) -> None:
    prompts = shared_prefix_prompts(3, 4, 40, 9, seed=1)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    big = run_checked(make_llm(tiny_llama), prompts, params)
    small_llm = make_llm(tiny_llama, kv_cache_tokens=260, max_model_len=256)
    small = run_checked(small_llm, prompts, params)
    assert small == big
    assert small_llm.kv_stats()["num_preemptions"] > 0


def test_hit_rate_equals_oracle_and_prefix_computed_once(tiny_llama: Path) -> None:
    G, P, S, Q = 3, 5, 80, 6
    llm = make_llm(tiny_llama)
    res = llm.generate(shared_prefix_prompts(G, P, S, Q), GREEDY)
    stats = llm.kv_stats()
    # All submitted at once: in-batch sharing lets one request per group compute the system
    # prompt; the other P - 1 wait a step and hit it.
    assert stats["prefix_cache_queries"] == G * P * (S + Q)
    assert stats["prefix_cache_hits"] == G * (P - 1) * S
    assert sorted(r.num_cached_tokens for r in res) == [0] * G + [S] * (G * (P - 1))
    prompt_compute = stats["computed_tokens"] - stats["generation_tokens"] + len(res)
    assert prompt_compute == G * (S + Q) + G * (P - 1) * Q


def test_64_requests_share_one_system_prompt_computed_once(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama, kv_cache_tokens=16384)
    prompts = shared_prefix_prompts(1, 64, 200, 4)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    stats = llm.kv_stats()
    assert stats["prefix_cache_hits"] == 63 * 200


def test_salts_isolate_tenants(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama)
    prompt = shared_prefix_prompts(1, 1, 50, 2)
    llm.generate(prompt, GREEDY, cache_salt="tenant-a")
    other = llm.generate(prompt, GREEDY, cache_salt="tenant-b")[0]
    same = llm.generate(prompt, GREEDY, cache_salt="tenant-a")[0]
    assert other.num_cached_tokens == 0
    assert same.num_cached_tokens == 51  # all but the last prompt token


def test_abort_frees_everything(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama)
    engine = llm.engine
    engine.add_request(GenerateMsg("a", list(range(3, 60)), SamplingParams(max_tokens=100)))
    engine.add_request(GenerateMsg("b", list(range(3, 40)), SamplingParams(max_tokens=100)))
    for _ in range(4):
        engine.step()
    engine.abort("a")
    outs = engine.step()
    assert any(o.rid == "a" and o.finish_reason is FinishReason.ABORT for o in outs)
    engine.abort("b")
    engine.abort("unknown")  # no-op
    while engine.has_work():
        engine.step()
    engine.check_integrity()
    assert llm.kv_stats()["kv_held_tokens"] == 0


def test_bad_input_gets_clear_errors(tiny_llama: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        LLM(model="/nonexistent/model")
    with pytest.raises(ConfigError, match="dtype"):
        LLM(model=str(tiny_llama), dtype="int3")
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    llm = make_llm(tiny_llama, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="maximum context length is 64"):
        llm.generate([list(range(3, 100))], GREEDY)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.generate([[10**6]], GREEDY)


def test_sampling_seed_reproducible_and_stop_tokens(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama)
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=7, max_tokens=12,
                       ignore_eos=True)
    a = llm.generate([[5, 6, 7]], p)[0].token_ids
    b = llm.generate([[5, 6, 7]], p)[0].token_ids
    assert a == b and len(a) == 12
    greedy = llm.generate([[5, 6, 7]], GREEDY)[0].token_ids
    stop_at = greedy[3]
    stopped = llm.generate([[5, 6, 7]], SamplingParams(
        temperature=0, max_tokens=10, stop_token_ids=(stop_at,), ignore_eos=True))[0]
    assert stopped.token_ids == greedy[: greedy.index(stop_at) + 1]
    assert stopped.finish_reason == "stop"
    lp = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, logprobs=2))[0]
    assert len(lp.logprobs) == len(lp.token_ids)
    assert all(x.top[0][1] >= x.token_logprob - 1e-6 and len(x.top) == 2 for x in lp.logprobs)

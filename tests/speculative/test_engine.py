"""Speculative decoding through the engine (tiny models, fp32): greedy outputs are token-for-
token those without speculation (and HF's) for every method; seeded sampling gives the same
tokens, and its next-token distribution passes a chi-square test; composition with grammars
(jump-forward), stop tokens, max_tokens, logprobs, n > 1, preemption, priorities and pins; the
slot accounting holds after every step with rejected drafts."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from radixserve import LLM
from radixserve.constraints import Constraint, ConstraintKind
from radixserve.ipc.messages import GenerateMsg, PinMsg
from radixserve.types import FinishReason, SamplingParams, TokenOutput
from tests.engine.test_engine_cache import shared_prefix_prompts
from tests.model.test_parity import hf_greedy, random_prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
LENGTHS = [1, 7, 33, 64, 130, 5, 600]  # test_model_parity's prompts


def make(model: Path, spec: dict[str, Any] | None, **kw: Any) -> LLM:
    kw.setdefault("kv_cache_tokens", 8192)
    return LLM(str(model), dtype="float32", speculative_config=spec, **kw)


def run(llm: LLM, msgs: list[GenerateMsg], check_every_step: bool = False,
        finished: list[str] | None = None) -> dict[str, list[TokenOutput]]:
    """Step the engine until every message finished; the slot accounting after each step.
    `finished`: filled with the request ids in the order they finished."""
    engine = llm.engine
    outs: dict[str, list[TokenOutput]] = {m.rid: [] for m in msgs}
    for m in msgs:
        engine.add_request(m)
    while engine.has_work():
        for o in engine.step():
            if o.rid in outs:
                outs[o.rid].append(o)
                if o.finish_reason is not None and finished is not None:
                    finished.append(o.rid)
        if check_every_step:
            engine.check_integrity()
    engine.check_integrity()
    assert llm.kv_stats()["kv_held_tokens"] == 0
    return outs


def tokens(outs: dict[str, list[TokenOutput]]) -> dict[str, list[int]]:
    return {rid: [o.token_id for o in seq if o.token_id is not None] for rid, seq in outs.items()}


def spec_stats(llm: LLM) -> dict[str, float]:
    return {k: v for k, v in llm.engine.stats().items() if k.startswith("spec_")}


def assert_drafted_with_rejections(llm: LLM) -> None:
    s = spec_stats(llm)
    assert s["spec_num_drafts"] > 0 and s["spec_num_accepted_tokens"] > 0
    assert s["spec_num_accepted_tokens"] < s["spec_num_draft_tokens"], s  # some rejected


def greedy_msgs(prompts: list[list[int]], n: int, **kw: Any) -> list[GenerateMsg]:
    return [GenerateMsg(f"r{i}", p, SamplingParams(temperature=0, max_tokens=n - i % 3,
                                                   ignore_eos=True, **kw))
            for i, p in enumerate(prompts)]


@pytest.mark.parametrize("method", ["ngram", "radix", "auto"])
def test_greedy_is_token_identical_on_and_off(tiny_llama: Path, method: str) -> None:
    prompts = random_prompts(LENGTHS, 250)
    base = tokens(run(make(tiny_llama, None), greedy_msgs(prompts, 40), False))
    llm = make(tiny_llama, {**NGRAM, "method": method})
    for _ in range(2):  # the second round drafts from the first round's outputs too
        assert tokens(run(llm, greedy_msgs(prompts, 40), check_every_step=True)) == base
    if method == "radix":  # replaying the same greedy outputs: every draft is right
        s = spec_stats(llm)
        assert s["spec_num_accepted_tokens"] == s["spec_num_draft_tokens"] > 0
    else:
        assert_drafted_with_rejections(llm)


def test_greedy_matches_hf_with_speculation(tiny_qwen2: Path) -> None:
    prompts = random_prompts([3, 9, 40, 66], 250, seed=3)
    ref = hf_greedy(tiny_qwen2, prompts, 24)
    llm = make(tiny_qwen2, {**NGRAM, "method": "auto"}, page_size=4)
    outs = tokens(run(llm, greedy_msgs(prompts, 24)))
    for i, r in enumerate(ref):
        assert outs[f"r{i}"] == r[: 24 - i % 3]
    assert spec_stats(llm)["spec_num_drafts"] > 0


def test_seeded_sampling_is_identical_on_and_off(tiny_llama: Path) -> None:
    prompts = random_prompts([20, 50, 9, 120], 250, seed=5)

    def msgs() -> list[GenerateMsg]:
        return [GenerateMsg(f"s{i}-{seed}", p, SamplingParams(
            temperature=0.8, top_k=6, max_tokens=30, seed=seed, ignore_eos=True))
            for i, p in enumerate(prompts) for seed in (1, 2)]

    base = tokens(run(make(tiny_llama, None), msgs(), False))
    llm = make(tiny_llama, {**NGRAM, "method": "auto"})
    for _ in range(2):
        assert tokens(run(llm, msgs())) == base
    assert_drafted_with_rejections(llm)


def test_chi_square_next_token_distribution(tiny_llama: Path) -> None:
    """2000 seeded samples whose second token sits at a drafted position (a prediction that
    proposes the likeliest token there): its frequencies, given the first token, agree with
    the model's top-k distribution within the chi-square bound (df = 4, p = 0.001)."""
    prompt = random_prompts([12], 250, seed=11)[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)

    def probs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        top = logits.topk(5)
        return torch.zeros_like(logits).scatter(0, top.indices, top.values.softmax(-1))

    first = int(probs(prompt).argmax())
    p1 = probs(prompt + [first])
    likely = int(p1.argmax())
    llm = make(tiny_llama, None)  # no flag: the prediction alone drafts
    msgs = [GenerateMsg(f"c{seed}", prompt, SamplingParams(temperature=1.0, top_k=5,
                                                           max_tokens=3, seed=seed,
                                                           ignore_eos=True),
                        prediction_ids=[first, likely, likely])
            for seed in range(2000)]
    outs = tokens(run(llm, msgs, check_every_step=False))
    seconds = [seq[1] for seq in outs.values() if seq[0] == first]
    assert len(seconds) > 300
    counts = Counter(seconds)
    support = p1.nonzero().flatten().tolist()
    assert set(counts) <= set(support)
    expected = {t: float(p1[t]) * len(seconds) for t in support}
    chi2 = sum((counts.get(t, 0) - e) ** 2 / e for t, e in expected.items())
    assert chi2 < 18.47, (chi2, counts, expected)
    s = spec_stats(llm)
    assert 0 < s["spec_num_accepted_tokens"] < s["spec_num_draft_tokens"]


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["alpha", "beta"]}, "maxItems": 2}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


def test_constrained_json_is_identical_and_jumps_forward(tiny_llama: Path) -> None:
    prompts = random_prompts([10, 30, 70, 15], 250, seed=7)
    schema = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))
    regex = Constraint(ConstraintKind.REGEX, r"answer: (yes|no), because [a-z]{5,20}\.")

    def msgs() -> list[GenerateMsg]:
        return [GenerateMsg(f"g{i}", p, SamplingParams(
            temperature=0, max_tokens=120, constraint=schema if i % 2 == 0 else regex))
            for i, p in enumerate(prompts)]

    base = make(tiny_llama, None)
    expected = tokens(run(base, msgs(), False))
    llm = make(tiny_llama, NGRAM)
    got = tokens(run(llm, msgs()))
    assert got == expected
    for i in (0, 2):
        text = llm.tokenizer.decode(got[f"g{i}"], skip_special_tokens=True)
        assert set(json.loads(text)) == {"name", "age", "tags"}
    s = spec_stats(llm)
    # The forced keys and punctuation are drafted and accepted (jump-forward).
    assert s["spec_num_accepted_tokens"] >= 20, s


def test_stop_tokens_max_tokens_and_logprobs(tiny_llama: Path) -> None:
    prompts = random_prompts([30, 64, 8], 250, seed=9)
    probe = tokens(run(make(tiny_llama, None), greedy_msgs(prompts, 30), False))
    stop = probe["r1"][12]  # a token that appears mid-output

    def msgs(predict: bool) -> list[GenerateMsg]:
        # The prediction is the unstopped output: its drafts run past the stop token and
        # past max_tokens, and must be cut there.
        return [GenerateMsg(f"r{i}", p, SamplingParams(
            temperature=0, max_tokens=25 - i, logprobs=2, stop_token_ids=(stop,)),
            prediction_ids=probe[f"r{i}"] if predict else None)
            for i, p in enumerate(prompts)]

    base = run(make(tiny_llama, None), msgs(False), False)
    llm = make(tiny_llama, NGRAM)
    got = run(llm, msgs(True), check_every_step=True)
    assert tokens(got) == tokens(base)
    for rid, seq in got.items():
        assert len(seq) <= 25 and seq[-1].finish_reason is not None
        assert seq[-1].finish_reason == base[rid][-1].finish_reason
        if seq[-1].finish_reason is FinishReason.STOP:
            assert seq[-1].token_id == stop
        for a, b in zip(seq, base[rid], strict=True):
            assert a.logprobs is not None and b.logprobs is not None
            assert a.logprobs.token_logprob == pytest.approx(b.logprobs.token_logprob, abs=1e-4)
            assert [t for t, _ in a.logprobs.top] == [t for t, _ in b.logprobs.top]
    assert spec_stats(llm)["spec_num_accepted_tokens"] > 20


def test_n_sequences_and_retries_draft_from_earlier_outputs(tiny_llama: Path) -> None:
    """n = 4 seeded samples of two prompts, asked twice (a retry): the second time the tree
    holds the first time's outputs; every sequence is still the one without speculation."""
    prompts = random_prompts([40, 90], 250, seed=4)
    params = SamplingParams(temperature=0.7, top_k=4, max_tokens=30, ignore_eos=True, n=4,
                            seed=3)

    def seqs(llm: LLM) -> list[list[list[int]]]:
        return [[s.token_ids for s in o.outputs] for o in llm.generate(prompts, params)]

    base = seqs(make(tiny_llama, None))
    llm = make(tiny_llama, {**NGRAM, "method": "radix"})
    assert seqs(llm) == base
    assert seqs(llm) == base
    assert spec_stats(llm)["spec_num_accepted_tokens"] > 0
    llm.engine.check_integrity()


def test_preemption_priorities_and_pins(tiny_llama: Path) -> None:
    """A KV pool too small for the batch: requests are retracted and resumed (with their
    drafts' slots given back), priorities order it, a pinned prefix survives; the outputs
    are those of a large pool without speculation."""
    prompts = shared_prefix_prompts(3, 4, 40, 9, seed=2)  # test_grammar_scheduling's
    pin_prefix = prompts[0][:32]

    def msgs() -> list[GenerateMsg]:
        return [GenerateMsg(f"p{i}", p, SamplingParams(temperature=0, max_tokens=120,
                                                       ignore_eos=True), priority=i % 3)
                for i, p in enumerate(prompts)]

    base = tokens(run(make(tiny_llama, None), msgs(), False))
    llm = make(tiny_llama, {**NGRAM, "method": "auto"}, kv_cache_tokens=260,
               max_model_len=256)
    engine = llm.engine
    engine.call(PinMsg("pin", pin_prefix))
    while engine.has_work():
        engine.step()
    assert engine.drain_replies()[0].result is not None
    finished: list[str] = []
    outs = run(llm, msgs(), check_every_step=True, finished=finished)
    assert tokens(outs) == base
    # Priorities order it: with room for about one request at a time, every important one
    # (priority 0) finishes before any of the least important (2).
    rank = {rid: i for i, rid in enumerate(finished)}
    by_prio = {p: [rank[m.rid] for m in msgs() if m.priority == p] for p in (0, 2)}
    assert max(by_prio[0]) < min(by_prio[2]), by_prio
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_num_drafts"] > 0
    assert stats["num_pins"] == 1
    assert llm.engine.cache.peek_prefix_len(pin_prefix) == 32

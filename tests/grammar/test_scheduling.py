"""Scheduling constrained requests (tiny model): a request whose grammar is compiling waits,
the batch does not; grammar state stays exact under preemption (identical constrained greedy
outputs with and without retraction, and valid); n sequences of one prompt each keep their own
matcher."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import jsonschema

from radixserve import LLM
from radixserve.constraints import Constraint, ConstraintKind
from radixserve.engine.engine import _grammar_backend
from radixserve.grammar.backend import GrammarBackend
from radixserve.grammar.compiler import GrammarCompiler
from radixserve.ipc.messages import GenerateMsg
from radixserve.types import SamplingParams
from tests.engine.test_engine_cache import shared_prefix_prompts

PATTERN = r"[a-z]{30}-[0-9]{40}"
SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "code": {"type": "string", "pattern": "^[a-z]{50}$"},
    "tags": {"type": "array", "items": {"enum": ["x", "yy"]}, "minItems": 1, "maxItems": 2}},
    "required": ["id", "code", "tags"], "additionalProperties": False}


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[str]:
    engine = llm.engine
    outs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(GenerateMsg(f"r{i}", p, sp))
    while engine.has_work():
        for o in engine.step():
            if o.token_id is not None:
                outs[o.rid].append(o.token_id)
        engine.check_integrity()
    assert llm.kv_stats()["kv_held_tokens"] == 0
    return [llm.tokenizer.decode(outs[f"r{i}"], skip_special_tokens=True)
            for i in range(len(prompts))]


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = shared_prefix_prompts(3, 4, 40, 9, seed=2)
    regex = Constraint(ConstraintKind.REGEX, PATTERN)
    schema = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))
    params = [SamplingParams(temperature=0, max_tokens=120, constraint=regex if i % 2 else schema)
              for i in range(len(prompts))]
    return prompts, params


def test_constrained_outputs_are_exact_under_preemption(tiny_llama: Path) -> None:
    prompts, params = workload()
    big = run(LLM(str(tiny_llama), dtype="float32", kv_cache_tokens=8192), prompts, params)
    small_llm = LLM(str(tiny_llama), dtype="float32", kv_cache_tokens=260, max_model_len=256)
    small = run(small_llm, prompts, params)
    assert small_llm.kv_stats()["num_preemptions"] > 0
    assert small == big
    for i, text in enumerate(small):
        if i % 2:
            assert re.fullmatch(PATTERN, text), text
        else:
            jsonschema.validate(json.loads(text), SCHEMA)


def test_n_sequences_of_one_prompt_each_have_their_own_matcher(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_tokens=8192)
    prompt = shared_prefix_prompts(1, 1, 30, 5)[0]
    constraint = Constraint(ConstraintKind.REGEX, PATTERN)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=90, constraint=constraint)
              for s in range(6)]
    texts = run(llm, [prompt] * 6, params)
    assert all(re.fullmatch(PATTERN, t) for t in texts), texts
    assert len(set(texts)) > 1  # sampled independently, each along its own grammar state


def test_a_compiling_grammar_holds_back_only_its_request(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_tokens=8192)
    engine, r = llm.engine, llm.engine.runner
    release = threading.Event()

    def slow_backend() -> GrammarBackend:  # the first compile blocks until released
        assert release.wait(60)
        return _grammar_backend(r.resolved.hf_dir, r.spec.vocab_size, r.eos_token_ids)

    compiler = GrammarCompiler(slow_backend)
    engine.grammars = engine.scheduler.grammars = compiler
    prompt = shared_prefix_prompts(1, 1, 20, 5)[0]
    engine.add_request(GenerateMsg("constrained", prompt, SamplingParams(
        temperature=0, max_tokens=20, constraint=Constraint(ConstraintKind.REGEX, "[ab]{5}"))))
    engine.add_request(GenerateMsg("free", prompt, SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True)))
    finished: list[str] = []
    tokens: dict[str, list[int]] = {"constrained": [], "free": []}
    while "free" not in finished:  # the free request runs to its end meanwhile
        for o in engine.step():
            if o.token_id is not None:
                tokens[o.rid].append(o.token_id)
            if o.finish_reason is not None:
                finished.append(o.rid)
    assert tokens == {"constrained": [], "free": tokens["free"]} and len(tokens["free"]) == 6
    assert engine.stats()["num_waiting"] == 1
    release.set()
    while engine.has_work():
        for o in engine.step():
            if o.token_id is not None:
                tokens[o.rid].append(o.token_id)
    engine.check_integrity()
    assert re.fullmatch("[ab]{5}", llm.tokenizer.decode(tokens["constrained"],
                                                        skip_special_tokens=True))
    compiler.close()

"""Grammar state stays exact under preemption (tiny model, tiny KV pool): constrained greedy
outputs are identical with and without retraction, and valid; n sequences of one prompt each
keep their own matcher."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema

from radixserve import LLM
from radixserve.constraints import Constraint, ConstraintKind
from radixserve.ipc.messages import GenerateMsg
from radixserve.types import SamplingParams
from tests.test_engine_cache import shared_prefix_prompts

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

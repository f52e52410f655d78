"""Grammar-constrained decoding through the engine with SmolLM2 (fp32): every output is valid
for its schema / regex / choice, constrained and unconstrained requests share batches, pages
are all returned, a grammar that fails in the engine fails only its request."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from bench.common.grammar_schemas import SCHEMAS
from radixserve.constraints import (
    Constraint,
    ConstraintKind,
    ToolCallConstraint,
    ToolDef,
    ToolMode,
)
from radixserve.engine.loop import EngineLoop
from radixserve.ipc.messages import EngineErrorMsg, GenerateMsg, TokenBatchMsg
from radixserve.llm import LLM, RequestOutput
from radixserve.tokenizer import encode_chat
from radixserve.types import FinishReason, InvalidRequestError, SamplingParams, TokenOutput

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    engine = LLM("smollm2-135m", dtype="float32", kv_cache_tokens=32768, num_threads=1)
    yield engine
    engine.engine.grammars.close()


def chat(llm: LLM, text: str) -> list[int]:
    return encode_chat(llm.tokenizer, [{"role": "user", "content": text}])


def run_checked(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]
                ) -> list[RequestOutput]:
    results = llm.generate(prompts, params)
    llm.engine.check_integrity()
    assert llm.kv_stats()["kv_held_tokens"] == 0
    return results


def schema_constraint(schema: dict[str, Any]) -> Constraint:
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))


def test_50_requests_over_10_schemas_all_validate(llm: LLM) -> None:
    prompts, params, schemas = [], [], []
    for schema, _ in SCHEMAS:
        prompt = chat(llm, f"Reply with JSON for this schema: {json.dumps(schema)}")
        for i in range(5):  # greedy once, then 4 sampled sequences (as n = 5 would send)
            prompts.append(prompt)
            params.append(SamplingParams(temperature=0 if i == 0 else 0.9, seed=i,
                                         max_tokens=120, constraint=schema_constraint(schema)))
            schemas.append(schema)
    results = run_checked(llm, prompts, params)
    assert len(results) == 50
    for res, schema in zip(results, schemas, strict=True):
        assert res.finish_reason == "stop", res.text
        jsonschema.validate(json.loads(res.text), schema)


def test_regex_choice_and_ebnf_outputs_match(llm: LLM) -> None:
    cases = [
        (Constraint(ConstraintKind.REGEX, r"[0-9]{3}-[0-9]{4}"), "A phone number:",
         lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
        (Constraint(ConstraintKind.REGEX, r"(Paris|Rome|Oslo), [A-Z][a-z]{2,9}"),
         "A city and its country:", lambda t: re.fullmatch(r"(Paris|Rome|Oslo), [A-Z][a-z]{2,9}", t)),
        (Constraint(ConstraintKind.CHOICE, choices=("positive", "negative", "neutral")),
         "Sentiment of 'I love it':", lambda t: t in ("positive", "negative", "neutral")),
        (Constraint(ConstraintKind.EBNF, 'root ::= "yes" | "no" | "maybe"'), "Is the sky blue?",
         lambda t: t in ("yes", "no", "maybe")),
    ]
    prompts, params, checks = [], [], []
    for constraint, question, check in cases:
        for i in range(3):
            prompts.append(chat(llm, question))
            params.append(SamplingParams(temperature=0.0 if i == 0 else 1.0, seed=i,
                                         max_tokens=30, constraint=constraint))
            checks.append(check)
    for res, check in zip(run_checked(llm, prompts, params), checks, strict=True):
        assert check(res.text), res.text
        assert res.finish_reason == "stop"


def test_32_constrained_and_32_unconstrained_in_one_run(llm: LLM) -> None:
    schema = SCHEMAS[0][0]
    prompts, params = [], []
    for i in range(64):
        prompts.append(chat(llm, f"Person number {i} as JSON with a name and an age."))
        constrained = i % 2 == 0
        params.append(SamplingParams(
            temperature=0.8, seed=i, max_tokens=48 if constrained else 12,
            constraint=schema_constraint(schema) if constrained else None))
    results = run_checked(llm, prompts, params)
    assert llm.engine.stats()["num_running"] == 0
    for i, res in enumerate(results):
        if i % 2 == 0:
            jsonschema.validate(json.loads(res.text), schema)
        else:
            assert res.finish_reason in ("stop", "length")
            assert len(res.token_ids) >= 1


def test_bad_constraint_raises_before_anything_is_queued(llm: LLM) -> None:
    bad = SamplingParams(max_tokens=8, constraint=Constraint(ConstraintKind.LARK, "start: nope"))
    with pytest.raises(InvalidRequestError) as info:
        llm.generate([chat(llm, "Hi")], bad)
    assert info.value.param == "constraint" and "nope" in str(info.value)
    assert not llm.engine.has_work()


def test_grammar_failing_in_the_engine_fails_only_its_request(llm: LLM) -> None:
    """The API process validates first; should the engine still fail to compile a grammar,
    only that request ends (with an error), and the batch runs on."""
    engine = llm.engine
    prompt = chat(llm, "Yes or no?")
    good = SamplingParams(temperature=0, max_tokens=8, constraint=Constraint(
        ConstraintKind.CHOICE, choices=("yes", "no")))
    bad = SamplingParams(max_tokens=8, constraint=Constraint(ConstraintKind.LARK, "start: nope"))
    plain = SamplingParams(temperature=0, max_tokens=4)
    for rid, params in (("good", good), ("bad", bad), ("plain", plain)):
        engine.add_request(GenerateMsg(rid, prompt, params))
    tokens: dict[str, list[int]] = {"good": [], "bad": [], "plain": []}
    errors: dict[str, str | None] = {}
    while engine.has_work():
        for out in engine.step():
            if out.token_id is not None:
                tokens[out.rid].append(out.token_id)
            if out.finish_reason is not None:
                errors[out.rid] = out.error
    engine.check_integrity()
    assert tokens["bad"] == [] and errors["bad"] is not None and "nope" in errors["bad"]
    assert errors["good"] is None and llm.tokenizer.decode(
        tokens["good"], skip_special_tokens=True) in ("yes", "no")
    assert errors["plain"] is None and 1 <= len(tokens["plain"]) <= 4


class _OneStepEngine:
    """Just enough of the engine contract for EngineLoop.step."""

    def __init__(self, outputs: list[TokenOutput]) -> None:
        self.outputs = outputs

    def step(self) -> list[TokenOutput]:
        return self.outputs

    def drain_cache_events(self) -> list[object]:
        return []

    def drain_replies(self) -> list[object]:
        return []


def test_engine_loop_turns_an_error_output_into_a_400_for_that_request() -> None:
    sent: list[object] = []
    ok = TokenOutput("a", 7, None, 3, 0)
    failed = TokenOutput("b", None, FinishReason.ABORT, 3, 0, error="invalid constraint: x")
    EngineLoop(_OneStepEngine([ok, failed]), sent.append).step()  # type: ignore[arg-type]
    assert sent == [EngineErrorMsg("invalid constraint: x", rid="b", status=400),
                    TokenBatchMsg([ok])]


WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city"]}
CLOCK = {"type": "object", "properties": {"timezone": {"type": "string"}},
         "required": ["timezone"]}
HERMES_CALL = re.compile(r"<tool_call>\n(.*)\n</tool_call>")


def test_required_and_named_tool_calls_always_validate(llm: LLM) -> None:
    tools = (ToolDef("get_weather", json.dumps(WEATHER)), ToolDef("get_time", json.dumps(CLOCK)))
    schemas = {"get_weather": WEATHER, "get_time": CLOCK}
    system = ('Tools: get_weather(city, unit), get_time(timezone). Call one as <tool_call>\n'
              '{"name": ..., "arguments": {...}}\n</tool_call>')
    prompts, params = [], []
    for question in ("Weather in Paris?", "What time is it in Tokyo?", "Tell me a joke."):
        for mode, allowed in ((ToolMode.REQUIRED, tools), (ToolMode.NAMED, tools[:1])):
            prompts.append(encode_chat(llm.tokenizer, [{"role": "system", "content": system},
                                                       {"role": "user", "content": question}]))
            params.append(SamplingParams(temperature=0, max_tokens=100, constraint=Constraint(
                ConstraintKind.TOOL_CALLS, tool_calls=ToolCallConstraint(allowed, mode))))
    for res, p in zip(run_checked(llm, prompts, params), params, strict=True):
        assert res.finish_reason == "stop", res.text
        bodies = HERMES_CALL.findall(res.text)
        # nothing but calls, "\n" between parallel ones
        assert bodies and res.text == "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in bodies)
        assert p.constraint is not None and p.constraint.tool_calls is not None
        if p.constraint.tool_calls.mode is ToolMode.NAMED:
            assert len(bodies) == 1, res.text  # exactly one call, though parallel is allowed
        for body in bodies:
            call = json.loads(body)
            if p.constraint.tool_calls.mode is ToolMode.NAMED:
                assert call["name"] == "get_weather"
            jsonschema.validate(call["arguments"], schemas[call["name"]])

"""Closed objects (xgrammar's default): a schema's objects generate only the properties they
name, on every constrained path (response formats, tool arguments in every mode, the offline
checker), unless additionalProperties says otherwise or the flag restores JSON Schema's default."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from radixserve.api.constraints.check import ConstraintChecker
from radixserve.cli import build_config, build_parser
from radixserve.constraints import (
    Constraint,
    ConstraintKind,
    ToolCallConstraint,
    ToolDef,
    ToolMode,
)
from radixserve.grammar.backend import GrammarBackend
from radixserve.grammar.closed_objects import close_objects
from radixserve.model_source import resolve_model
from radixserve.tokenizer import load_tokenizer
from radixserve.types import InvalidRequestError
from tests.grammar.test_backend import EOS, VOCAB, feed

PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}  # what pydantic writes for a plain model: no
# additionalProperties at all


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerBase:
    return load_tokenizer(resolve_model("smollm2-135m").hf_dir)


def backend(tok: PreTrainedTokenizerBase, allow: bool) -> GrammarBackend:
    return GrammarBackend(tok, VOCAB, (EOS,), allow_additional_properties=allow)


def test_named_properties_close_and_everything_else_stays() -> None:
    nested = {"$defs": {"Pet": {"type": "object", "properties": {"kind": {"type": "string"}}}},
              "type": "object", "properties": {
                  "pets": {"type": "array", "items": {"$ref": "#/$defs/Pet"}},
                  "best": {"anyOf": [{"$ref": "#/$defs/Pet"}, {"type": "null"}]},
                  "tags": {"type": "object", "additionalProperties": {"type": "string"}},
                  "loose": {"type": "object", "properties": {}, "additionalProperties": True},
                  "any": {"type": "object"}}}
    out = close_objects(nested)
    assert isinstance(out, dict)
    assert out["additionalProperties"] is False
    assert out["$defs"]["Pet"]["additionalProperties"] is False
    props = out["properties"]
    assert props["tags"] == nested["properties"]["tags"]  # a schema for the others: kept
    assert props["loose"]["additionalProperties"] is True
    assert props["any"] == {"type": "object"}  # names nothing: any object, as xgrammar
    assert "additionalProperties" not in nested  # the input is not modified


def test_intersections_are_not_closed() -> None:
    a = {"type": "object", "properties": {"a": {"type": "string"}}}
    b = {"type": "object", "properties": {"b": {"type": "string"},
                                          "inner": {"type": "object", "properties": {}}}}
    out = close_objects({"allOf": [a, b]})
    assert isinstance(out, dict)
    assert [m.get("additionalProperties") for m in out["allOf"]] == [None, None]
    assert out["allOf"][1]["properties"]["inner"]["additionalProperties"] is False
    assert close_objects({"$ref": "#/$defs/X", "properties": {"a": {}}, "$defs": {"X": {}}}) \
        == {"$ref": "#/$defs/X", "properties": {"a": {}}, "$defs": {"X": {}}}
    assert close_objects(True) is True


@pytest.mark.parametrize("allow", [False, True])
def test_response_format_schema(tok: PreTrainedTokenizerBase, allow: bool) -> None:
    grammar = backend(tok, allow).compile(Constraint.json_schema(PERSON))
    m = grammar.matcher()
    assert feed(m, tok, '{"name": "John", "age": 25')
    assert feed(m.copy(), tok, "}")
    assert feed(m, tok, ', "gender": "Male"}') is allow
    explicit = {**PERSON, "additionalProperties": True}  # asked for: open either way
    assert feed(backend(tok, allow).compile(Constraint.json_schema(explicit)).matcher(), tok,
                '{"name": "J", "age": 2, "x": 1}')


@pytest.mark.parametrize("mode", list(ToolMode))
@pytest.mark.parametrize("allow", [False, True])
def test_tool_arguments_in_every_mode(tok: PreTrainedTokenizerBase, mode: ToolMode,
                                      allow: bool) -> None:
    tool = ToolDef("person", json.dumps(PERSON))
    c = Constraint(ConstraintKind.TOOL_CALLS, tool_calls=ToolCallConstraint((tool,), mode))
    m = backend(tok, allow).compile(c).matcher()
    head = '<tool_call>\n{"name": "person", "arguments": {"name": "J", "age": 2'
    assert feed(m, tok, head)
    assert feed(m.copy(), tok, '}}\n</tool_call>')
    assert feed(m, tok, ', "extra": 1}}\n</tool_call>') is allow


def test_the_checker_validates_as_the_engine_compiles() -> None:
    # A required property the schema does not name: satisfiable only when objects are open.
    odd: dict[str, Any] = {"type": "object", "properties": {"a": {"type": "string"}},
                           "required": ["b"]}
    with pytest.raises(InvalidRequestError):
        ConstraintChecker()(Constraint.json_schema(odd), "response_format")
    ConstraintChecker(allow_additional_properties=True)(Constraint.json_schema(odd), "x")


def test_the_flag_reaches_the_engine_config() -> None:
    parser = build_parser()
    on = build_config(parser.parse_args(
        ["serve", "--structured-outputs-allow-additional-properties"]), {})
    off = build_config(parser.parse_args(["serve"]), {})
    assert on.engine.structured_outputs_allow_additional_properties is True
    assert off.engine.structured_outputs_allow_additional_properties is False


@pytest.mark.parametrize("allow", [False, True])
def test_the_offline_llm_closes_objects_unless_told(tiny_llama: Path, allow: bool) -> None:
    from radixserve import LLM, SamplingParams
    from radixserve.grammar.backend import CompiledGrammar

    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_tokens=1024,
              structured_outputs_allow_additional_properties=allow)
    compiled = llm.engine.grammars.wait(Constraint.json_schema(PERSON))
    assert isinstance(compiled, CompiledGrammar)
    m = compiled.matcher()

    def accepts(text: str) -> bool:  # token by token, as sampled (the tiny model's vocab)
        return all(m.accept(t) for t in llm.tokenizer.encode(text, add_special_tokens=False))

    assert accepts('{"name": "J", "age": 2')
    assert accepts(', "x": 1}') is allow
    odd = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}
    params = SamplingParams(max_tokens=4, constraint=Constraint.json_schema(odd))
    if allow:
        llm.engine.grammars.wait(params.constraint)  # type: ignore[arg-type]
    else:
        with pytest.raises(InvalidRequestError):
            llm.generate("a", params)

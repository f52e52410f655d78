"""Grammar backend with SmolLM2's tokenizer: masks, EOS only where the grammar may end, tool
grammars in every mode and format, the compile cache, the vectorized logits mask."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from radixserve.constraints import Constraint, ConstraintKind, ToolCallConstraint, ToolDef, ToolMode
from radixserve.grammar.backend import GrammarBackend, GrammarError, Matcher, bitmask_width
from radixserve.grammar.compiler import CompileFailed, GrammarCompiler
from radixserve.grammar.mask import apply_mask, build_mask, disallowed_tokens
from radixserve.model_source import resolve_model
from radixserve.tokenizer import load_tokenizer

VOCAB = 49152
EOS = 2  # <|im_end|>
WEATHER = json.dumps({"type": "object", "properties": {"city": {"type": "string"}},
                      "required": ["city"], "additionalProperties": False})


def can_end(m: Matcher) -> bool:
    """The output so far is a complete sentence of the grammar (EOS allowed)."""
    return bool(m._m.is_accepting())


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerBase:
    return load_tokenizer(resolve_model("smollm2-135m").hf_dir)


@pytest.fixture(scope="module")
def backend(tok: PreTrainedTokenizerBase) -> GrammarBackend:
    return GrammarBackend(tok, VOCAB, (EOS,))


def allowed(m: Matcher) -> set[int]:
    bits = torch.zeros(1, bitmask_width(VOCAB), dtype=torch.int32)
    m.fill_row(bits, 0)
    return set((~disallowed_tokens(bits, VOCAB))[0].nonzero().flatten().tolist())


def is_allowed(m: Matcher, token: int) -> bool:
    bits = torch.zeros(1, bitmask_width(VOCAB), dtype=torch.int32)
    m.fill_row(bits, 0)
    return bool((int(bits[0, token // 32]) >> (token % 32)) & 1)


def feed(m: Matcher, tok: PreTrainedTokenizerBase, text: str) -> bool:
    """Accept text token by token, checking each token was in the mask first."""
    for t in tok.encode(text, add_special_tokens=False):
        if not is_allowed(m, t) or not m.accept(t):
            return False
    return True


def test_choice_mask_and_termination(backend: GrammarBackend, tok: PreTrainedTokenizerBase) -> None:
    m = backend.compile(Constraint(ConstraintKind.CHOICE, choices=("yes", "no"))).matcher()
    first = {tok.decode([t]) for t in allowed(m)}
    assert first == {"y", "ye", "yes", "n", "no"}
    assert EOS not in allowed(m) and not can_end(m)
    assert feed(m, tok, "yes")
    assert can_end(m) and m.terminated


def test_eos_only_where_the_regex_may_end(backend: GrammarBackend,
                                          tok: PreTrainedTokenizerBase) -> None:
    m = backend.compile(Constraint(ConstraintKind.REGEX, r"[0-9]{3}(-[a-z]+)?")).matcher()
    seen = []
    for ch in "123-ab":
        seen.append(EOS in allowed(m))
        assert feed(m, tok, ch)
    seen.append(EOS in allowed(m))
    assert seen == [False, False, False, True, False, True, True]  # before 1 2 3 - a b, end
    assert not m.accept(tok.encode("!", add_special_tokens=False)[0])
    assert m.error != ""


def test_json_schema_accepts_valid_and_rejects_invalid(backend: GrammarBackend,
                                                       tok: PreTrainedTokenizerBase) -> None:
    c = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(
        {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["n"], "additionalProperties": False}))
    compiled = backend.compile(c)
    good = compiled.matcher()
    assert feed(good, tok, '{"n": 5}') and can_end(good)
    assert not feed(compiled.matcher(), tok, '{"n": 12}')
    assert not feed(compiled.matcher(), tok, '{"m": 1}')
    # the template is never advanced: a new matcher starts from the start state
    assert EOS not in allowed(compiled.matcher())


def test_rollback_restores_the_state(backend: GrammarBackend, tok: PreTrainedTokenizerBase) -> None:
    m = backend.compile(Constraint(ConstraintKind.JSON_OBJECT)).matcher()
    assert feed(m, tok, '{"a": 1')
    before = allowed(m)
    ids = tok.encode("}", add_special_tokens=False)
    assert feed(m, tok, "}") and can_end(m)
    m.rollback(len(ids))
    assert allowed(m) == before and not can_end(m)


def tools(mode: ToolMode, fmt: str) -> Constraint:
    defs = (ToolDef("get_weather", WEATHER),) if mode is ToolMode.NAMED else (
        ToolDef("get_weather", WEATHER), ToolDef("now", "{}"))
    return Constraint(ConstraintKind.TOOL_CALLS,
                      tool_calls=ToolCallConstraint(defs, mode, parallel=True, call_format=fmt))


H1 = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
H2 = H1 + '\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
HBAD = '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}\n</tool_call>'
L1 = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
L2 = L1 + '; {"name": "now", "parameters": {}}'


@pytest.mark.parametrize(("mode", "fmt", "text", "valid"), [
    (ToolMode.AUTO, "hermes", "It is sunny.", True),
    (ToolMode.AUTO, "hermes", "Let me check. " + H1, True),
    (ToolMode.AUTO, "hermes", H2, True),
    (ToolMode.AUTO, "hermes", "Let me check. " + HBAD, False),
    (ToolMode.AUTO, "hermes", '<tool_call>\n{"name": "nope", "arguments": {}}', False),
    (ToolMode.REQUIRED, "hermes", H1, True),
    (ToolMode.REQUIRED, "hermes", H2, True),
    (ToolMode.REQUIRED, "hermes", "It is sunny.", False),
    (ToolMode.REQUIRED, "hermes", HBAD, False),
    (ToolMode.NAMED, "hermes", H1, True),
    (ToolMode.NAMED, "hermes", H2, False),  # "now" is not the named tool
    (ToolMode.NAMED, "hermes", H1 + "\n" + H1, False),  # named: one call, even when parallel
    (ToolMode.REQUIRED, "hermes", H1 + "\n" + H1, True),  # required keeps parallel calls
    (ToolMode.AUTO, "llama3_json", "It is sunny.", True),
    (ToolMode.AUTO, "llama3_json", L2, True),
    (ToolMode.AUTO, "llama3_json", '{"name": "nope", "parameters": {}}', False),
    (ToolMode.REQUIRED, "llama3_json", L1, True),
    (ToolMode.REQUIRED, "llama3_json", "It is sunny.", False),
    (ToolMode.NAMED, "llama3_json", L1, True),
    (ToolMode.NAMED, "llama3_json", L2, False),
    (ToolMode.NAMED, "llama3_json", L1 + "; " + L1, False),
])
def test_tool_call_grammars(backend: GrammarBackend, tok: PreTrainedTokenizerBase,
                            mode: ToolMode, fmt: str, text: str, valid: bool) -> None:
    m = backend.compile(tools(mode, fmt)).matcher()
    assert (feed(m, tok, text) and can_end(m)) is valid


def test_single_call_when_not_parallel(backend: GrammarBackend,
                                       tok: PreTrainedTokenizerBase) -> None:
    c = Constraint(ConstraintKind.TOOL_CALLS, tool_calls=ToolCallConstraint(
        (ToolDef("get_weather", WEATHER), ToolDef("now", "{}")), ToolMode.REQUIRED,
        parallel=False))
    m = backend.compile(c).matcher()
    assert feed(m, tok, H1) and can_end(m)
    assert allowed(m) == {EOS}


@pytest.mark.parametrize(("fmt", "call"), [("hermes", H1), ("llama3_json", L1)])
def test_named_choice_ends_after_one_call(backend: GrammarBackend, tok: PreTrainedTokenizerBase,
                                          fmt: str, call: str) -> None:
    """A named tool choice is exactly one call (vLLM's rule) even with parallel_tool_calls:
    after the call only the end of the output is allowed."""
    m = backend.compile(tools(ToolMode.NAMED, fmt)).matcher()  # parallel=True
    assert feed(m, tok, call) and can_end(m)
    assert allowed(m) == {EOS}


def test_bad_grammar_raises(backend: GrammarBackend) -> None:
    with pytest.raises(GrammarError):
        backend.compile(Constraint(ConstraintKind.REGEX, "(unclosed"))


@pytest.fixture()
def compiler(backend: GrammarBackend) -> Iterator[GrammarCompiler]:
    c = GrammarCompiler(lambda: backend, num_threads=2)
    yield c
    c.close()


def test_compiler_caches_by_key_and_reports_failures(compiler: GrammarCompiler) -> None:
    c = Constraint(ConstraintKind.REGEX, "[ab]+")
    same = Constraint(ConstraintKind.REGEX, "[ab]+")
    compiler.request(c)
    compiler.request(same)  # in flight: no second compile
    first = compiler.wait(c)
    assert not isinstance(first, CompileFailed)
    assert compiler.poll(same) is first
    compiler.request(same)
    assert compiler.counters == {"grammar_compiles": 1, "grammar_cache_hits": 1}
    failed = compiler.wait(Constraint(ConstraintKind.LARK, "start: missing"))
    assert isinstance(failed, CompileFailed) and "missing" in failed.message


def test_apply_mask_touches_only_constrained_rows(backend: GrammarBackend) -> None:
    m = backend.compile(Constraint(ConstraintKind.CHOICE, choices=("yes", "no"))).matcher()
    mask = build_mask([None, m, None], VOCAB, torch.device("cpu"))
    assert mask is not None and mask.shape == (3, 1536) and mask.dtype == torch.int32
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    apply_mask(logits, mask)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    finite = set(torch.isfinite(logits[1]).nonzero().flatten().tolist())
    assert finite == allowed(m) and len(finite) == 5
    assert torch.equal(logits[1, sorted(finite)], before[1, sorted(finite)])
    assert build_mask([None, None], VOCAB, torch.device("cpu")) is None


def test_bitmask_unpacking_is_bit_exact() -> None:
    bits = torch.tensor([[1 - 2**31, 0], [-1, 1 << 8]], dtype=torch.int32)  # bits 0 and 31 set
    dis = disallowed_tokens(bits, 41)  # the last word covers only tokens 32..40
    assert dis.shape == (2, 41)
    assert (~dis[0]).nonzero().flatten().tolist() == [0, 31]
    assert (~dis[1]).nonzero().flatten().tolist() == list(range(32)) + [40]

"""Added tokens under a grammar, with a Qwen3-shaped tokenizer (tests/chat_templates.py:
`<think>`, `</think>`, `<tool_call>`, `</tool_call>` added, not special; `<|im_end|>`
special). llguidance's own HF reader marks every added token special: the mask then offered
`<think>` where a regex wrote it (its forced-text tokenization) but accepting it failed
("doesn't satisfy the grammar"), so the request stopped early. Here every token the mask
allows is accepted, the tags are their added tokens, and control tokens stay out of text.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from radixserve.constraints import Constraint, ConstraintKind, ToolCallConstraint, ToolDef, ToolMode
from radixserve.grammar.backend import GrammarBackend, Matcher, bitmask_width
from radixserve.grammar.mask import disallowed_tokens
from tests.chat_templates import QWEN3_TAGS, make_qwen3_tokenizer

WEATHER = json.dumps({"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]})


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerBase:
    return make_qwen3_tokenizer()


@pytest.fixture(scope="module")
def backend(tok: PreTrainedTokenizerBase) -> GrammarBackend:
    return GrammarBackend(tok, len(tok), (tok.eos_token_id,))


def allowed(m: Matcher, vocab: int) -> list[int]:
    bits = torch.zeros(1, bitmask_width(vocab), dtype=torch.int32)
    m.fill_row(bits, 0)
    return (~disallowed_tokens(bits, vocab))[0].nonzero().flatten().tolist()


def walk(m: Matcher, tok: PreTrainedTokenizerBase, limit: int = 120) -> list[int]:
    """Decode as a model that prefers Qwen3's tags, then the end, then the lowest id would,
    checking at every step that each token the mask allows is accepted."""
    tags = set(tok.convert_tokens_to_ids(list(QWEN3_TAGS)))
    out: list[int] = []
    while not m.terminated and len(out) < limit:
        ok = allowed(m, len(tok))
        assert ok, m.error
        for t in ok:
            assert m.copy().accept(t), (tok.decode(out), t, m.error)
        choose: Callable[[int], tuple[bool, bool, int]] = \
            lambda t: (t not in tags, t != tok.eos_token_id, t)
        t = min(ok, key=choose)
        assert m.accept(t), m.error
        out.append(t)
    return out


def ids(tok: PreTrainedTokenizerBase, *tokens: str) -> list[int]:
    return list(tok.convert_tokens_to_ids(list(tokens)))


def test_a_regex_writes_the_thinking_tags_as_their_tokens(backend: GrammarBackend,
                                                          tok: PreTrainedTokenizerBase) -> None:
    c = Constraint(ConstraintKind.REGEX, r"<think>\n[a-z]{2,6}\n</think>\n\n[a-z]{2,6}")
    out = walk(backend.compile(c).matcher(), tok)
    think, end = ids(tok, "<think>", "</think>")
    assert out[0] == think and end in out and out[-1] == tok.eos_token_id
    assert tok.decode(out, skip_special_tokens=True).startswith("<think>\n")


@pytest.mark.parametrize("mode", [ToolMode.REQUIRED, ToolMode.NAMED, ToolMode.AUTO])
def test_a_hermes_call_opens_and_closes_with_the_added_tokens(
        backend: GrammarBackend, tok: PreTrainedTokenizerBase, mode: ToolMode) -> None:
    """AUTO: free text where `<tool_call>` (the token) opens the constrained call."""
    c = Constraint(ConstraintKind.TOOL_CALLS, tool_calls=ToolCallConstraint(
        (ToolDef("get_weather", WEATHER),), mode))
    out = walk(backend.compile(c).matcher(), tok)
    open_, close = ids(tok, "<tool_call>", "</tool_call>")
    assert out[0] == open_ and close in out  # (named: the grammar ends with the call)
    text = tok.decode(out, skip_special_tokens=True)
    assert text == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' \
        '\n</tool_call>'


def test_control_tokens_never_match_text(backend: GrammarBackend,
                                         tok: PreTrainedTokenizerBase) -> None:
    """`(.|\\n)*` allows any text, the tags included, but no control token (`<|im_start|>`),
    and EOS only as the end."""
    m = backend.compile(Constraint(ConstraintKind.REGEX, r"(.|\n)*")).matcher()
    ok = set(allowed(m, len(tok)))
    assert set(ids(tok, *QWEN3_TAGS)) <= ok
    assert tok.convert_tokens_to_ids("<|im_start|>") not in ok
    assert tok.eos_token_id in ok and tok.pad_token_id not in ok
    m = backend.compile(Constraint.json_schema(WEATHER)).matcher()
    first = set(allowed(m, len(tok)))
    assert first == set(ids(tok, "{"))  # no tag, no control token opens JSON

"""Incremental detokenization (never broken UTF-8, same text as a one-shot decode) and stop
strings that span tokens (honoured, never emitted)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from radixserve.server.detokenizer import (
    IncrementalDetokenizer,
    StopMatcher,
)
from tests.tiny_models import make_tokenizer

BYTE_TOK = make_tokenizer()  # one token per UTF-8 byte, plus chat specials


def stream(tok: PreTrainedTokenizerFast, ids: list[int], prompt: list[int] | None = None
           ) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt or [])
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", ["héllo wörld", "日本語のテキスト", "emoji 🎉🚀", "a€b𝄞c"])
def test_multibyte_never_split(text: str) -> None:
    ids = BYTE_TOK.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode("utf-8"))  # really one token per byte
    deltas = stream(BYTE_TOK, ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


@settings(max_examples=60, deadline=None)
# Lone surrogates (category Cs) are not text a client can send: JSON bodies are UTF-8, and
# orjson rejects a lone surrogate escape, so the tokenizer never sees one.
@given(st.text(st.characters(exclude_characters="\ufffd", exclude_categories=("Cs",)),
               max_size=40),
       st.text(st.characters(exclude_categories=("Cs",)), max_size=8))
def test_stream_equals_one_shot_decode(text: str, prompt: str) -> None:
    ids = BYTE_TOK.encode(text, add_special_tokens=False)
    prompt_ids = BYTE_TOK.encode(prompt, add_special_tokens=False)
    deltas = stream(BYTE_TOK, ids, prompt_ids)
    assert "".join(deltas) == BYTE_TOK.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_truncated_character_is_flushed_at_the_end() -> None:
    ids = BYTE_TOK.encode("ok 世", add_special_tokens=False)[:-1]  # drop the last byte of 世
    deltas = stream(BYTE_TOK, ids)
    assert deltas[:3] == ["o", "k", " "] and all(d == "" for d in deltas[3:-1])
    assert deltas[-1] == "\ufffd" and "".join(deltas) == BYTE_TOK.decode(ids)


def test_invalid_bytes_do_not_hold_text_forever() -> None:
    # A lone continuation byte (0x80) never completes a character.
    cont = next(i for i in range(256) if BYTE_TOK.decode([i, i]) == "\ufffd\ufffd")
    detok = IncrementalDetokenizer(BYTE_TOK)
    outs = [detok.push(cont) for _ in range(6 + 2)]  # the detokenizer holds at most 6
    assert not any(outs[: 6 - 1])  # held while it could still complete
    assert "".join(outs) + detok.flush() == "\ufffd" * len(outs)


def test_special_tokens_are_skipped() -> None:
    eos = BYTE_TOK.convert_tokens_to_ids("<|im_end|>")
    ids = BYTE_TOK.encode("hi", add_special_tokens=False) + [eos]
    assert "".join(stream(BYTE_TOK, ids)) == "hi"


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """SentencePiece-style: '▁' marks a leading space, which decode drops at the start."""
    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "!": 3, "▁": 4}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_sentencepiece_leading_spaces_survive() -> None:
    tok = metaspace_tokenizer()
    ids = [1, 2, 3, 2]  # "hello world! world"
    assert tok.decode([2]) == "world"  # a lone-token decode loses the space ...
    assert "".join(stream(tok, ids)) == tok.decode(ids) == "hello world! world"
    # ... and with the prompt as left context the first output token keeps it.
    assert stream(tok, [2], prompt=[1])[0] == " world"


def collect(matcher: StopMatcher, pieces: list[str]) -> tuple[str, bool]:
    out = []
    for i, piece in enumerate(pieces):
        res = matcher.push(piece, final=i == len(pieces) - 1)
        out.append(res.text)
        if res.stopped:
            return "".join(out), True
    return "".join(out), False


def test_stop_string_across_tokens() -> None:
    m = StopMatcher(["STOP"])
    assert m.push("abc S").text == "abc "  # "S" could start "STOP": held back
    assert m.push("T").text == ""
    res = m.push("Oxx")
    assert res.text == "STOxx" and not res.stopped  # "STOx" can no longer become "STOP"
    res = StopMatcher(["STOP"]).push("")
    assert res == ("", False)
    assert collect(StopMatcher(["STOP"]), ["hel", "lo S", "TO", "P tail"]) == ("hello ", True)


def test_held_text_is_released() -> None:
    m = StopMatcher(["STOP"])
    assert m.push("ab ST").text == "ab "
    assert m.push("x").text == "STx"
    assert m.push("S").text == ""
    assert m.push("", final=True).text == "S"


def test_earliest_stop_wins() -> None:
    assert collect(StopMatcher(["b", "cd"]), ["ac", "db"]) == ("a", True)
    assert collect(StopMatcher([]), ["a", "b"]) == ("ab", False)


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet="abcST ", max_size=30), st.text(alphabet="abcST", min_size=1, max_size=4),
       st.lists(st.integers(0, 30), max_size=6))
def test_stop_matches_plain_find(text: str, stop: str, cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)] or [""]
    out, stopped = collect(StopMatcher([stop]), pieces)
    at = text.find(stop)
    assert stopped == (at >= 0)
    assert out == (text[:at] if at >= 0 else text)

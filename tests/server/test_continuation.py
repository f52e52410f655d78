"""A continuation (native /generate `continue_output_tokens`, what the router sends to resume
a broken stream): the text a client gets from the stream up to any break plus the
continuation equals the uninterrupted stream's, stop strings straddling the break included
(radixserve/server/choice_stream.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Sequence

import pytest

from radixserve.api.jobs import ChoiceJob
from radixserve.api.protocol import parse_generate
from radixserve.ipc.messages import GenerateMsg
from radixserve.server.choice_stream import ChoiceChunk, stream_choice
from radixserve.types import FinishReason, InvalidRequestError, SamplingParams, TokenOutput
from tests.tiny_models import make_tokenizer

TOK = make_tokenizer()  # one token per UTF-8 byte: characters split over tokens
PROMPT = tuple(TOK.encode("Q: ", add_special_tokens=False))


class Scripted:
    """A GenerateClient that emits `tokens`, then finishes with `finish` (length)."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = list(tokens)

    async def generate(self, msg: GenerateMsg) -> AsyncGenerator[TokenOutput, None]:
        for k, token in enumerate(self.tokens):
            last = k == len(self.tokens) - 1
            yield TokenOutput(msg.rid, token, FinishReason.LENGTH if last else None,
                              len(msg.prompt_ids), 0)


async def chunks(tokens: Sequence[int], job: ChoiceJob) -> list[ChoiceChunk]:
    return [dataclasses.replace(c, token_ids=list(c.token_ids))
            async for c in stream_choice(Scripted(tokens), TOK, job)]


def job_for(prompt: Sequence[int], stop: tuple[str, ...], num_continued: int = 0) -> ChoiceJob:
    return ChoiceJob(0, 0, "r", tuple(prompt), SamplingParams(max_tokens=100), stop, "",
                     num_continued=num_continued)


@pytest.mark.parametrize(("text", "stop"), [
    ("hello world, the END is near", ("END",)),
    ("naïve café 日本語 – done", ("語 –",)),  # a stop string that starts mid-character
    ("abc abd abe", ("abf",)),  # held back again and again, never matched
    ("one two three", ()),
])
async def test_continuing_after_any_chunk_gives_the_uninterrupted_text(
        text: str, stop: tuple[str, ...]) -> None:
    tokens = TOK.encode(text, add_special_tokens=False)
    whole = await chunks(tokens, job_for(PROMPT, stop))
    want = "".join(c.text for c in whole)
    assert want == (text[:text.find(stop[0])] if stop and stop[0] in text else text)
    for m in range(1, len(whole)):
        sent_ids = [t for c in whole[:m] for t in c.token_ids]
        sent_text = "".join(c.text for c in whole[:m])
        rest = tokens[len(sent_ids):]
        if not rest:
            continue
        cont = await chunks(rest, job_for([*PROMPT, *sent_ids], stop, len(sent_ids)))
        assert sent_text + "".join(c.text for c in cont) == want, m
        assert cont[-1].finish_reason == whole[-1].finish_reason, m


def test_continue_output_tokens_is_checked() -> None:
    body = {"input_ids": [1, 2, 3], "continue_output_tokens": 2}
    assert parse_generate(body).num_continued == 2
    for bad in ({**body, "continue_output_tokens": 3}, {**body, "continue_output_tokens": -1},
                {"text": "abc", "continue_output_tokens": 1}):
        with pytest.raises(InvalidRequestError):
            parse_generate(bad)

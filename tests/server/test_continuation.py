"""A continuation (native /generate `continue_output_tokens`, what the router sends to resume
a broken stream): the text a client gets from the stream up to any break plus the
continuation equals the uninterrupted stream's, stop strings straddling the break included
(radixserve/server/choice_stream.py)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path

import aiohttp
import pytest

from radixserve.api.jobs import ChoiceJob
from radixserve.api.protocol import parse_generate
from radixserve.config import EngineConfig, ServerConfig
from radixserve.ipc.client import EngineClient
from radixserve.ipc.messages import GenerateMsg
from radixserve.server.app import create_app as create_server_app
from radixserve.server.app_state import STATE_KEY
from radixserve.server.choice_stream import ChoiceChunk, stream_choice
from radixserve.testing.fake_engine import FakeEngine, InlineTransport
from radixserve.testing.fake_replica import start_app
from radixserve.types import FinishReason, InvalidRequestError, SamplingParams, TokenOutput
from tests.tiny_models import make_tokenizer
from tests.waiting import wait_until

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


def test_return_logprob_is_parsed() -> None:
    body = {"input_ids": [1, 2, 3], "return_logprob": True, "top_logprobs_num": 2}
    assert parse_generate(body).opts.params.logprobs == 2
    assert parse_generate({**body, "top_logprobs_num": None}).opts.params.logprobs == 0
    assert parse_generate({"input_ids": [1]}).opts.params.logprobs is None
    with pytest.raises(InvalidRequestError):
        parse_generate({**body, "top_logprobs_num": 99})


async def test_generate_returns_sglangs_logprob_lists(tmp_path: Path) -> None:
    """The real server app (fake engine): cumulative [logprob, id, text] per output token."""
    TOK.save_pretrained(tmp_path)
    cfg = ServerConfig(engine=EngineConfig(model=str(tmp_path)))
    app = create_server_app(cfg, EngineClient(InlineTransport(
        functools.partial(FakeEngine, eos_token_ids=()), cfg.engine)))
    runner, url = await start_app(app)
    try:
        await wait_until(lambda: app[STATE_KEY].ready)
        async with aiohttp.ClientSession() as s, s.post(f"{url}/generate", json={
                "input_ids": [70, 71, 72], "sampling_params": {"max_new_tokens": 3},
                "return_logprob": True, "top_logprobs_num": 1}) as resp:
            assert resp.status == 200, await resp.text()
            answer = await resp.json()
    finally:
        await runner.cleanup()
    meta = answer["meta_info"]
    ids = answer["output_ids"]
    assert [row[1] for row in meta["output_token_logprobs"]] == ids and len(ids) == 3
    assert [row[2] for row in meta["output_token_logprobs"]] == [TOK.decode([t]) for t in ids]
    assert [[t for _, t, _ in top] for top in meta["output_top_logprobs"]] == [[t] for t in ids]

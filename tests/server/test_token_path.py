"""The outgoing token path: how many async generators one token passes through, from the
engine client's `generate` to the route's events, with every per-request feature on (API key
counting, a deadline, a queue that may displace, usage, n > 1), on every streaming route.

Measured, not read from the code: a profile hook fires when EngineClient.generate yields a
token and walks the stack above it; every async generator frame there is one layer. With
n > 1 the choices are pumped by tasks into a queue, so a token's path is two stacks: the
pump's (up to the queue) and the handler's (from MergedStreams.next on); both are walked.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from radixserve.api.jobs import MergedStreams
from radixserve.ipc.client import EngineClient
from tests.server.test_app import GREEDY, call, serve, sse

MAX_NESTED_GENERATORS = 5
KEY = "sk-token-path"


def generator_chain(frame: FrameType | None) -> list[str]:
    """The async generators on the stack from `frame` outwards, innermost first."""
    names = []
    while frame is not None:
        if frame.f_code.co_flags & inspect.CO_ASYNC_GENERATOR:
            names.append(frame.f_code.co_name)
        frame = frame.f_back
    return names


@contextmanager
def token_yields() -> Iterator[list[list[str]]]:
    """Each time EngineClient.generate yields an output: the generators it passes through."""
    chains: list[list[str]] = []
    consumer: list[str] = []  # above MergedStreams.next: the handler's side of the queue
    produce, merge = EngineClient.generate.__code__, MergedStreams.next.__code__

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        # A generator's yield (a coroutine's return) is a "return" event with the value.
        if event != "return" or arg is None:
            return
        if frame.f_code is produce:
            chains.append(generator_chain(frame))
        elif frame.f_code is merge and len(generator_chain(frame)) > len(consumer):
            consumer[:] = generator_chain(frame)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield chains
    finally:
        sys.setprofile(previous)
    for chain in chains:  # a pumped choice's stack ends at the queue: the handler's follows
        chain.extend(name for name in consumer if name not in chain)


def assert_bounded(chains: list[list[str]], what: str) -> None:
    assert chains, f"{what}: no token left the engine client"
    deepest = max(chains, key=len)
    # The engine client itself, the choice's detokenizer, the request's outputs (merge,
    # deadline, displacement, counting) and the route's events.
    assert deepest[:3] == ["generate", "stream_choice", "outputs"], deepest
    assert len(deepest) <= MAX_NESTED_GENERATORS, f"{what}: {len(deepest)} nested: {deepest}"


async def test_a_token_passes_through_at_most_five_generators(model_dir: Path) -> None:
    chat = {"messages": [{"role": "user", "content": "hello there, token path"}],
            "max_tokens": 6, "timeout": 30, **GREEDY}
    async with serve(model_dir, api_keys=(KEY,), max_queue=8, request_timeout=60.0) as tc:
        cases: list[tuple[str, str, dict[str, Any]]] = [
            ("chat, streamed, usage", "/v1/chat/completions",
             {**chat, "stream": True, "stream_options": {"include_usage": True}}),
            ("chat, streamed, n=2", "/v1/chat/completions", {**chat, "stream": True, "n": 2}),
            ("completions, streamed", "/v1/completions",
             {"prompt": "a prompt of a few words", "max_tokens": 6, "stream": True,
              "stream_options": {"include_usage": True}, **GREEDY}),
            ("native /generate, streamed", "/generate",
             {"text": "a prompt of a few words", "stream": True,
              "sampling_params": {"max_new_tokens": 6, **GREEDY}}),
        ]
        for what, path, body in cases:
            with token_yields() as chains:
                events = await sse(tc, path, body, key=KEY)
            assert events, what
            assert_bounded(chains, what)
        with token_yields() as chains:
            resp = await tc.post("/v1/responses", json={"input": "hello", "stream": True,
                                                        "max_output_tokens": 6, **GREEDY},
                                 headers={"Authorization": f"Bearer {KEY}"})
            assert resp.status == 200 and "response.output_text.delta" in await resp.text()
        assert_bounded(chains, "responses, streamed")
        with token_yields() as chains:
            status, body = await call(tc, "/v1/completions", {"prompt": "whole answer",
                                                              "max_tokens": 4, **GREEDY}, key=KEY)
        assert status == 200 and body["usage"]["completion_tokens"] == 4
        assert_bounded(chains, "completions, whole")


def test_the_chain_walk_counts_nested_async_generators() -> None:
    """The measuring stick itself: three nested generators read as three."""
    import asyncio

    seen: list[list[str]] = []

    async def inner() -> Any:
        seen.append(generator_chain(sys._getframe()))
        yield 1

    async def middle() -> Any:
        async for x in inner():
            yield x

    async def outer() -> Any:
        async for x in middle():
            yield x

    async def main() -> list[int]:
        return [x async for x in outer()]

    assert asyncio.run(main()) == [1]
    assert seen == [["inner", "middle", "outer"]]

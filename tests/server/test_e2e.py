"""The real server (`python -m radixserve serve`, real engine, tiny random Llama) driven over
loopback with the openai SDK and raw aiohttp. One server process for the whole module."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from tests.server_proc import running_server
from tests.waiting import wait_until, wait_until_sync

pytestmark = pytest.mark.slow
KEY_A, KEY_B = "key-alpha", "key-beta"
LONG_PROMPT = "You are a careful assistant. " * 12  # ~350 byte tokens


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--kv-cache-tokens", "16384", "--api-key", KEY_A, "--max-tokens-cap", "512",
            "--enable-kv-events"]
    with running_server(tiny_llama, log, args, env={"RADIXSERVE_API_KEY": KEY_B}) as srv:
        yield srv.url
    assert srv.proc.returncode == 0, srv.output()
    text = srv.output()
    assert "KV cache size: 16384 tokens" in text
    assert "Maximum concurrency for 1024 tokens per request: 16.00x" in text


def sdk(url: str, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def model(url: str) -> str:
    name: str = sdk(url).models.list().data[0].id
    return name


def kv_stats(url: str) -> dict[str, Any]:
    import urllib.request

    req = urllib.request.Request(url + "/server_info", headers={"Authorization": f"Bearer {KEY_A}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        stats: dict[str, Any] = orjson.loads(resp.read())["stats"]
        return stats


def wait_nothing_held(url: str) -> dict[str, Any]:
    last: dict[str, Any] = {}

    def idle() -> bool:
        s = last.update(kv_stats(url)) or last
        # Invariant 1: every KV slot is free, cached or held, at all times.
        assert s["kv_free_tokens"] + s["kv_cached_tokens"] + s["kv_held_tokens"] == \
            s["kv_total_tokens"], s
        return bool(s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_held_tokens"] == 0)

    wait_until_sync(idle, timeout=20, what="no pages held")
    return last


def test_sync_completion_is_greedy_deterministic(server: str) -> None:
    client = sdk(server)
    kwargs: dict[str, Any] = {"model": model(server), "prompt": "Hello there", "max_tokens": 12,
                              "temperature": 0}
    a, b = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert a.choices[0].text == b.choices[0].text and a.choices[0].finish_reason == "length"
    assert a.usage is not None and a.usage.completion_tokens == 12
    assert a.usage.prompt_tokens == len("Hello there")  # the byte tokenizer: one per byte


async def test_async_chat_and_streaming_agree(server: str) -> None:
    client = openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY_A, max_retries=0)
    messages = [{"role": "user", "content": "Say something"}]
    name = model(server)
    whole = await client.chat.completions.create(model=name, messages=messages,  # type: ignore
                                                 max_tokens=16, temperature=0)
    stream = await client.chat.completions.create(
        model=name, messages=messages, max_tokens=16, temperature=0, stream=True,  # type: ignore
        stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens  # type: ignore
    await client.close()


def test_n_and_seed_reproducibility(server: str) -> None:
    client = sdk(server)
    kwargs: dict[str, Any] = {"model": model(server), "prompt": "Once upon", "max_tokens": 10,
                              "n": 3, "temperature": 1.0, "seed": 1234}
    a, b = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # seed + i: the choices differ


def test_stop_string_truncates(server: str) -> None:
    client = sdk(server)
    base: dict[str, Any] = {"model": model(server), "prompt": "abc", "max_tokens": 24,
                            "temperature": 0}
    full = client.completions.create(**base).choices[0].text
    clean = [i for i in range(4, len(full) - 2) if "\ufffd" not in full[i : i + 2]]
    assert clean, f"no usable stop string in {full!r}"
    stop = full[clean[0] : clean[0] + 2]
    out = client.completions.create(**base, stop=[stop]).choices[0]
    assert out.text == full[: full.find(stop)] and out.finish_reason == "stop"
    streamed = client.completions.create(**base, stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == out.text
    wait_nothing_held(server)


def test_logprobs(server: str) -> None:
    client = sdk(server)
    chat = client.chat.completions.create(
        model=model(server), messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == chat.usage.completion_tokens  # type: ignore
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert abs(item.top_logprobs[0].logprob - item.logprob) < 1e-4  # greedy took the best
    comp = client.completions.create(model=model(server), prompt="xyz", max_tokens=4,
                                     temperature=0, logprobs=1)
    lp = comp.choices[0].logprobs
    assert lp is not None and len(lp.tokens or []) == 4 and len(lp.text_offset or []) == 4


def test_cached_tokens_per_api_key(server: str) -> None:
    kwargs: dict[str, Any] = {"model": model(server), "prompt": LONG_PROMPT, "max_tokens": 2,
                              "temperature": 0}
    first = sdk(server, KEY_A).completions.create(**kwargs)
    again = sdk(server, KEY_A).completions.create(**kwargs)
    other = sdk(server, KEY_B).completions.create(**kwargs)

    def cached(resp: Any) -> int:
        n: int = resp.usage.prompt_tokens_details.cached_tokens
        return n

    assert cached(again) > 0 and cached(again) >= cached(first)
    assert cached(other) == 0  # same prompt, other key: its own namespace


async def test_disconnect_mid_stream_aborts_and_frees_everything(server: str) -> None:
    body = {"prompt": "count forever", "max_tokens": 500, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY_A}"}
    before = await asyncio.to_thread(wait_nothing_held, server)
    async with aiohttp.ClientSession() as session:
        resp = await session.post(server + "/v1/completions", json=body, headers=headers)
        assert resp.status == 200
        for _ in range(3):
            await resp.content.readline()
        resp.close()

    async def aborted() -> bool:
        stats = await asyncio.to_thread(kv_stats, server)
        return bool(stats["num_aborted_requests"] == before["num_aborted_requests"] + 1)

    await wait_until(aborted, timeout=30, what="the engine's abort of the disconnected stream")
    stats = await asyncio.to_thread(wait_nothing_held, server)
    assert stats["kv_free_tokens"] + stats["kv_cached_tokens"] == stats["kv_total_tokens"]
    # The stream was cut after a few tokens: far fewer than its 500 were generated.
    assert stats["generation_tokens"] - before["generation_tokens"] < 500


BAD: list[tuple[str, bytes, int]] = [
    ("/v1/completions", b"{oops", 400),
    ("/v1/completions", orjson.dumps({"prompt": "a", "model": "gpt-9"}), 404),
    ("/v1/completions", orjson.dumps({"prompt": "a", "max_tokens": 10_000}), 400),
    ("/v1/completions", orjson.dumps({"prompt": "a" * 1100}), 400),
    ("/v1/completions", orjson.dumps({"prompt": [1, 2, 10**6]}), 400),
    ("/v1/completions", orjson.dumps({"prompt": "a", "top_p": 7}), 400),
    ("/v1/completions", orjson.dumps({"prompt": "a", "response_format": {"type": "json"}}), 400),
    ("/v1/chat/completions", orjson.dumps({"messages": []}), 400),
    ("/v1/chat/completions", orjson.dumps({"messages": [{"role": "user"}]}), 400),
    ("/generate", orjson.dumps({"text": 5}), 400),
]


async def test_malformed_requests_get_4xx_and_serving_continues(server: str) -> None:
    headers = {"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"}
    async with aiohttp.ClientSession() as session:
        for path, raw, want in BAD:
            async with session.post(server + path, data=raw, headers=headers) as resp:
                body = await resp.json()
                assert resp.status == want, (raw, body)
                assert body["error"]["message"] and "Traceback" not in body["error"]["message"]
        async with session.post(server + "/v1/completions", data=b"{}") as resp:
            assert resp.status == 401
        async with session.post(server + "/v1/completions", headers=headers,
                                data=orjson.dumps({"prompt": "ok", "max_tokens": 2})) as resp:
            assert resp.status == 200
        async with session.get(server + "/metrics") as resp:
            text = await resp.text()
            assert "radixserve:prefix_cache_hits_total" in text
            assert "radixserve:kv_cache_held_tokens" in text


async def test_kv_events_carry_the_salted_block_hashes(server: str) -> None:
    from radixserve.api.api_keys import cache_salt_for_api_key
    from radixserve.kv_events.publisher import block_hashes
    from tests.tiny_models import make_tokenizer

    prompt = "kv events: a prompt long enough for two blocks"
    ids = make_tokenizer().encode(prompt, add_special_tokens=False)
    want = block_hashes(ids[:32], 16, cache_salt_for_api_key(KEY_B))
    headers = {"Authorization": f"Bearer {KEY_B}"}
    seen: set[int] = set()
    async with aiohttp.ClientSession() as session:
        async with session.post(server + "/v1/completions", headers=headers, json={
                "prompt": prompt, "max_tokens": 2, "temperature": 0}) as resp:
            assert resp.status == 200
        async with session.get(server + "/kv_events?since=0", headers=headers) as resp:
            assert resp.status == 200
            deadline = time.monotonic() + 10
            while not set(want) <= seen and time.monotonic() < deadline:
                line = await asyncio.wait_for(resp.content.readline(), 10)
                if line.startswith(b"data: "):
                    for event in orjson.loads(line[6:])["events"]:
                        seen.update(event.get("block_hashes", ()))
    assert set(want) <= seen  # the replica announced exactly the hashes a router computes


def test_logit_bias_through_the_sdk(server: str) -> None:
    """OpenAI's logit_bias as the SDK sends it: +100 forces a token, -100 bans one; an id
    outside the vocabulary is a 400 naming the field, and the server keeps serving."""
    from tests.tiny_models import make_tokenizer

    tokenizer = make_tokenizer()
    client = sdk(server)
    name = model(server)
    b = str(tokenizer.convert_tokens_to_ids("B"))
    forced = client.completions.create(model=name, prompt="Hello", max_tokens=6, temperature=0,
                                       logit_bias={b: 100})
    assert forced.choices[0].text == "B" * 6
    plain = client.completions.create(model=name, prompt="Hello", max_tokens=1, temperature=0)
    (top,) = tokenizer.encode(plain.choices[0].text)  # one byte token
    banned = client.completions.create(model=name, prompt="Hello", max_tokens=1, temperature=0,
                                       logit_bias={str(top): -100})
    assert banned.choices[0].text != plain.choices[0].text
    chat = client.chat.completions.create(model=name, max_tokens=3, temperature=0,
                                          messages=[{"role": "user", "content": "hi"}],
                                          logit_bias={b: 100})
    assert chat.choices[0].message.content == "BBB"
    with pytest.raises(openai.BadRequestError, match="out of range") as err:
        client.completions.create(model=name, prompt="Hello", max_tokens=1,
                                  logit_bias={"999999": 5})
    assert err.value.param == "logit_bias"
    assert client.completions.create(model=name, prompt="Hi", max_tokens=1).choices

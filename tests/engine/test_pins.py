"""Pinned prefixes: never evicted while pinned (a flood larger than the KV pool leaves them
cached), capped, surviving /flush_cache unless asked, evicted normally once released."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from radixserve import LLM, SamplingParams
from radixserve.engine.engine import Engine
from radixserve.ipc.messages import CallResultMsg, ListPinsMsg, PinMsg, UnpinMsg
from tests.server_proc import running_server

ONE = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
PREFIX = [7 + i % 200 for i in range(96)]


def call(engine: Engine, msg: Any) -> CallResultMsg:
    engine.call(msg)
    while True:
        replies = engine.drain_replies()
        if replies:
            assert len(replies) == 1 and replies[0].call_id == msg.call_id
            return replies[0]
        assert engine.has_work(), "a pin call neither answered nor queued work"
        engine.step()


def flood(llm: LLM, n: int, length: int, seed: int) -> None:
    """Unique prompts, together larger than the KV pool: everything unpinned is evicted."""
    prompts = [[3 + (seed * 131 + i * 17 + j) % 240 for j in range(length)] for i in range(n)]
    llm.generate(prompts, ONE)


def test_pinned_prefix_survives_a_flood_and_is_evicted_after_release(tiny_llama: Path) -> None:
    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_tokens=512, max_model_len=256)
    engine = llm.engine
    first = call(engine, PinMsg("p1", PREFIX))  # not cached yet: prefilled, then pinned
    assert first.error is None and first.result is not None
    assert first.result["num_tokens"] == 96 and first.result["prefilled_tokens"] == 96
    pin_id = first.result["pin_id"]
    for round_ in range(3):
        flood(llm, n=8, length=100, seed=round_)  # 800 tokens through a 512-token pool
        out = llm.generate([PREFIX + [9, 9]], ONE)[0]
        assert out.num_cached_tokens == 96, round_
        engine.check_integrity()
    listed = call(engine, ListPinsMsg("l"))
    assert listed.result is not None and [p["pin_id"] for p in listed.result["pins"]] == [pin_id]
    assert engine.flush_cache() and llm.generate([PREFIX + [5]], ONE)[0].num_cached_tokens == 96
    assert call(engine, UnpinMsg("u", pin_id=pin_id)).result == {"released": 1}
    assert call(engine, UnpinMsg("u2", pin_id=pin_id)).result == {"released": 0}
    flood(llm, n=8, length=100, seed=9)
    assert llm.generate([PREFIX + [9, 9]], ONE)[0].num_cached_tokens == 0
    engine.check_integrity()
    assert llm.kv_stats()["kv_held_tokens"] == 0


def test_pins_are_capped_and_expire(tiny_llama: Path) -> None:
    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_tokens=512, max_model_len=256,
              max_pinned_tokens=150)
    engine = llm.engine
    assert call(engine, PinMsg("a", PREFIX)).error is None
    over = call(engine, PinMsg("b", [200 - i for i in range(60)]))
    assert over.status == 400 and "150" in (over.error or "")
    short = call(engine, PinMsg("c", [5, 6, 7], ttl_s=0.001))
    assert short.error is None
    assert engine.flush_cache(include_pins=True)
    listed = call(engine, ListPinsMsg("l"))
    assert listed.result is not None and listed.result["pins"] == []
    engine.check_integrity()


@pytest.fixture(scope="module")
def pin_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("pins") / "server.log"
    args = ["--kv-cache-tokens", "512", "--max-model-len", "256", "--api-key", "tenant",
            "--admin-key", "admin"]
    with running_server(tiny_llama, log, args) as srv:
        yield srv.url


def http(url: str, method: str, path: str, key: str, body: Any = None) -> tuple[int, Any]:
    import urllib.error
    import urllib.request

    data = None if body is None else orjson.dumps(body)
    req = urllib.request.Request(url + path, data=data, method=method, headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, orjson.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, orjson.loads(err.read())


@pytest.mark.slow
def test_pin_routes_over_http(pin_server: str) -> None:
    url = pin_server
    pin_body = {"input_ids": PREFIX, "tenant_key": "tenant", "ttl": 600}
    status, out = http(url, "POST", "/cache/pin", "tenant", pin_body)
    assert status == 403 and out["error"]["code"] == "admin_key_required"
    status, out = http(url, "POST", "/cache/pin", "admin", pin_body)
    assert status == 200 and out["num_tokens"] == 96, out
    pin_id = out["pin_id"]
    status, out = http(url, "POST", "/cache/pin", "admin", {"input_ids": PREFIX, "ttl": -1})
    assert status == 400 and out["error"]["param"] == "ttl"
    for i in range(6):  # 600 unique tokens through a 512-token pool
        prompt = [3 + (i * 37 + j) % 240 for j in range(100)]
        assert http(url, "POST", "/v1/completions", "tenant",
                    {"prompt": prompt, "max_tokens": 1})[0] == 200
    assert http(url, "POST", "/flush_cache", "tenant", {})[0] == 200  # pins survive
    status, out = http(url, "POST", "/v1/completions", "tenant",
                       {"prompt": PREFIX + [9, 9], "max_tokens": 1})
    assert status == 200 and out["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    status, out = http(url, "GET", "/cache/pins", "admin")
    assert status == 200 and [p["pin_id"] for p in out["pins"]] == [pin_id]
    assert http(url, "DELETE", "/cache/pin", "admin", {"pin_id": pin_id}) == (200, {"released": 1})
    status, out = http(url, "DELETE", "/cache/pin", "admin", {"pin_id": pin_id})
    assert status == 404 and out["error"]["code"] == "pin_not_found"

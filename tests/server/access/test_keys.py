"""API keys file, per-key limits (rpm, tpm, concurrency, max_tokens, max_input_tokens), OpenAI's
x-ratelimit-* headers, per-key metrics and SIGHUP-style reloads, against the fake engine."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from radixserve.api.api_keys import KeyLimits, load_keys_file, parse_keys
from radixserve.api.ratelimit import RateLimiter, format_duration
from radixserve.config import ConfigError
from radixserve.server.access.auth import ApiKeys
from radixserve.server.app_state import STATE_KEY
from radixserve.server.metrics import ServerMetrics
from tests.repo import DOCS
from tests.server.test_app import GREEDY, TOKENIZER, call, serve

ALICE, BOB = "sk-alice-0123456789", "sk-bob-9876543210"
C_ID = TOKENIZER.encode("c", add_special_tokens=False)[0]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def write_keys(path: Path, keys: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps({"keys": keys}))
    return path


def with_clock(clock: FakeClock) -> Any:
    def hook(app: web.Application) -> None:
        app[STATE_KEY].admission.rate = RateLimiter(clock)
    return hook


def test_toml_and_json_files_parse_the_same(tmp_path: Path) -> None:
    toml = tmp_path / "keys.toml"
    toml.write_text('[[keys]]\nname = "alice"\nkey = "sk-alice-0123456789"\nrpm = 60\n'
                    'tpm = 40000\nmax_concurrency = 4\nmax_tokens = 512\n'
                    'max_input_tokens = 4096\n\n[[keys]]\nname = "bob"\n'
                    f'key_sha256 = "{hashlib.sha256(BOB.encode()).hexdigest()}"\n')
    entries = load_keys_file(toml)
    assert [e.name for e in entries] == ["alice", "bob"]
    assert entries[0].limits == KeyLimits(60, 40000, 4, 512, 4096)
    assert entries[1].limits == KeyLimits() and entries[1].digest == hashlib.sha256(
        BOB.encode()).digest()
    js = write_keys(tmp_path / "keys.json", [{"name": "alice", "key": ALICE, "rpm": 60,
                                               "tpm": 40000, "max_concurrency": 4,
                                               "max_tokens": 512, "max_input_tokens": 4096}])
    assert load_keys_file(js)[0] == entries[0]


def test_readme_keys_file_example_is_valid(tmp_path: Path) -> None:
    page = (DOCS / "operating.md").read_text()
    block = page.split("```toml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "keys.toml"
    path.write_text(block)
    entries = load_keys_file(path)
    assert [e.name for e in entries] == ["alice", "batch"]
    assert entries[0].limits == KeyLimits(60, 40000, 4, 512, 4096)
    assert [e.priority for e in entries] == [0, 10]


@pytest.mark.parametrize("keys, needle", [
    ([{"name": "a", "key": "k", "rpm": 0}], "'rpm' must be an integer >= 1"),
    ([{"name": "a", "key": "k", "rpm": "60"}], "'rpm' must be an integer >= 1"),
    ([{"name": "a", "key": "k", "burst": 3}], "unknown field(s) ['burst']"),
    ([{"name": "a", "key": "k"}, {"name": "a", "key": "j"}], "duplicate key names"),
    ([{"name": "a", "key": "k"}, {"name": "b", "key": "k"}], "the same key appears twice"),
    ([{"name": "a b", "key": "k"}], "'name' must match"),
    ([{"name": "a"}], "exactly one of 'key' and 'key_sha256'"),
    ([{"name": "a", "key_sha256": "xyz"}], "64 hex characters"),
])
def test_invalid_keys_files_are_rejected(keys: list[dict[str, Any]], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_keys({"keys": keys})
    assert needle in str(err.value)


def test_unparsable_file_error_does_not_quote_the_key(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text('[[keys]]\nname = "a"\nkey = "sk-leaky-secret\n')  # unterminated string
    with pytest.raises(ConfigError) as err:
        load_keys_file(path)
    assert "sk-leaky-secret" not in str(err.value) and "not valid TOML" in str(err.value)


def test_bucket_refills_and_durations() -> None:
    clock = FakeClock()
    limiter = RateLimiter(clock)
    limits = KeyLimits(rpm=2, tpm=100)
    assert limiter.try_acquire("a", limits, 40).retry_after_s is None
    assert limiter.try_acquire("a", limits, 40).retry_after_s is None
    refused = limiter.try_acquire("a", limits, 10)
    assert refused.limit == "requests" and refused.retry_after_s == pytest.approx(30.0)
    clock.now += 30.0  # one request back, 50 tokens back (100 per minute)
    refused = limiter.try_acquire("a", limits, 80)
    assert refused.limit == "tokens" and refused.retry_after_s == pytest.approx(60 * 10 / 100)
    assert limiter.headers("a", limits) == {
        "x-ratelimit-limit-requests": "2", "x-ratelimit-remaining-requests": "1",
        "x-ratelimit-reset-requests": "30s", "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "70", "x-ratelimit-reset-tokens": "18s"}
    assert [format_duration(s) for s in (0.02, 1.5, 360.0)] == ["20ms", "1.5s", "6m0s"]


async def test_rpm_limit_429_with_retry_after_and_headers(model_dir: Path,
                                                          tmp_path: Path) -> None:
    keys = write_keys(tmp_path / "keys.json", [{"name": "alice", "key": ALICE, "rpm": 2},
                                               {"name": "bob", "key": BOB}])
    clock = FakeClock()
    body = {"prompt": "hello world", "max_tokens": 2, **GREEDY}
    async with serve(model_dir, api_keys_file=str(keys), app_hook=with_clock(clock)) as tc:
        auth = {"Authorization": f"Bearer {ALICE}"}
        first = await tc.post("/v1/completions", data=orjson.dumps(body), headers=auth)
        assert first.status == 200
        assert first.headers["x-ratelimit-limit-requests"] == "2"
        assert first.headers["x-ratelimit-remaining-requests"] == "1"
        assert first.headers["x-ratelimit-reset-requests"] == "30s"
        assert (await tc.post("/v1/completions", data=orjson.dumps(body),
                              headers=auth)).status == 200
        refused = await tc.post("/v1/completions", data=orjson.dumps(body), headers=auth)
        assert refused.status == 429 and refused.headers["Retry-After"] == "30"
        err = (await refused.json())["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        # Other routes answered to this key carry the headers too; a key without limits none.
        models = await tc.get("/v1/models", headers=auth)
        assert models.headers["x-ratelimit-remaining-requests"] == "0"
        bob = await tc.post("/v1/completions", data=orjson.dumps(body),
                            headers={"Authorization": f"Bearer {BOB}"})
        assert bob.status == 200 and "x-ratelimit-limit-requests" not in bob.headers
        clock.now += 30.0
        assert (await tc.post("/v1/completions", data=orjson.dumps(body),
                              headers=auth)).status == 200
        metrics = await (await tc.get("/metrics")).text()
    assert 'radixserve:api_key_requests_total{key_name="alice"} 3.0' in metrics
    assert ('radixserve:api_key_requests_refused_total{code="rate_limit_exceeded",'
            'key_name="alice"} 1.0') in metrics
    assert 'radixserve:api_key_requests_total{key_name="bob"} 1.0' in metrics
    assert 'radixserve:api_key_prompt_tokens_total{key_name="alice"} 33.0' in metrics
    assert ALICE not in metrics and BOB not in metrics


async def test_tpm_charges_max_tokens_then_refunds_unused(model_dir: Path,
                                                          tmp_path: Path) -> None:
    keys = write_keys(tmp_path / "keys.json", [{"name": "alice", "key": ALICE, "tpm": 100}])
    clock = FakeClock()
    async with serve(model_dir, api_keys_file=str(keys), app_hook=with_clock(clock)) as tc:
        # 3 prompt tokens + max_tokens 60 charged; it stops at its 3rd token ("c"): 6 used.
        stops_early = {"prompt": "abc", "max_tokens": 60, "stop_token_ids": [C_ID], **GREEDY}
        status, out = await call(tc, "/v1/completions", stops_early, key=ALICE)
        assert status == 200 and out["usage"]["total_tokens"] == 6
        resp = await tc.get("/v1/models", headers={"Authorization": f"Bearer {ALICE}"})
        assert resp.headers["x-ratelimit-remaining-tokens"] == "94"
        # 11 + 85 > 94 left: refused for the 2 missing tokens' refill time (1.2 s).
        big = {"prompt": "hello world", "max_tokens": 85, **GREEDY}
        resp = await tc.post("/v1/completions", data=orjson.dumps(big),
                             headers={"Authorization": f"Bearer {ALICE}"})
        assert resp.status == 429 and resp.headers["Retry-After"] == "2"
        # More than a whole minute's allowance can never pass: a 400 that says so.
        status, out = await call(tc, "/v1/completions", {**big, "max_tokens": 100}, key=ALICE)
        assert status == 400 and out["error"]["code"] == "request_too_large"


async def test_per_key_caps_tighten_server_caps(model_dir: Path, tmp_path: Path) -> None:
    keys = write_keys(tmp_path / "keys.json", [
        {"name": "small", "key": ALICE, "max_tokens": 4, "max_input_tokens": 40},
        {"name": "big", "key": BOB}])
    async with serve(model_dir, api_keys_file=str(keys), max_tokens_cap=50) as tc:
        status, out = await call(tc, "/v1/completions", {"prompt": "abc", "max_tokens": 5},
                                 key=ALICE)
        assert status == 400 and out["error"]["param"] == "max_tokens"
        status, out = await call(tc, "/v1/completions", {"prompt": "hello world " * 4,
                                                         "max_tokens": 2}, key=ALICE)
        assert status == 400 and out["error"]["code"] == "input_too_long"
        assert "at most 40" in out["error"]["message"]
        chat = {"messages": [{"role": "user", "content": "hi"}], **GREEDY}
        status, out = await call(tc, "/v1/chat/completions", chat, key=ALICE)
        assert status == 200 and out["usage"]["completion_tokens"] <= 4
        status, _ = await call(tc, "/v1/completions", {"prompt": "hello world " * 4,
                                                       "max_tokens": 40}, key=BOB)
        assert status == 200


async def test_per_key_concurrency(model_dir: Path, tmp_path: Path) -> None:
    keys = write_keys(tmp_path / "keys.json", [
        {"name": "one", "key": ALICE, "max_concurrency": 1}, {"name": "two", "key": BOB}])
    slow = {"prompt": "abc", "max_tokens": 100, "stream": True}
    async with serve(model_dir, api_keys_file=str(keys), step_interval=0.01) as tc:
        resp = await tc.post("/v1/completions", data=orjson.dumps(slow),
                             headers={"Authorization": f"Bearer {ALICE}"})
        await resp.content.readline()
        status, out = await call(tc, "/v1/completions", {"prompt": "abc"}, key=ALICE)
        assert status == 429 and out["error"]["code"] == "concurrency_limit_exceeded"
        assert (await call(tc, "/v1/completions", {"prompt": "abc"}, key=BOB))[0] == 200
        await resp.read()


async def test_reload_swaps_keys_without_dropping_requests(model_dir: Path,
                                                           tmp_path: Path) -> None:
    path = write_keys(tmp_path / "keys.toml.json", [{"name": "alice", "key": ALICE}])
    slow = {"prompt": "abcdef", "max_tokens": 60, "stream": True, **GREEDY}
    async with serve(model_dir, api_keys=("flag-key",), api_keys_file=str(path),
                     step_interval=0.01) as tc:
        resp = await tc.post("/v1/completions", data=orjson.dumps(slow),
                             headers={"Authorization": f"Bearer {ALICE}"})
        await resp.content.readline()  # admitted and streaming
        write_keys(path, [{"name": "bob", "key": BOB}])
        assert tc.app is not None
        assert tc.app[STATE_KEY].auth.reload() == ["key-1", "bob"]
        text = await resp.text()  # the stream admitted under the old table finishes
        assert text.endswith("data: [DONE]\n\n") and '"finish_reason":"length"' in text
        assert (await call(tc, "/v1/models", method="GET", key=ALICE))[0] == 401
        assert (await call(tc, "/v1/models", method="GET", key=BOB))[0] == 200
        assert (await call(tc, "/v1/models", method="GET", key="flag-key"))[0] == 200
        path.write_text("{not json")
        with pytest.raises(ConfigError):
            tc.app[STATE_KEY].auth.reload()
        assert (await call(tc, "/v1/models", method="GET", key=BOB))[0] == 200  # kept
        await asyncio.sleep(0)


def test_tenant_metrics_are_labelled_by_key_name(tmp_path: Path) -> None:
    path = write_keys(tmp_path / "keys.json", [{"name": "alice", "key": ALICE}])
    auth = ApiKeys((), keys_file=str(path))
    caller = auth.authenticate(f"Bearer {ALICE}")
    stats = {"tenant_cached_tokens": {caller.cache_salt: 10, "0123456789abcdef": 3}}
    text = ServerMetrics(lambda: stats, auth.salt_name).render().decode()
    assert 'radixserve:tenant_cached_tokens{tenant="alice"} 10.0' in text
    assert 'radixserve:tenant_cached_tokens{tenant="0123456789ab"} 3.0' in text  # unseen key
    assert ALICE not in text

"""The HTTP layer against a fake engine (in-process): OpenAI wire format, streaming, stop
strings, n > 1, logprobs, usage and cached_tokens, /generate, and every malformed input -> 4xx
while the server keeps serving."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from radixserve.config import EngineConfig, ServerConfig
from radixserve.ipc.client import EngineClient
from radixserve.server.app import create_app
from radixserve.testing.fake_engine import FakeEngine, InlineTransport
from tests.tiny_models import make_tokenizer
from tests.waiting import wait_until

TOKENIZER = make_tokenizer()
EOS = TOKENIZER.convert_tokens_to_ids("<|im_end|>")
GREEDY = {"temperature": 0}  # the fake echoes from a seeded random offset when sampling


@contextlib.asynccontextmanager
async def serve(model_dir: Path, *, step_interval: float = 0.0, max_body_bytes: int = 1 << 20,
                engine: dict[str, Any] | None = None, engine_cfg: dict[str, Any] | None = None,
                app_hook: Any = None, **server_kwargs: Any) -> AsyncIterator[TestClient]:
    """A server on a free loopback port over FakeEngine (echoes its prompt).

    `engine` goes to FakeEngine, `engine_cfg` to EngineConfig, the rest to ServerConfig."""
    engine_config = EngineConfig(model=str(model_dir), **(engine_cfg or {}))
    cfg = ServerConfig(engine=engine_config, **server_kwargs)
    factory = functools.partial(FakeEngine, eos_token_ids=(EOS,), **(engine or {}))
    client = EngineClient(InlineTransport(factory, cfg.engine, step_interval))
    app = create_app(cfg, client, max_body_bytes=max_body_bytes)
    if app_hook is not None:
        app_hook(app)
    async with TestClient(TestServer(app)) as tc:

        async def healthy() -> bool:
            return (await tc.get("/health")).status == 200

        await wait_until(healthy, what="the fake engine ready")
        yield tc


async def call(tc: TestClient, path: str, body: Any = None, *, raw: bytes | None = None,
               key: str | None = None, method: str = "POST") -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = raw if raw is not None else orjson.dumps(body)
    resp = await tc.request(method, path, data=data, headers=headers)
    payload = await resp.read()
    return resp.status, orjson.loads(payload) if payload else None


async def sse(tc: TestClient, path: str, body: Any, key: str | None = None) -> list[Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    resp = await tc.post(path, data=orjson.dumps(body), headers=headers)
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = [line[6:] for line in (await resp.text()).split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [orjson.loads(e) for e in events[:-1]]


async def test_health_models_version(model_dir: Path) -> None:
    async with serve(model_dir) as tc:
        assert (await call(tc, "/health", method="GET")) == (200, {"status": "ok"})
        status, models = await call(tc, "/v1/models", method="GET")
        assert status == 200 and models["data"][0]["id"] == model_dir.name
        status, ver = await call(tc, "/version", method="GET")
        assert status == 200 and ver["version"]


async def test_completion_text_usage_and_cache(model_dir: Path) -> None:
    body = {"model": model_dir.name, "prompt": "hello world", "max_tokens": 5, "temperature": 0}
    async with serve(model_dir) as tc:
        status, out = await call(tc, "/v1/completions", body)
        assert status == 200, out
        assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
        assert out["choices"] == [{"index": 0, "text": "hello", "logprobs": None,
                                   "finish_reason": "length"}]
        assert out["usage"] == {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16,
                                "prompt_tokens_details": {"cached_tokens": 0}}
        _, again = await call(tc, "/v1/completions", body)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 10


async def test_stop_string_spanning_tokens_is_not_emitted(model_dir: Path) -> None:
    body = {"prompt": "abc STOP def", "max_tokens": 30, "stop": ["STOP"], **GREEDY}
    async with serve(model_dir) as tc:
        _, out = await call(tc, "/v1/completions", body)
        assert out["choices"][0]["text"] == "abc " and out["choices"][0]["finish_reason"] == "stop"
        events = await sse(tc, "/v1/completions", {**body, "stream": True})
        assert "".join(e["choices"][0]["text"] for e in events) == "abc "
        assert events[-1]["choices"][0]["finish_reason"] == "stop"


async def test_streaming_completion_matches_and_reports_usage(model_dir: Path) -> None:
    body = {"prompt": "héllo 世界 🎉!", "max_tokens": 20, "echo": True, **GREEDY}
    async with serve(model_dir) as tc:
        _, whole = await call(tc, "/v1/completions", body)
        events = await sse(tc, "/v1/completions", {**body, "stream": True,
                                                   "stream_options": {"include_usage": True}})
        texts = [c["text"] for e in events for c in e["choices"]]
        assert all("\ufffd" not in t for t in texts)
        assert "".join(texts) == whole["choices"][0]["text"]
        assert whole["choices"][0]["text"].startswith("héllo 世界 🎉!héllo")
        usage = events[-1]["usage"]
        assert events[-1]["choices"] == []
        assert usage["total_tokens"] == whole["usage"]["total_tokens"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1


async def test_chat_stream_role_first_and_eos_hidden(model_dir: Path) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, **GREEDY}
    async with serve(model_dir) as tc:
        _, whole = await call(tc, "/v1/chat/completions", body)
        msg = whole["choices"][0]
        # The fake echoes the rendered prompt; its first <|im_end|> is EOS: a clean "stop".
        # Special tokens are skipped in the text, so "<|im_start|>" disappears too.
        assert msg["message"] == {"role": "assistant", "content": "user\nhi"}
        assert msg["finish_reason"] == "stop" and whole["object"] == "chat.completion"
        rendered = TOKENIZER.apply_chat_template(body["messages"], add_generation_prompt=True,
                                                 tokenize=False)
        prompt_ids = TOKENIZER.encode(rendered, add_special_tokens=False)
        assert whole["usage"]["prompt_tokens"] == len(prompt_ids)
        assert whole["usage"]["completion_tokens"] == prompt_ids.index(EOS) + 1
        events = await sse(tc, "/v1/chat/completions", {**body, "stream": True})
        assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(e["object"] == "chat.completion.chunk" for e in events)
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
        assert text == msg["message"]["content"]
        assert events[-1]["choices"][0]["finish_reason"] == "stop"


async def test_chat_without_max_tokens_fills_the_context(model_dir: Path) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "ignore_eos": True}
    async with serve(model_dir, engine={"max_model_len": 64}) as tc:
        _, out = await call(tc, "/v1/chat/completions", body)
        usage = out["usage"]
        assert usage["total_tokens"] == 64 and out["choices"][0]["finish_reason"] == "length"


async def test_n_choices_and_seed_reproducibility(model_dir: Path) -> None:
    body = {"prompt": "abcdefghij", "max_tokens": 4, "n": 3, "temperature": 1.0, "seed": 7}
    async with serve(model_dir) as tc:
        _, a = await call(tc, "/v1/completions", body)
        _, b = await call(tc, "/v1/completions", body)
        assert [c["index"] for c in a["choices"]] == [0, 1, 2]
        assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
        assert a["usage"]["completion_tokens"] == 12 and a["usage"]["prompt_tokens"] == 10
        events = await sse(tc, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "abc"}], "max_tokens": 3, "n": 2,
            "stream": True})
        roles = [e["choices"][0]["index"] for e in events if "role" in e["choices"][0]["delta"]]
        assert sorted(roles) == [0, 1]
        finished = [e["choices"][0]["index"] for e in events if e["choices"][0]["finish_reason"]]
        assert sorted(finished) == [0, 1]


async def test_batched_prompts(model_dir: Path) -> None:
    async with serve(model_dir) as tc:
        _, out = await call(tc, "/v1/completions", {"prompt": ["ab", [104, 105]], "max_tokens": 2,
                                                    **GREEDY})
        assert [c["text"] for c in out["choices"]] == ["ab", TOKENIZER.decode([104, 105])]
        assert out["usage"]["prompt_tokens"] == 4


async def test_logprobs_shapes(model_dir: Path) -> None:
    async with serve(model_dir) as tc:
        _, out = await call(tc, "/v1/completions", {"prompt": "abc", "max_tokens": 3,
                                                    "logprobs": 2, **GREEDY})
        lp = out["choices"][0]["logprobs"]
        assert lp["tokens"] == ["a", "b", "c"] and lp["text_offset"] == [0, 1, 2]
        assert lp["token_logprobs"] == [-0.25] * 3 and len(lp["top_logprobs"][0]) == 2
        _, chat = await call(tc, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "logprobs": True,
            "top_logprobs": 1, **GREEDY})  # sampling could echo EOS first: 1 token
        content = chat["choices"][0]["logprobs"]["content"]
        assert len(content) == 2 and content[0]["logprob"] == -0.25
        assert content[0]["bytes"] == list(content[0]["token"].encode())
        assert len(content[0]["top_logprobs"]) == 1


async def test_native_generate(model_dir: Path) -> None:
    async with serve(model_dir) as tc:
        status, out = await call(tc, "/generate", {"text": "hello", "sampling_params": {
            "max_new_tokens": 3, **GREEDY}})
        assert status == 200 and out["text"] == "hel"
        assert out["output_ids"] == TOKENIZER.encode("hel", add_special_tokens=False)
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 3
        assert meta["finish_reason"] == {"type": "length"} and "cached_tokens" in meta
        ab = TOKENIZER.encode("ab", add_special_tokens=False)
        events = await sse(tc, "/generate", {"input_ids": ab, "stream": True,
                                             "sampling_params": {"max_new_tokens": 3, **GREEDY}})
        assert [e["text"] for e in events] == ["a", "ab", "aba"]  # cumulative, as SGLang
        assert events[-1]["output_ids"] == [*ab, ab[0]]


async def test_flush_cache_and_metrics(model_dir: Path) -> None:
    body = {"prompt": "a long shared prompt", "max_tokens": 2}
    async with serve(model_dir) as tc:
        await call(tc, "/v1/completions", body)
        assert (await call(tc, "/flush_cache", {}))[0] == 200
        _, out = await call(tc, "/v1/completions", body)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        async def metrics_text() -> str:
            return await (await tc.get("/metrics")).text()

        async def both_counted() -> bool:  # the engine's stats reach the API process async
            return 'radixserve:generation_tokens_total 4.0' in await metrics_text()

        await wait_until(both_counted, what="the engine stats of both requests")
        text = await metrics_text()
        for name in ("prefix_cache_queries_total", "prefix_cache_hits_total",
                     "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                     "kv_cache_free_tokens", "kv_cache_cached_tokens", "kv_cache_held_tokens",
                     "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                     'request_success_total{finished_reason="length"} 2.0',
                     "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_count",
                     "e2e_request_latency_seconds_sum"):
            assert f"radixserve:{name}" in text, name


BAD_REQUESTS: list[tuple[str, Any, int, str | None]] = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {"prompt": "a", "model": "nope"}, 404, "model"),
    ("/v1/completions", {"prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "temperature": "x"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x" * 600}, 400, "prompt"),
    ("/v1/completions", {"prompt": "y" * 5000}, 400, "prompt"),  # tokenized in a thread
    ("/v1/completions", {"prompt": "a", "max_tokens": 600}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [99999]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "a", "tools": [{"type": "function"}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    ("/generate", {"text": ""}, 400, "text"),
]


async def test_bad_inputs_get_4xx_and_the_server_keeps_serving(model_dir: Path) -> None:
    async with serve(model_dir) as tc:
        for path, body, want, param in BAD_REQUESTS:
            raw = body if isinstance(body, bytes) else None
            status, out = await call(tc, path, body, raw=raw)
            assert status == want, (body, out)
            assert set(out["error"]) == {"message", "type", "param", "code"}
            assert out["error"]["param"] == param, out
        _, long_prompt = await call(tc, "/v1/completions", {"prompt": "x" * 600})
        assert "512" in long_prompt["error"]["message"]  # names the limit
        status, _ = await call(tc, "/v1/completions", {"prompt": "fine", "max_tokens": 1})
        assert status == 200


async def test_limits_body_size_routes_and_caps(model_dir: Path) -> None:
    async with serve(model_dir, max_body_bytes=1000, max_tokens_cap=8,
                     max_input_tokens=20) as tc:
        status, out = await call(tc, "/v1/completions", {"prompt": "x" * 5000})
        assert status == 413 and out["error"]["code"] == "body_too_large"
        status, out = await call(tc, "/v1/completions", {"prompt": "a", "max_tokens": 9})
        assert status == 400 and "cap" in out["error"]["message"]
        status, out = await call(tc, "/v1/completions", {"prompt": "y" * 21})
        assert status == 400 and out["error"]["code"] == "input_too_long"
        _, out = await call(tc, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "q"}], "ignore_eos": True})
        assert out["usage"]["completion_tokens"] == 8  # unset max_tokens: the cap
        assert (await call(tc, "/nope", {}))[0] == 404
        status, out = await call(tc, "/v1/completions", method="GET")
        assert status == 405 and "error" in out


async def test_unexpected_exception_is_a_json_500(model_dir: Path) -> None:
    async def boom(request: web.Request) -> web.Response:
        raise RuntimeError("bug")

    def hook(app: web.Application) -> None:
        app.router.add_get("/boom", boom)

    async with serve(model_dir, app_hook=hook) as tc:
        status, out = await call(tc, "/boom", method="GET")
        assert status == 500 and out["error"]["type"] == "server_error"
        assert "Traceback" not in out["error"]["message"]
        assert (await call(tc, "/health", method="GET"))[0] == 200


async def test_chat_without_a_template_is_a_400(tmp_path: Path) -> None:
    tok = make_tokenizer()
    tok.chat_template = None
    tok.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    async with serve(tmp_path) as tc:
        status, out = await call(tc, "/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": "x"}]})
        assert status == 400 and "chat template" in out["error"]["message"]
        assert (await call(tc, "/v1/completions", {"prompt": "x", "max_tokens": 1}))[0] == 200

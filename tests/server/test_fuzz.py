"""A real server (tiny random Llama, real engine process) under generated input: hypothesis
posts JSON (valid, invalid, nested, huge numbers, wrong types, unicode, empty) and raw bytes to
every route: never a 5xx, always an OpenAI error body for a 4xx, the server stays alive and
ends with no page held. Then its whole output is grepped: no prompt, completion or API key."""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_proc import ServerProc, running_server
from tests.soak import SoakReport, soak

pytestmark = pytest.mark.slow

KEY = "sk-fuzz-7f3a9c1e5b2d4f60"
SECRET = "SECRET-PROMPT-zq81vx"  # sent inside prompts; must never reach the server's output
ROUTES = ["/v1/completions", "/v1/chat/completions", "/generate", "/flush_cache", "/v1/models",
          "/health", "/metrics", "/server_info", "/version", "/kv_events", "/nope", "/tokenize",
          "/detokenize", "/v1/responses"]
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "min_p", "n", "stream", "stream_options", "stop", "seed", "logprobs",
          "top_logprobs", "echo", "stop_token_ids", "timeout", "text", "input_ids",
          "sampling_params", "model", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "min_tokens", "ignore_eos", "response_format", "logit_bias",
          "user", "best_of", "suffix", "role", "content", "tokens", "add_special_tokens",
          "return_token_strs", "add_generation_prompt", "continue_final_message",
          "chat_template_kwargs", "input", "instructions", "max_output_tokens", "tools",
          "tool_choice", "previous_response_id", "reasoning", "include", "store", "metadata"]
EDGE_VALUES = [0, -1, 1, 2**31, 2**63, 2**64, 10**30, -(10**30), 1e308, -1e308, 1e-300, 0.5,
               "", "\x00", "🎉" * 3, "é", [], {}, [[]], [-1], [10**9], [0, 1, 2], [""],
               {"role": "user", "content": "hi"}, [{"role": "user", "content": "hi"}],
               [{"role": "tool", "content": 1}], {"include_usage": True}, True, False, None,
               [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}],
               [{"type": "function_call_output", "call_id": "c", "output": ["x"]}],
               {"format": {"type": "json_schema", "name": "n", "schema": {"type": "objct"}}},
               [{"type": "function", "name": "f", "parameters": {"type": 3}}]]

leaves = (st.none() | st.booleans() | st.integers(-(2**80), 2**80)
          | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20))
json_values = st.recursive(
    leaves, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.text(max_size=8), inner, max_size=4), max_leaves=10)
field_values = json_values | st.sampled_from(EDGE_VALUES)
near_valid = st.dictionaries(st.sampled_from(FIELDS), field_values, max_size=6)


def sampling_fields(edgy: bool) -> st.SearchStrategy[dict[str, Any]]:
    """Typed sampling fields: in range, or (edgy) straddling and far past the limits."""
    def num(lo: float, hi: float) -> st.SearchStrategy[Any]:
        if not edgy:
            return st.floats(lo, hi)
        return st.floats(lo - 3, hi + 3) | st.sampled_from([1e308, -1e-300, 2**64, -(2**64)])

    def integer(lo: int, hi: int) -> st.SearchStrategy[int]:
        if not edgy:
            return st.integers(lo, hi)
        return st.integers(lo - 3, hi + 3) | st.sampled_from([2**31, 2**63, 10**30, -(10**30)])

    fields = st.fixed_dictionaries({}, optional={
        "max_tokens": integer(1, 8), "temperature": num(0, 2), "top_p": num(0.01, 1),
        "min_p": num(0, 1), "presence_penalty": num(-2, 2), "frequency_penalty": num(-2, 2),
        "repetition_penalty": num(0.01, 2), "top_k": integer(-1, 300), "n": integer(1, 3),
        "stream": st.booleans(), "ignore_eos": st.booleans(),
        "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
        "seed": integer(-(2**63), 2**63 - 1), "min_tokens": integer(0, 1),
        "stop_token_ids": st.lists(integer(0, 250), max_size=3), "timeout": num(0.001, 30),
        "priority": integer(-5, 5), "stream_options": st.just({"include_usage": True}),
    })
    if edgy:
        return fields
    return fields.map(lambda d: d if d.get("stream") else {
        k: v for k, v in d.items() if k != "stream_options"})


bodies = st.one_of(
    json_values,
    near_valid,
    sampling_fields(edgy=True).map(lambda d: {"prompt": f"hi {SECRET}", **d}),
    sampling_fields(edgy=True).map(lambda d: {"prompt": [[5, 6, 7], [300]], **d}),
    sampling_fields(edgy=False).map(lambda d: {"prompt": f"hi {SECRET}", **d}),
    sampling_fields(edgy=False).map(lambda d: {"prompt": [[5, 6, 7], [200, 3]], **d}),
    sampling_fields(edgy=False).map(
        lambda d: {"messages": [{"role": "user", "content": f"{SECRET} é🎉"}], **d}),
    near_valid.map(lambda d: {"prompt": f"hi {SECRET}", "max_tokens": 4, **d}),
    near_valid.map(lambda d: {"messages": [{"role": "user", "content": SECRET}], **d}),
    near_valid.map(lambda d: {"text": SECRET, **d}),
)


FUZZER = {"name": "fuzzer", "key": KEY, "rpm": 100000, "tpm": 10000000}


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fuzz") / "keys.json"
    path.write_text(json.dumps({"keys": [FUZZER]}))
    return path


@pytest.fixture(scope="module")
def server(tiny_llama: Path, keys: Path) -> Iterator[ServerProc]:
    tmp = keys.parent
    args = ["--kv-cache-tokens", "4096", "--api-keys-file", str(keys), "--log-requests",
            "--max-tokens-cap", "16", "--max-queue", "64", "--max-body-bytes", "65536",
            "--request-timeout", "60"]
    with running_server(tiny_llama, tmp / "server.log", args, key=KEY) as proc:
        yield proc


def request(conn: http.client.HTTPConnection, method: str, path: str,
            body: bytes | None, key: str | None = KEY) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    conn.request(method, path, body=body, headers=headers)
    resp = conn.getresponse()
    return resp.status, resp.read()


def check_answer(status: int, payload: bytes) -> None:
    assert status < 500, payload[:500]
    if status >= 400 and payload:
        err = orjson.loads(payload)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if status == 200 and payload.startswith(b"data: "):
        assert b'"server_error"' not in payload, payload[-500:]


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(route=st.sampled_from(ROUTES[:3] * 4 + ROUTES[3:]), body=bodies)
def test_generated_json_never_5xx(server: ServerProc, route: str, body: Any) -> None:
    conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=120)
    try:
        raw = orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS) if not isinstance(
            body, bytes) else body
    except orjson.JSONEncodeError:  # an integer beyond 64 bits: send it as JSON text
        raw = json.dumps(body).encode()
    try:
        for method in ("POST", "GET"):
            if route == "/kv_events" and method == "GET":
                continue  # off here (404) and, on, an endless stream
            check_answer(*request(conn, method, route, raw))
    finally:
        conn.close()


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(route=st.sampled_from(ROUTES[:3]), raw=st.binary(max_size=64),
       key=st.sampled_from([KEY, None, "", "wrong", KEY + "x", "Bearer"]))
def test_raw_bytes_and_bad_keys_never_5xx(server: ServerProc, route: str, raw: bytes,
                                         key: str | None) -> None:
    conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=120)
    try:
        status, payload = request(conn, "POST", route, raw, key)
        check_answer(status, payload)
        if key != KEY:
            assert status == 401
    finally:
        conn.close()


def check_soak(server: ServerProc, report: SoakReport) -> None:
    """What every soak run must end with: only expected outcomes, every kind exercised, no
    page held, the engine's own integrity check passing, and memory flat after warm-up."""
    print(report.line())
    assert report.unexpected == {}, report.line()
    for kind in ("ok_stream", "ok_json", "rejected_4xx"):
        assert report.outcomes[kind] > 0, report.line()
    stats = server.wait_idle()
    assert stats["kv_held_tokens"] == 0
    assert stats.get("integrity_ok") is True, stats
    for name, start in report.rss_start.items():
        assert report.rss_end[name] <= start * 1.25 + 64, report.line()


def test_soak_short(server: ServerProc) -> None:
    """The always-run length of the soak (tests/test_soak.py runs it for minutes)."""
    pids = {"api": server.proc.pid, "engine": server.info()["engine_pid"]}
    report = asyncio.run(soak(server.url, KEY, pids, duration_s=8.0, concurrency=6))
    check_soak(server, report)


def test_sighup_reloads_the_keys_file(server: ServerProc, keys: Path) -> None:
    keys.write_text(json.dumps({"keys": [FUZZER, {"name": "second", "key": "sk-second-1"}]}))
    other = ServerProc(server.url, server.proc, server.log, "sk-second-1")
    assert other.get("/v1/models")[0] == 401
    server.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while other.get("/v1/models")[0] != 200:
        assert time.monotonic() < deadline, "keys not reloaded"
        time.sleep(0.05)
    assert server.get("/v1/models")[0] == 200
    assert "API keys reloaded: 2 keys (fuzzer, second)" in server.output()


def stream_in_thread(server: ServerProc, started: threading.Event,
                     out: list[str]) -> threading.Thread:
    def run() -> None:
        conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=120)
        body = {"prompt": "Drain me", "max_tokens": 16, "n": 4, "ignore_eos": True,
                "stream": True}
        conn.request("POST", "/v1/completions", body=orjson.dumps(body),
                     headers={"Authorization": f"Bearer {KEY}"})
        resp = conn.getresponse()
        first = resp.readline()
        started.set()
        out.append((first + resp.read()).decode())
        conn.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_zz_alive_idle_and_logs_redacted(server: ServerProc) -> None:
    """Runs last in this module: it stops the server to read its whole output."""
    conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=120)
    texts = []
    for path, body in (("/v1/completions", {"prompt": f"Tell me {SECRET}", "max_tokens": 8,
                                            "temperature": 0}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                              "content": SECRET}]}),
                       ("/generate", {"text": SECRET, "sampling_params": {"max_new_tokens": 8}})):
        status, payload = request(conn, "POST", path, orjson.dumps(body))
        assert status == 200, payload
        out = orjson.loads(payload)
        texts.append(out["text"] if "text" in out else (
            out["choices"][0].get("text") or out["choices"][0]["message"]["content"]))
    conn.close()
    assert server.get("/health")[0] == 200
    server.wait_idle()
    conn = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=120)
    metrics = request(conn, "GET", "/metrics", None)[1].decode()
    conn.close()
    # Drain: SIGTERM while streams run; they finish whole, then the process exits 0.
    events = [threading.Event() for _ in range(6)]
    outs: list[str] = []
    threads = [stream_in_thread(server, e, outs) for e in events]
    for e in events:
        assert e.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(120)
    assert server.proc.wait(120) == 0
    assert len(outs) == 6 and all(o.endswith("data: [DONE]\n\n") for o in outs)
    assert all(o.count('"finish_reason":"length"') == 4 for o in outs)
    log = server.output()
    assert "stop signal: draining" in log and "requests in flight, waiting" in log
    assert "requests still in flight are cut off" not in log
    assert "request POST /v1/completions key=fuzzer" in log  # --log-requests is on ...
    assert "'Tell me ...'" in log  # ... showing 8 characters of a prompt at most
    assert SECRET not in log and KEY not in log
    admitted = next(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith('radixserve:api_key_requests_total{key_name="fuzzer"}'))
    assert admitted >= 10  # the generated input reached the engine, not only the validators
    for text in texts:
        if len(text) >= 12:  # long enough not to occur by chance
            assert text not in log

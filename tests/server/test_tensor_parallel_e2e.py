"""`radixserve serve --tensor-parallel-size 2` end to end (gloo on CPU, tiny Llama, fp32): the
OpenAI routes, streaming and cached_tokens exactly as at TP 1; a router in front of two TP-2
replicas; a SIGKILLed rank under load: every client gets an error within 10 s, no process
is left."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from radixserve.testing.fake_replica import start_app
from router.app import create_app
from router.config import RouterConfig
from router.routing.route_key import HFPromptEncoder
from tests.engine.test_tensor_parallel import gone
from tests.server_proc import ServerProc, free_port, running_server, start_all

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TP2 = ["--tensor-parallel-size", "2"]
PREFIX = "You are a terse assistant. Answer in one short sentence, please. " * 2


def post(server: ServerProc, path: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(server.url + path, data=orjson.dumps(body),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        if body.get("stream"):
            return [orjson.loads(line[6:]) for line in resp.read().decode().splitlines()
                    if line.startswith("data: {")]
        return orjson.loads(resp.read())


def exercise(server: ServerProc) -> dict[str, Any]:
    """What a client sees of the OpenAI routes: models, completions (cold, then warm), and a
    streamed chat with its usage."""
    _, models = server.get("/v1/models")
    completions = [post(server, "/v1/completions", {
        "prompt": PREFIX + question, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        for question in ("Q: one?", "Q: two?", "Q: one?")]
    chunks = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": PREFIX}], "max_tokens": 8, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}})
    return {
        "models": [m["id"] for m in models["data"]],
        "texts": [c["choices"][0]["text"] for c in completions],
        "cached": [c["usage"]["prompt_tokens_details"]["cached_tokens"] for c in completions],
        "stream": "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                          if c["choices"]),
        "stream_chunks": sum(1 for c in chunks if c["choices"]),
        "stream_usage": chunks[-1]["usage"],
    }


def test_tp2_serves_the_openai_routes_exactly_as_tp1(tiny_llama: Path, tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        tp1, tp2 = start_all(stack, [(tiny_llama, tmp_path / "tp1.log", []),
                                     (tiny_llama, tmp_path / "tp2.log", TP2)])
        info = tp2.info()
        assert info["engine_info"]["tensor_parallel_size"] == 2
        assert len(info["engine_info"]["tp_worker_pids"]) == 1
        seen = {tp: exercise(server) for tp, server in ((1, tp1), (2, tp2))}
        with urllib.request.urlopen(tp2.url + "/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        tp2.wait_idle()
    assert seen[2] == seen[1]
    assert seen[2]["cached"][2] > len(PREFIX) // 2 and seen[2]["stream_chunks"] >= 2
    assert "radixserve:tensor_parallel_size 2.0" in metrics
    assert "radixserve:tp_collective_ms_per_step" in metrics


async def test_a_router_in_front_of_two_tp2_replicas(tiny_llama: Path, tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        a, b = start_all(stack, [(tiny_llama, tmp_path / "a.log", TP2),
                                 (tiny_llama, tmp_path / "b.log", TP2)])
        cfg = RouterConfig(workers=(a.url, b.url), health_interval_s=0.2)
        runner, url = await start_app(create_app(cfg, encoder=HFPromptEncoder(tiny_llama)))
        try:
            async with aiohttp.ClientSession() as s:
                answers = []
                for i in range(4):
                    body = {"prompt": PREFIX + f"Question {i}?", "max_tokens": 4,
                            "temperature": 0, "ignore_eos": True}
                    async with s.post(f"{url}/v1/completions", json=body) as resp:
                        assert resp.status == 200, await resp.text()
                        answers.append(await resp.json())
        finally:
            await runner.cleanup()
        served = [s.info()["stats"]["prefix_cache_queries"] for s in (a, b)]
    # The shared prefix sends all four to one replica, where the last three hit it.
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in answers]
    assert all(c >= len(PREFIX) // 2 for c in cached[1:]), cached
    assert sorted(served)[0] == 0 and all(len(r["choices"][0]["text"]) > 0 for r in answers)


async def _stream_until_error(url: str, i: int, first: asyncio.Event) -> tuple[bool, float]:
    """(whether the stream reported an error or broke off, when it ended)."""
    body = {"prompt": f"Request {i}: " + PREFIX, "max_tokens": 800, "temperature": 0,
            "ignore_eos": True, "stream": True}
    errored = False
    try:
        async with aiohttp.ClientSession() as s, s.post(f"{url}/v1/completions",
                                                        json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                first.set()
                if line.startswith(b"data: {") and b'"error"' in line:
                    errored = True
    except aiohttp.ClientError:
        errored = True
    return errored, time.monotonic()


async def test_a_sigkilled_rank_under_load_fails_every_client_fast(tiny_llama: Path,
                                                                    tmp_path: Path) -> None:
    with running_server(tiny_llama, tmp_path / "tp2.log", TP2) as server:
        info = server.info()
        engine_pid = info["engine_pid"]
        (worker,) = info["engine_info"]["tp_worker_pids"]
        started = [asyncio.Event() for _ in range(6)]
        tasks = [asyncio.create_task(_stream_until_error(server.url, i, ev))
                 for i, ev in enumerate(started)]
        await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in started)), 60)
        os.kill(worker, signal.SIGKILL)
        killed_at = time.monotonic()
        ends = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        assert all(errored for errored, _ in ends), ends
        latency = max(t for _, t in ends) - killed_at
        print(f"every client saw its error {latency:.2f} s after the SIGKILL")  # pytest -s
        assert latency < 10
        # Without --restart-engine the server exits 1 so that its supervisor restarts it.
        assert server.proc.wait(30) == 1
        log = server.output()
    assert "tensor-parallel rank 1" in log and "SIGKILL" in log
    deadline = time.monotonic() + 10
    while not (gone(worker) and gone(engine_pid)) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert gone(worker) and gone(engine_pid)


def test_two_nodes_on_loopback_serve_as_one(tiny_llama: Path, tmp_path: Path) -> None:
    """`--nnodes 2`: node 1 (`--node-rank 1`) runs rank 1 only, node 0 the server and rank 0;
    they meet at --dist-init-addr. Answers equal TP 1's; stopping node 0 stops node 1."""
    from radixserve import LLM, SamplingParams

    addr = f"127.0.0.1:{free_port()}"
    nodes = ["-tp", "2", "--nnodes", "2", "--dist-init-addr", addr]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    with open(tmp_path / "node1.log", "wb") as sink:
        node1 = subprocess.Popen([sys.executable, "-m", "radixserve", "serve", "--model",
                                  str(tiny_llama), "--dtype", "float32", "--num-threads", "1",
                                  *nodes, "--node-rank", "1"], stdout=sink,
                                 stderr=subprocess.STDOUT, env=env)
    try:
        with running_server(tiny_llama, tmp_path / "node0.log", [*nodes, "--node-rank", "0"],
                            env={"GLOO_SOCKET_IFNAME": "lo"}) as node0:
            answer = post(node0, "/v1/completions", {
                "prompt": PREFIX, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
            assert node0.info()["engine_info"]["tensor_parallel_size"] == 2
            assert node0.info()["engine_info"]["tp_worker_pids"] == []  # rank 1 is remote
        assert node1.wait(30) == 0  # node 0's clean stop reached it
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait(10)
    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_tokens=4096)
    want = llm.generate([PREFIX], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert answer["choices"][0]["text"] == want[0].text
    assert "node 1 of 2: tensor-parallel ranks 1-1" in (tmp_path / "node1.log").read_text()


def test_restart_engine_brings_back_a_whole_tp_group(tiny_llama: Path, tmp_path: Path) -> None:
    with running_server(tiny_llama, tmp_path / "tp2.log", [*TP2, "--restart-engine"]) as server:
        (worker,) = server.info()["engine_info"]["tp_worker_pids"]
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while server.info()["engine_info"].get("tp_worker_pids") in (None, [worker]):
            assert time.monotonic() < deadline, server.output()
            time.sleep(0.2)
        server.wait_healthy()
        (new_worker,) = server.info()["engine_info"]["tp_worker_pids"]
        answer = post(server, "/v1/completions", {"prompt": PREFIX, "max_tokens": 4,
                                                  "temperature": 0, "ignore_eos": True})
        assert answer["usage"]["completion_tokens"] == 4
        assert "engine restarted" in server.output() and gone(worker)
    assert new_worker != worker and gone(new_worker)

"""A fake replica for the router's tests and benchmark: `radixserve serve` without a model.

The HTTP surface of `radixserve serve` over a simulated prefix cache.

Owns: the simulation. Prefill is serialized per replica (one accelerator) and costs
`prefill_s_per_token` per UNCACHED prompt token; decode streams `max_tokens` tokens
`decode_s_per_token` apart, concurrently. The cache is an LRU of block hashes (the real
`radixserve.kv_events.publisher.block_hashes` chain, salted per API key like the server) whose changes
go to a real `KVEventPublisher` behind the real `/kv_events` route, so precise mode is
exercised end to end. Answers carry `usage.prompt_tokens_details.cached_tokens` and an
`X-Fake-Replica` header naming the replica. Does not know: the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from radixserve.api.api_keys import cache_salt_for_api_key
from radixserve.config.kv_events_config import HashAlgo
from radixserve.kv_events.publisher import (
    AllBlocksCleared,
    BlockEvent,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
    block_hashes,
)
from radixserve.server.routes.kv_events import setup_kv_events
from radixserve.testing.hang import Hang, hang_middleware
from router.config import RouterConfig


async def start_app(app: web.Application, port: int = 0, host: str = "127.0.0.1"
                    ) -> tuple[web.AppRunner, str]:
    """Serve `app` on `host` (port 0: a free one); stop it with `runner.cleanup()`."""
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    host, real_port = runner.addresses[0][:2]
    return runner, f"http://{host}:{real_port}"


class ByteEncoder:
    """UTF-8 bytes as token ids; chat as "<role>content\\n" lines. A PromptEncoder."""

    def encode_prompt(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        text = "".join(f"<{m.get('role')}>{m.get('content')}\n" for m in messages)
        return self.encode_prompt(text + ("<assistant>" if add_generation_prompt else ""))


@dataclass(frozen=True)
class FakeReplicaConfig:
    name: str = "fake"
    block_size: int = 16
    cache_blocks: int = 1 << 16
    base_latency_s: float = 0.0
    prefill_s_per_token: float = 0.0
    decode_s_per_token: float = 0.0
    default_max_tokens: int = 4
    kv_keepalive_s: float = 10.0
    salt_by_key: bool = True  # False: like a server without --api-key (one namespace)
    hash_algo: HashAlgo = HashAlgo.XXH64  # --prefix-caching-hash-algo


class FakeReplica:
    def __init__(self, cfg: FakeReplicaConfig, encoder: ByteEncoder | None = None) -> None:
        self.cfg = cfg
        self.encoder = encoder or ByteEncoder()
        self.publisher = KVEventPublisher(cfg.block_size, keepalive_s=cfg.kv_keepalive_s)
        self.healthy = True
        self.break_after_chunks: int | None = None  # streams die after this many chunks
        self.hold_streams: asyncio.Event | None = None  # set: streams wait before their end
        self.hang: Hang | None = None  # set: every request hangs there (hang.py)
        self.num_requests = 0
        self.num_aborted = 0  # streams whose client went away
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.auth_seen: list[str | None] = []
        self._cache: OrderedDict[int, None] = OrderedDict()  # least recent first
        self._prefill = asyncio.Lock()
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.app = web.Application(middlewares=[hang_middleware(lambda: self.hang)])
        setup_kv_events(self.app, self.publisher)
        for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
            self.app.router.add_post(path, self._generate)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/metrics", self._metrics)
        self.app.router.add_post("/flush_cache", self._flush)
        self.app.router.add_post("/tokenize", self._tokenize)

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self, port: int = 0, host: str = "127.0.0.1") -> str:
        self._runner, self.url = await start_app(self.app, port, host)
        return self.url

    async def stop(self) -> None:
        """Dead as a killed process: connections cut at once, not drained gracefully."""
        if self._runner is None:
            return
        server = self._runner.server
        for conn in server.connections if server is not None else ():
            if conn.transport is not None:
                conn.transport.abort()
        await self._runner.cleanup()  # closes the listener before it first yields
        self._runner = None

    # --- the simulated cache -------------------------------------------------------------

    def _lookup_and_insert(self, ids: list[int], salt: str) -> int:
        """Cached prefix tokens before this request; afterwards all its blocks are cached."""
        bs = self.cfg.block_size
        hashes = block_hashes(ids, bs, salt, self.cfg.hash_algo)
        matched = 0
        while matched < len(hashes) and hashes[matched] in self._cache:
            matched += 1
        events: list[BlockEvent] = []
        if matched < len(hashes):
            parent = hashes[matched - 1] if matched else None
            tokens = tuple(ids[matched * bs : len(hashes) * bs])
            events.append(BlockStored(tuple(hashes[matched:]), parent, tokens, bs))
        for h in reversed(hashes):  # deepest first: the LRU forgets tails before heads
            self._cache[h] = None
            self._cache.move_to_end(h)
        evicted = []
        while len(self._cache) > self.cfg.cache_blocks:
            evicted.append(self._cache.popitem(last=False)[0])
        if evicted:
            events.append(BlockRemoved(tuple(evicted)))
        self.publisher.publish_blocks(events)
        return matched * bs

    def _encode(self, path: str, body: dict[str, Any]) -> list[int]:
        if path.endswith("/chat/completions"):
            agp = body.get("add_generation_prompt", True) is not False
            return self.encoder.encode_chat(body["messages"], agp)
        prompt = body.get("prompt") if path.endswith("/completions") else (
            body.get("text") if "text" in body else body.get("input_ids"))
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.encoder.encode_prompt(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise ValueError("no prompt")

    # --- handlers ------------------------------------------------------------------------

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        ids = self.encoder.encode_prompt(body["prompt"])
        return web.Response(body=orjson.dumps({"count": len(ids), "tokens": ids}),
                            content_type="application/json",
                            headers={"X-Fake-Replica": self.cfg.name})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        if not self.healthy:  # an engine that died: what the server answers then
            err = {"error": {"message": "engine is not running", "type": "server_error",
                             "param": None, "code": None}}
            return web.Response(status=503, body=orjson.dumps(err),
                                content_type="application/json")
        try:
            body = orjson.loads(await request.read())
            ids = self._encode(request.path, body)
        except (orjson.JSONDecodeError, ValueError, KeyError, TypeError):
            err = {"error": {"message": "bad request", "type": "invalid_request_error",
                             "param": None, "code": None}}
            return web.Response(status=400, body=orjson.dumps(err),
                                content_type="application/json")
        auth = request.headers.get("Authorization")
        self.auth_seen.append(auth)
        token = auth.partition(" ")[2].strip() if auth else None
        salt = cache_salt_for_api_key(token or None) if self.cfg.salt_by_key else ""
        self.num_requests += 1
        async with self._prefill:
            cached = self._lookup_and_insert(ids, salt)
            await asyncio.sleep(self.cfg.base_latency_s
                                + self.cfg.prefill_s_per_token * (len(ids) - cached))
        self.prompt_tokens += len(ids)
        self.cached_tokens += cached
        sp = body.get("sampling_params") or {}
        n_out = int(body.get("max_tokens") or sp.get("max_new_tokens") or self.cfg.default_max_tokens)
        usage = {"prompt_tokens": len(ids), "completion_tokens": n_out,
                 "total_tokens": len(ids) + n_out, "prompt_tokens_details": {"cached_tokens": cached}}
        headers = {"X-Fake-Replica": self.cfg.name}
        if body.get("stream"):
            return await self._stream(request, n_out, usage, headers)
        await asyncio.sleep(self.cfg.decode_s_per_token * n_out)
        answer = {"id": f"cmpl-{self.num_requests}", "object": "text_completion",
                  "created": int(time.time()), "model": self.cfg.name,
                  "choices": [{"index": 0, "text": "x" * n_out, "finish_reason": "length"}],
                  "usage": usage}
        return web.Response(body=orjson.dumps(answer), content_type="application/json",
                            headers=headers)

    async def _stream(self, request: web.Request, n_out: int, usage: dict[str, Any],
                      headers: dict[str, str]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(n_out):
                if self.break_after_chunks is not None and i >= self.break_after_chunks:
                    assert request.transport is not None
                    request.transport.close()
                    return resp
                chunk = {"object": "text_completion", "choices": [{
                    "index": 0, "text": "x", "finish_reason": "length" if i == n_out - 1 else None}]}
                await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
                await asyncio.sleep(self.cfg.decode_s_per_token)
        except (asyncio.CancelledError, ConnectionResetError):
            self.num_aborted += 1  # what a real server turns into an engine abort
            raise
        if self.hold_streams is not None:
            await self.hold_streams.wait()
        final = {"object": "text_completion", "choices": [], "usage": usage}
        await resp.write(b"data: " + orjson.dumps(final) + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _models(self, request: web.Request) -> web.Response:
        data = {"object": "list", "data": [{"id": self.cfg.name, "object": "model"}]}
        return web.Response(body=orjson.dumps(data), content_type="application/json",
                            headers={"X-Fake-Replica": self.cfg.name})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        text = (f"radixserve:prefix_cache_queries_total {self.prompt_tokens}\n"
                f"radixserve:prefix_cache_hits_total {self.cached_tokens}\n")
        return web.Response(text=text)

    async def _flush(self, request: web.Request) -> web.Response:
        self._cache.clear()
        self.publisher.publish_blocks([AllBlocksCleared()])
        return web.Response(body=b'{"success": true}', content_type="application/json")


@dataclass
class FakeCluster:
    url: str  # the router's
    router_app: web.Application
    replicas: list[FakeReplica]


@contextlib.asynccontextmanager
async def fake_cluster(
    cfg: RouterConfig, replica_cfgs: Sequence[FakeReplicaConfig]
) -> AsyncIterator[FakeCluster]:
    """Fake replicas on free ports and a router in front of them (`cfg.workers` replaced)."""
    from router.app import create_app

    replicas = [FakeReplica(c) for c in replica_cfgs]
    runner = None
    try:
        urls = tuple([await r.start() for r in replicas])
        app = create_app(dataclasses.replace(cfg, workers=urls), encoder=ByteEncoder())
        runner, url = await start_app(app)
        yield FakeCluster(url, app, replicas)
    finally:
        if runner is not None:
            await runner.cleanup()
        for r in replicas:
            await r.stop()

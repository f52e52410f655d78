"""A fake Kubernetes API server for the pod list/watch protocol, written from the API docs
("API Concepts": efficient detection of changes, watch bookmarks, 410 Gone), on 127.0.0.1.

Serves only `GET /api/v1/namespaces/{ns}/pods`:
  - a list: `{"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": RV},
    "items": [...]}`, filtered by `labelSelector` (key=value terms, comma separated);
  - `?watch=true&resourceVersion=RV`: newline-delimited JSON events
    `{"type": "ADDED"|"MODIFIED"|"DELETED", "object": Pod}` for every change after RV, then
    live ones, until `timeoutSeconds`; an RV older than the compaction horizon, or `expire()`
    while watching, gives `{"type": "ERROR", "object": Status(code 410, reason "Expired")}`.
Pods are plain JSON dicts shaped like v1.Pod. Also a test helper: replicas on three
loopback addresses with one port, as pods behind one Service share theirs.
"""

from __future__ import annotations

import asyncio
import errno
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from radixserve.testing.fake_replica import FakeReplica, FakeReplicaConfig, start_app

LOOPBACKS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")


async def replicas_on_one_port(**cfg: Any) -> tuple[list[FakeReplica], int]:
    """A FakeReplica on each LOOPBACKS address, all on one free port (named by address)."""
    for _ in range(20):
        replicas = [FakeReplica(FakeReplicaConfig(name=h, **cfg)) for h in LOOPBACKS]
        url = await replicas[0].start(0, LOOPBACKS[0])
        port = int(url.rpartition(":")[2])
        try:
            for r, host in zip(replicas[1:], LOOPBACKS[1:], strict=True):
                await r.start(port, host)
            return replicas, port
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            for r in replicas:
                await r.stop()
    raise AssertionError("no port free on all three loopback addresses")


async def served_by(s: aiohttp.ClientSession, url: str, n: int) -> set[str]:
    """The replicas (X-Fake-Replica) that answered `n` distinct prompts through `url`."""
    names = set()
    for i in range(n):
        async with s.post(f"{url}/v1/completions", json={"prompt": f"q{i} " * 40}) as resp:
            assert resp.status == 200
            names.add(resp.headers["X-Fake-Replica"])
    return names


async def stream_completion(s: aiohttp.ClientSession, url: str, prompt: str) -> tuple[str, bytes]:
    async with s.post(f"{url}/v1/completions",
                      json={"prompt": prompt, "stream": True, "max_tokens": 5}) as resp:
        assert resp.status == 200
        return resp.headers["X-Fake-Replica"], await resp.read()


def make_pod(name: str, ip: str | None, labels: dict[str, str], ready: bool,
             namespace: str = "default") -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels),
                     "uid": f"uid-{name}", "resourceVersion": "0"},
        "spec": {"containers": [{"name": "radixserve", "image": "radixserve:test"}]},
        "status": {"phase": "Running", "podIP": ip, "conditions": [
            {"type": "Ready", "status": "True" if ready else "False"}]},
    }


def _matches(labels: dict[str, str], selector: str | None) -> bool:
    for term in (selector or "").split(","):
        if not term.strip():
            continue
        key, _, value = term.partition("=")
        if labels.get(key.strip()) != value.strip():
            return False
    return True


class FakeKubeAPI:
    def __init__(self, namespace: str = "default") -> None:
        self.namespace = namespace
        self.pods: dict[str, dict[str, Any]] = {}
        self.rv = 100
        self.horizon = 0  # watches from an RV below this get 410 Gone
        self.log: list[tuple[int, str, dict[str, Any]]] = []
        self.num_lists = 0
        self.num_watches = 0
        self.selectors: list[str | None] = []
        self._changed = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.url = ""

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self, port: int = 0) -> str:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._pods)
        self._runner, self.url = await start_app(app, port)
        self.port = int(self.url.rpartition(":")[2])
        return self.url

    async def stop(self) -> None:
        """Down: open watches are cut, new connections refused."""
        if self._runner is not None:
            server = self._runner.server
            for conn in server.connections if server is not None else ():
                if conn.transport is not None:
                    conn.transport.abort()
            await self._runner.cleanup()
            self._runner = None

    # --- changes (each one a new resourceVersion) -----------------------------------------

    async def _record(self, kind: str, pod: dict[str, Any], quiet: bool = False) -> None:
        self.rv += 1
        pod["metadata"]["resourceVersion"] = str(self.rv)
        if not quiet:
            self.log.append((self.rv, kind, orjson.loads(orjson.dumps(pod))))
        async with self._changed:
            self._changed.notify_all()

    async def add(self, name: str, ip: str, labels: dict[str, str], ready: bool) -> None:
        self.pods[name] = make_pod(name, ip, labels, ready, self.namespace)
        await self._record("ADDED", self.pods[name])

    async def set_ready(self, name: str, ready: bool = True) -> None:
        self.pods[name]["status"]["conditions"][0]["status"] = "True" if ready else "False"
        await self._record("MODIFIED", self.pods[name])

    async def terminate(self, name: str) -> None:
        """`kubectl delete pod`: deletionTimestamp set, the pod lives on while it stops."""
        self.pods[name]["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        self.pods[name]["metadata"]["deletionGracePeriodSeconds"] = 60
        await self._record("MODIFIED", self.pods[name])

    async def delete(self, name: str, quiet: bool = False) -> None:
        """Gone. `quiet`: its DELETED event is compacted away (only a re-list sees it)."""
        pod = self.pods.pop(name)
        await self._record("DELETED", pod, quiet)

    async def expire(self) -> None:
        """Compaction: every resourceVersion so far is too old to watch from."""
        self.horizon = self.rv + 1
        async with self._changed:
            self._changed.notify_all()

    # --- the API ---------------------------------------------------------------------------

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        if request.match_info["ns"] != self.namespace:
            return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": str(self.rv)},
                                      "items": []})
        selector = request.query.get("labelSelector")
        self.selectors.append(selector)
        if request.query.get("watch") in ("true", "1", "True"):
            return await self._watch(request, selector)
        self.num_lists += 1
        items = [p for p in self.pods.values() if _matches(p["metadata"]["labels"], selector)]
        body = {"kind": "PodList", "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self.rv)}, "items": items}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    @staticmethod
    def _gone(rv: int) -> bytes:
        status = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                  "message": f"too old resource version: {rv}", "reason": "Expired",
                  "code": 410}
        return orjson.dumps({"type": "ERROR", "object": status}) + b"\n"

    async def _watch(self, request: web.Request, selector: str | None) -> web.StreamResponse:
        self.num_watches += 1
        since = int(request.query.get("resourceVersion") or self.rv)
        timeout = float(request.query.get("timeoutSeconds") or 300)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if since < self.horizon:
                await resp.write(self._gone(since))
                break
            current = self.rv
            for rv, kind, pod in self.log:
                if since < rv <= current and _matches(pod["metadata"]["labels"], selector):
                    await resp.write(orjson.dumps({"type": kind, "object": pod}) + b"\n")
            since = current
            async with self._changed:
                try:
                    async with asyncio.timeout(max(0.0, deadline - loop.time())):
                        await self._changed.wait_for(
                            lambda: self.rv > since or since < self.horizon)  # noqa: B023
                except TimeoutError:
                    break
        await resp.write_eof()
        return resp

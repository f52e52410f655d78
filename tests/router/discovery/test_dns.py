"""DNS discovery: a name's records go 1 -> 3 -> 2 addresses; the router follows within two
resolution intervals and loses no in-flight request. Replicas listen on 127.0.0.1-3 (all
loopback on Linux) on one port, as pods behind a headless Service share theirs."""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from radixserve.testing.fake_replica import ByteEncoder, FakeReplica, FakeReplicaConfig, start_app
from router.__main__ import build_parser
from router.app import ROUTER_KEY, create_app
from router.config import ConfigError, RouterConfig
from router.discovery import DISCOVERY_KEY, DiscoveryConfig, DiscoveryMode, attach_discovery
from router.discovery.discovery_config import discovery_from_args
from router.discovery.dns import DnsDiscovery, worker_url
from tests.fake_kube_api import LOOPBACKS, replicas_on_one_port, served_by, stream_completion
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

HOSTS = LOOPBACKS
CFG = RouterConfig(health_interval_s=0.05, health_timeout_s=1.0, retry_backoff_s=0.01)


async def test_dns_records_1_3_2_live_set_and_no_lost_request() -> None:
    replicas, port = await replicas_on_one_port(decode_s_per_token=0.001)
    records: list[str] = [HOSTS[0]]
    asked: list[tuple[str, int]] = []

    async def resolver(host: str, p: int) -> list[str]:
        asked.append((host, p))
        return list(records)

    dcfg = DiscoveryConfig(DiscoveryMode.DNS, target=f"replicas.test:{port}", interval_s=0.1)
    app = create_app(CFG, encoder=ByteEncoder())
    source = attach_discovery(app, app[ROUTER_KEY], dcfg, resolver=resolver)
    assert isinstance(source, DnsDiscovery) and app[DISCOVERY_KEY] is source
    pool = app[ROUTER_KEY].pool
    runner, url = await start_app(app)

    async def live_after_two_rounds(live: tuple[str, ...]) -> None:
        start = source.num_rounds
        await wait_until(lambda: source.num_rounds >= start + 2, what="two resolutions")
        assert {w.url for w in pool.all()} == {worker_url(h, port) for h in live}

    try:
        async with aiohttp.ClientSession() as s:
            await live_after_two_rounds(HOSTS[:1])
            assert asked[0] == ("replicas.test", port)
            assert await served_by(s, url, 4) == {HOSTS[0]}

            records[:] = HOSTS
            await live_after_two_rounds(HOSTS)
            assert await served_by(s, url, 9) == set(HOSTS)  # misses spread over all 3

            # Streams in flight on every replica, held before their end; then .2 leaves.
            gate = asyncio.Event()
            for r in replicas:
                r.hold_streams = gate
            streams = [asyncio.create_task(stream_completion(s, url, f"s{i} " * 30)) for i in range(6)]
            await wait_until(lambda: sum(r.num_requests for r in replicas) >= 9 + 4 + 6,
                             what="six streams in flight")
            records[:] = [HOSTS[0], HOSTS[2]]
            await live_after_two_rounds((HOSTS[0], HOSTS[2]))
            assert not any(t.done() for t in streams)  # held: still in flight
            before = replicas[1].num_requests
            assert await served_by(s, url, 6) == {HOSTS[0], HOSTS[2]}
            assert replicas[1].num_requests == before  # the gone one gets nothing new
            gate.set()
            results = await asyncio.gather(*streams)
            assert {name for name, _ in results} == set(HOSTS)  # .2 had some in flight
            for _, body in results:
                assert body.rstrip().endswith(b"data: [DONE]") and body.count(b'"x"') == 5
            assert sum(r.num_aborted for r in replicas) == 0
    finally:
        await runner.cleanup()
        for r in replicas:
            await r.stop()


async def test_dns_failure_keeps_the_last_set() -> None:
    app = create_app(CFG)
    answers: list[list[str] | OSError] = [["10.0.0.1", "10.0.0.2"], OSError("SERVFAIL"),
                                          ["10.0.0.2"]]

    async def resolver(host: str, port: int) -> list[str]:
        answer = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(answer, OSError):
            raise answer
        return answer

    source = attach_discovery(app, app[ROUTER_KEY],
                              DiscoveryConfig(DiscoveryMode.DNS, target="svc:8000"),
                              resolver=resolver)
    assert isinstance(source, DnsDiscovery)
    pool = app[ROUTER_KEY].pool
    await source.resolve_once()
    assert {w.url for w in pool.all()} == {"http://10.0.0.1:8000", "http://10.0.0.2:8000"}
    await source.resolve_once()  # the resolver fails: nothing removed
    assert source.num_errors == 1 and len(pool.all()) == 2
    await source.resolve_once()
    assert {w.url for w in pool.all()} == {"http://10.0.0.2:8000"}


def test_static_workers_are_kept_and_ipv6_is_bracketed() -> None:
    assert worker_url("fd00::1", 80) == "http://[fd00::1]:80"
    with pytest.raises(ValueError):
        worker_url("not-an-ip", 80)

    async def run() -> None:
        cfg = RouterConfig(workers=("http://10.0.0.9:8000",))
        app = create_app(cfg)
        source = attach_discovery(app, app[ROUTER_KEY],
                                  DiscoveryConfig(DiscoveryMode.DNS, target="svc:8000"),
                                  resolver=lambda h, p: _answer([]))
        assert isinstance(source, DnsDiscovery)
        await source.resolve_once()
        assert [w.url for w in app[ROUTER_KEY].pool.all()] == ["http://10.0.0.9:8000"]

    asyncio.run(run())


async def _answer(addresses: list[str]) -> list[str]:
    return addresses


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_discovery_flags() -> None:
    assert discovery_from_args(_args()) is None
    dns = discovery_from_args(_args("--service-discovery", "dns", "--discovery-target",
                                    "radixserve-headless:30000", "--discovery-interval", "2"))
    assert dns == DiscoveryConfig(DiscoveryMode.DNS, target="radixserve-headless:30000",
                                  interval_s=2.0)
    assert (dns.host, dns.target_port) == ("radixserve-headless", 30000)
    # The form, as written: --port stays the router's own (both default to 30000).
    args = _args("--service-discovery", "k8s", "--selector", "app=radixserve", "--namespace",
                 "llm", "--port", "30000", "--group-weight", "canary=0.1")
    k8s = discovery_from_args(args)
    assert k8s is not None and k8s.selector == "app=radixserve" and k8s.namespace == "llm"
    assert k8s.port == 30000 and args.port == 30000 and k8s.group_weights == (("canary", 0.1),)
    for bad in (["--service-discovery", "dns"],
                ["--service-discovery", "dns", "--discovery-target", "nohostport"],
                ["--service-discovery", "dns", "--discovery-target", "h:0"],
                ["--service-discovery", "k8s"],
                ["--service-discovery", "k8s", "--selector", "app=a b"],
                ["--service-discovery", "k8s", "--selector", "a=b", "--namespace", "Bad_NS"],
                ["--service-discovery", "k8s", "--selector", "a=b", "--group-weight", "c=2"],
                ["--service-discovery", "k8s", "--selector", "a=b", "--group-weight", "stable=.1"],
                ["--service-discovery", "dns", "--discovery-target", "h:1",
                 "--discovery-interval", "0"],
                ["--selector", "app=radixserve"]):
        with pytest.raises(ConfigError):
            discovery_from_args(_args(*bad))
    ok = discovery_from_args(_args("--service-discovery", "k8s", "--selector",
                                   "app=radixserve,tier in (a, b),!legacy"))
    assert ok is not None


async def test_router_process_discovers_through_the_system_resolver(tmp_path: Path) -> None:
    """`radixserve-router --service-discovery dns --discovery-target localhost:PORT`, as a
    process: the system resolver's answer becomes the worker that serves the request."""
    replica = FakeReplica(FakeReplicaConfig(name="via-dns"))
    replica_url = await replica.start()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = (tmp_path / "router.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "router", "--port", str(port), "--service-discovery", "dns",
         "--discovery-target", f"localhost:{replica_url.rpartition(':')[2]}",
         "--discovery-interval", "0.2", "--health-interval", "0.1"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        async with aiohttp.ClientSession() as s:

            async def healthy() -> bool:
                try:
                    async with s.get(f"http://127.0.0.1:{port}/health") as resp:
                        return resp.status == 200
                except aiohttp.ClientError:
                    assert proc.poll() is None, (tmp_path / "router.log").read_text()
                    return False

            await wait_until(healthy, timeout=30, what="router up with a discovered worker")
            assert await served_by(s, f"http://127.0.0.1:{port}", 2) == {"via-dns"}
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
        await replica.stop()
    assert "discovering workers by dns" in (tmp_path / "router.log").read_text()

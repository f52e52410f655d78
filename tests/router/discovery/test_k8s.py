"""k8s discovery against a fake API server (tests/fake_kube_api.py) through the official
kubernetes client: Ready pods added, terminating pods drained (in-flight requests finish),
deleted pods removed, 410 Gone followed by a re-list, the API down (last known workers kept,
backoff doubling) and back; the precise index follows, canary groups stay."""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import pytest
from kubernetes.client import Configuration

from radixserve.testing.fake_replica import ByteEncoder, start_app
from router.app import ROUTER_KEY, create_app
from router.config import RouterConfig
from router.discovery import DiscoveryConfig, DiscoveryMode, attach_discovery
from router.discovery.k8s import RECENT_BACKOFFS, K8sDiscovery, pod_info
from tests.fake_kube_api import (
    LOOPBACKS,
    FakeKubeAPI,
    make_pod,
    replicas_on_one_port,
    served_by,
    stream_completion,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(90)

NS = "llm"
APP = {"app": "radixserve"}
CFG = RouterConfig(health_interval_s=0.05, health_timeout_s=1.0, retry_backoff_s=0.01,
                   kv_events=True, kv_block_size=16)


def test_pod_info_reads_ready_terminating_and_group() -> None:
    from kubernetes.client import ApiClient

    pod = make_pod("p", "10.1.2.3", {"app": "x", "radixserve.io/group": "canary"}, True)
    pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    v1pod = ApiClient().deserialize(json.dumps(pod), "V1Pod", "application/json")
    info = pod_info(v1pod, "radixserve.io/group")
    assert info == ("p", "10.1.2.3", True, True, "canary")
    v1pod.status.conditions = None
    assert not pod_info(v1pod, "radixserve.io/group").ready


async def test_k8s_discovery_lifecycle() -> None:
    replicas, port = await replicas_on_one_port(decode_s_per_token=0.001)
    urls = [f"http://{h}:{port}" for h in LOOPBACKS]
    api = FakeKubeAPI(NS)
    await api.start()
    await api.add("rs-0", LOOPBACKS[0], APP, ready=True)
    await api.add("rs-1", LOOPBACKS[1], APP, ready=False)  # still loading
    await api.add("other-0", LOOPBACKS[2], {"app": "other"}, ready=True)  # not selected
    dcfg = DiscoveryConfig(DiscoveryMode.K8S, selector="app=radixserve", namespace=NS,
                           port=port, group_weights=(("canary", 0.5),), watch_timeout_s=2,
                           backoff_initial_s=0.05, backoff_max_s=0.4)
    app = create_app(CFG, encoder=ByteEncoder())
    router = app[ROUTER_KEY]
    source = attach_discovery(app, router, dcfg,
                              k8s_configuration=Configuration(host=api.url))
    assert isinstance(source, K8sDiscovery)
    runner, url = await start_app(app)

    def pool() -> set[str]:
        return {w.url for w in router.pool.all()}

    try:
        async with aiohttp.ClientSession() as s:
            # Ready pods only, selected pods only; the precise index subscribes.
            await wait_until(lambda: pool() == {urls[0]}, what="rs-0 added")
            assert set(api.selectors) == {"app=radixserve"}
            assert router.precise is not None and router.precise.state(urls[0]) is not None
            await wait_until(lambda: router.precise is not None
                             and router.precise.is_live(urls[0]), what="kv events followed")
            await api.set_ready("rs-1")
            await wait_until(lambda: pool() == set(urls[:2]), what="rs-1 ready")
            assert await served_by(s, url, 6) == set(LOOPBACKS[:2])

            # A pod of a canary group: its share comes from --group-weight.
            await api.add("rs-2", LOOPBACKS[2], {**APP, "radixserve.io/group": "canary"}, True)
            await wait_until(lambda: pool() == set(urls), what="rs-2 added")
            assert router.split.group_of(urls[2]) == "canary"
            assert router.split.shares()["canary"] == 0.5

            # Terminating: drained (no new requests), in-flight ones finish.
            gate = asyncio.Event()
            for r in replicas:
                r.hold_streams = gate
            before = sum(r.num_requests for r in replicas)
            streams = [asyncio.create_task(stream_completion(s, url, f"t{i} " * 30))
                       for i in range(6)]
            await wait_until(lambda: replicas[1].num_requests > 0
                             and sum(r.num_requests for r in replicas) == before + 6,
                             what="streams in flight")
            await api.terminate("rs-1")
            w1 = router.pool.get(urls[1])
            assert w1 is not None
            await wait_until(lambda: w1.draining, what="rs-1 draining")
            assert pool() == set(urls)  # still registered while it stops
            n1 = replicas[1].num_requests
            assert LOOPBACKS[1] not in await served_by(s, url, 6)
            assert replicas[1].num_requests == n1
            assert not any(t.done() for t in streams)
            gate.set()
            for name, body in await asyncio.gather(*streams):
                assert body.rstrip().endswith(b"data: [DONE]"), name
            # Deleted: removed; the precise index unsubscribes, the approximate one forgets.
            await api.delete("rs-1")
            await wait_until(lambda: pool() == {urls[0], urls[2]}, what="rs-1 removed")
            assert router.precise.state(urls[1]) is None
            assert router.index.num_entries(urls[1]) == 0
            assert urls[1] not in router._followers

            # 410 Gone: rs-2's deletion was compacted away; only the re-list shows it.
            lists = source.num_lists
            await api.delete("rs-2", quiet=True)
            await api.expire()
            await wait_until(lambda: source.num_expired >= 1 and source.num_lists > lists,
                             what="re-list after 410")
            await wait_until(lambda: pool() == {urls[0]}, what="rs-2 gone after re-list")
            assert router.split.shares()["canary"] == 0.5  # the group and its share stay

            # The API down: last known workers kept, retries back off (doubling, capped).
            await api.stop()
            await wait_until(lambda: len(source.backoffs) >= 5, what="failed retries")
            assert list(source.backoffs)[:5] == [0.05, 0.1, 0.2, 0.4, 0.4]
            assert pool() == {urls[0]} and source.num_errors >= 5
            assert await served_by(s, url, 2) == {LOOPBACKS[0]}

            # Back, with changes made meanwhile: listed again and applied.
            await api.start(api.port)
            await api.add("rs-2b", LOOPBACKS[2], {**APP, "radixserve.io/group": "canary"},
                          True)
            await wait_until(lambda: pool() == {urls[0], urls[2]}, what="back after outage")
            assert router.split.group_of(urls[2]) == "canary"
    finally:
        await runner.cleanup()
        # Joined off the loop: the fake API serves on this loop, and a watch thread waiting
        # for its answer (a list, a watch's headers) needs it running to see the stop.
        assert await asyncio.to_thread(source.join, 10), "the watch thread did not stop"
        await api.stop()
        for r in replicas:
            await r.stop()


async def test_a_long_outage_keeps_only_the_latest_backoffs() -> None:
    """An API server that never answers: the retries go on, their record stays bounded."""
    with socket.socket() as sock:  # a port nobody listens on: every call is refused
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dcfg = DiscoveryConfig(DiscoveryMode.K8S, selector="app=radixserve", namespace=NS,
                           port=port, backoff_initial_s=0.001, backoff_max_s=0.002)
    app = create_app(CFG, encoder=ByteEncoder())
    source = attach_discovery(app, app[ROUTER_KEY], dcfg,
                              k8s_configuration=Configuration(host=f"http://127.0.0.1:{port}"))
    assert isinstance(source, K8sDiscovery)
    task = asyncio.create_task(source.run())
    try:
        await wait_until(lambda: source.num_errors > 3 * RECENT_BACKOFFS, what="a long outage")
        assert len(source.backoffs) == RECENT_BACKOFFS
        assert list(source.backoffs) == [0.002] * RECENT_BACKOFFS  # doubled, then capped
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert await asyncio.to_thread(source.join, 10), "the watch thread did not stop"

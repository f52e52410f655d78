"""Membership: the rule from a discovered set to the router's workers, without a network."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import generate_latest

from router.config import RouterConfig
from router.core import Router
from router.discovery.k8s import PodInfo, desired_targets
from router.discovery.membership import Membership, Target
from router.metrics import make_registry

A, B, C = "http://10.0.0.1:30000", "http://10.0.0.2:30000", "http://10.0.0.3:30000"


def _urls(router: Router) -> set[str]:
    return {w.url for w in router.pool.all()}


async def test_ready_drain_back_and_removal() -> None:
    router = Router(RouterConfig())
    m = Membership(router)
    await m.apply({A: Target(A, routable=False)})  # loading: never added
    assert _urls(router) == set()
    await m.apply({A: Target(A), B: Target(B)})
    assert _urls(router) == {A, B} and m.managed == {A, B}
    await m.apply({A: Target(A, routable=False), B: Target(B)})  # A not Ready any more
    a = router.pool.get(A)
    assert a is not None and a.draining
    assert [w.url for w in router.pool.routable()] == [B]
    text = generate_latest(make_registry(router)).decode()
    assert f'radixserve_router:worker_draining{{worker="{A}"}} 1.0' in text
    assert f'radixserve_router:worker_draining{{worker="{B}"}} 0.0' in text
    await m.apply({A: Target(A), B: Target(B)})  # Ready again
    assert not a.draining and len(router.pool.routable()) == 2
    await m.apply({B: Target(B)})
    assert _urls(router) == {B} and (m.num_added, m.num_removed) == (2, 1)


async def test_static_and_admin_workers_are_not_touched() -> None:
    router = Router(RouterConfig(workers=(A,)))
    m = Membership(router)
    router.add_worker(C)  # POST /workers
    await m.apply({A: Target(A, routable=False), B: Target(B), C: Target(C, routable=False)})
    assert _urls(router) == {A, B, C}
    assert not any(w.draining for w in router.pool.all())
    await m.apply({})
    assert _urls(router) == {A, C}


async def test_groups_need_a_weight_and_stay(caplog: pytest.LogCaptureFixture) -> None:
    router = Router(RouterConfig())
    m = Membership(router, (("canary", 0.2),))
    with caplog.at_level(logging.WARNING):
        await m.apply({A: Target(A, group="canary"), B: Target(B, group="blue"),
                       C: Target(C, group="9-not-a-name")})
    assert router.split.group_of(A) == "canary" and router.split.shares()["canary"] == 0.2
    assert router.split.group_of(B) == "stable" and "--group-weight blue=SHARE" in caplog.text
    assert router.split.group_of(C) == "stable"
    await m.apply({})
    assert router.split.shares()["canary"] == 0.2  # the group outlives its pods
    await m.apply({B: Target(B, group="canary")})
    assert router.split.group_of(B) == "canary"
    await m.apply({B: Target(B)})  # label removed: back to stable
    assert router.split.group_of(B) == "stable"


def test_pods_to_targets() -> None:
    pods = [PodInfo("a", "10.0.0.1", True, False, None),
            PodInfo("b", "10.0.0.2", True, True, "canary"),  # terminating
            PodInfo("c", None, False, False, None),  # not scheduled yet
            PodInfo("old", "10.0.0.3", True, True, None),  # its IP now reused by "new"
            PodInfo("new", "10.0.0.3", True, False, None)]
    assert desired_targets(pods, 30000) == {
        A: Target(A, True, None), B: Target(B, False, "canary"), C: Target(C, True, None)}

"""Two routers in front of the same replicas (bench/router_agreement.py measures it): in
precise mode with --router-replicas 2 they make the same choice for the same request."""

from __future__ import annotations

import random

import pytest
import yaml

from bench.common.router_trace import TraceConfig, pressure_trace
from bench.router_agreement import measure
from router.__main__ import build_parser, config_from_args
from tests.repo import REPO_ROOT

DEPLOY = REPO_ROOT / "router" / "deploy"

pytestmark = pytest.mark.timeout(120)

TRACE = TraceConfig(tenants=16, requests=160, prefix_len=256, suffix_len=32)


async def test_two_precise_routers_agree_on_a_trace_under_eviction() -> None:
    prompts = pressure_trace(TRACE, random.Random(1))
    # 4 replicas x 48 blocks of 16 hold ~10 of the 16 prefixes: replicas evict.
    share = await measure("precise", prompts, replicas=4, cache_blocks=48, concurrency=1)
    assert share >= 0.99, share


async def test_the_manifests_routers_agree_with_16_requests_in_flight() -> None:
    """The flags router/deploy/router.yaml runs its routers with (precise mode, ties by hash,
    a load dead band): two of them agree on >= 99% of choices with 16 requests in flight."""
    container = next(d for d in yaml.safe_load_all((DEPLOY / "router.yaml").read_text())
                     if d and d["kind"] == "Deployment")["spec"]["template"]["spec"][
                         "containers"][0]
    base = config_from_args(build_parser().parse_args(container["args"]))
    assert base.kv_events and base.router_replicas == 2
    prompts = pressure_trace(TRACE, random.Random(1))
    share = await measure("precise", prompts, replicas=4, cache_blocks=48, concurrency=16,
                          base=base)
    assert share >= 0.99, share
    without_band = await measure("precise", prompts, replicas=4, cache_blocks=48,
                                 concurrency=16)
    assert without_band < share  # the dead band is what makes them agree under load


async def test_per_process_tie_breaks_make_routers_disagree() -> None:
    # The same routers with --router-replicas 1 break ties by their own rotation.
    prompts = pressure_trace(TRACE, random.Random(1))
    share = await measure("precise", prompts, replicas=4, cache_blocks=48, concurrency=1,
                          router_replicas=1)
    assert share < 0.95, share

"""Service discovery: workers that come and go while the router runs (DNS or Kubernetes).

Owns: `attach_discovery`, which starts the chosen source with the app and stops it with the
app. Does not know: routing (membership.py calls the Router's add/remove methods), HTTP.
The kubernetes client is imported only when k8s discovery is chosen.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, Protocol

from aiohttp import web

from router.core import Router
from router.discovery.discovery_config import DiscoveryConfig, DiscoveryMode
from router.discovery.dns import DnsDiscovery, Resolver, system_resolver
from router.discovery.membership import Membership, Target

__all__ = ["DISCOVERY_KEY", "DiscoveryConfig", "DiscoveryMode", "DiscoverySource",
           "Membership", "Target", "attach_discovery"]


class DiscoverySource(Protocol):
    membership: Membership

    async def run(self) -> None:
        """Follow the source and apply its changes until cancelled."""
        ...


DISCOVERY_KEY = web.AppKey("discovery", DiscoverySource)


def attach_discovery(app: web.Application, router: Router, cfg: DiscoveryConfig, *,
                     resolver: Resolver = system_resolver, k8s_configuration: Any = None
                     ) -> DiscoverySource:
    """Run discovery for `router` while `app` runs (after the router's own lifecycle has
    started: new workers' KV followers need its session). Call after create_app."""
    membership = Membership(router, cfg.group_weights)
    source: DiscoverySource
    if cfg.mode is DiscoveryMode.DNS:
        source = DnsDiscovery(cfg, membership, resolver)
    else:
        from router.discovery.k8s import K8sDiscovery

        source = K8sDiscovery(cfg, membership, k8s_configuration)
    app[DISCOVERY_KEY] = source

    async def lifecycle(_: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(source.run(), name=f"{cfg.mode.value} discovery")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app.cleanup_ctx.append(lifecycle)
    return source

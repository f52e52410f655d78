"""DNS discovery: re-resolve `HOST:PORT` every interval; each address is one worker.

Owns: the resolution loop and the address -> worker URL rule (`http://IP:PORT`). Does not
know: what a worker is to the router (membership.py applies the set). The resolver is
injectable (tests answer from a table; the default asks the system's resolver, which for a
Kubernetes headless Service returns one A/AAAA record per Ready pod).

A failed resolution (NXDOMAIN, resolver down, timeout) keeps the last known set: a DNS
hiccup must not empty the fleet; health checks still take dead workers out.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence

from router.discovery.discovery_config import DiscoveryConfig
from router.discovery.membership import Membership, Target

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]


async def system_resolver(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (A and AAAA), deduplicated, sorted."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def worker_url(address: str, port: int) -> str:
    """`http://IP:PORT` (IPv6 in brackets); raises ValueError for a non-IP address."""
    ip = ipaddress.ip_address(address)
    host = f"[{ip}]" if ip.version == 6 else str(ip)
    return f"http://{host}:{port}"


class DnsDiscovery:
    def __init__(self, cfg: DiscoveryConfig, membership: Membership,
                 resolver: Resolver = system_resolver) -> None:
        self.cfg = cfg
        self.membership = membership
        self.resolver = resolver
        self.num_rounds = 0
        self.num_errors = 0
        self.addresses: tuple[str, ...] = ()  # the last successful answer

    async def resolve_once(self) -> None:
        host, port = self.cfg.host, self.cfg.target_port
        try:
            async with asyncio.timeout(max(self.cfg.interval_s, 1.0)):
                answer = await self.resolver(host, port)
            urls = {worker_url(a, port): Target(worker_url(a, port)) for a in answer}
        except (OSError, TimeoutError, ValueError) as e:
            self.num_errors += 1
            log.warning("resolving %s failed (%r): keeping the last %d worker(s)", host, e,
                        len(self.addresses))
            return
        if tuple(sorted(answer)) != self.addresses:
            log.info("%s resolves to %s", host, ", ".join(sorted(answer)) or "nothing")
        self.addresses = tuple(sorted(answer))
        await self.membership.apply(urls)

    async def run(self) -> None:
        """Resolve now and every `interval_s` until cancelled."""
        while True:
            await self.resolve_once()
            self.num_rounds += 1
            await asyncio.sleep(self.cfg.interval_s)

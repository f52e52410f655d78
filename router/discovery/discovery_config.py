"""Service-discovery settings: one frozen dataclass, the flags that build it, and its checks.

Owns: `--service-discovery {dns,k8s}` and its companions (`--discovery-target`,
`--discovery-interval`, `--selector`, `--namespace`, `--discovery-port`, `--group-label`,
`--group-weight`). Does not know: the router's other settings (router/config.py), how
workers are found (dns.py, k8s.py) or applied (membership.py).

`--port` stays the router's own listening port; the replicas' port under k8s discovery is
`--discovery-port` (default 30000, the replicas' default), so the issue's
`--service-discovery k8s --selector app=radixserve --port 30000` runs as written.
"""

from __future__ import annotations

import argparse
import enum
import math
import re
from dataclasses import dataclass

from router.config import STABLE_GROUP, ConfigError, check_group_name, check_share

DEFAULT_REPLICA_PORT = 30000
DEFAULT_GROUP_LABEL = "radixserve.io/group"
# A label selector as `kubectl get -l` takes it: key=value / key!=value / key pairs, commas.
_SELECTOR_TERM = re.compile(r"!?[A-Za-z0-9./_-]+(\s*(==?|!=)\s*[A-Za-z0-9._-]*)?"
                            r"|[A-Za-z0-9./_-]+\s+(in|notin)\s+\([A-Za-z0-9._,\s-]*\)")
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class DiscoveryMode(str, enum.Enum):
    DNS = "dns"
    K8S = "k8s"


@dataclass(frozen=True)
class DiscoveryConfig:
    mode: DiscoveryMode
    # dns: `HOST:PORT`, re-resolved every `interval_s` (a headless Service, or any name).
    target: str | None = None
    interval_s: float = 5.0
    # k8s: pods matching `selector` in `namespace` (None: the router's own namespace).
    selector: str | None = None
    namespace: str | None = None
    port: int = DEFAULT_REPLICA_PORT
    # A pod label naming its canary group (router/fleet/canary.py); absent: the stable group.
    group_label: str = DEFAULT_GROUP_LABEL
    # (group, share of sessions) for groups that discovered pods may name.
    group_weights: tuple[tuple[str, float], ...] = ()
    # k8s watch: the API server closes each watch after this long; we re-watch from the
    # last resourceVersion (a 410 Gone there means: list again).
    watch_timeout_s: int = 60
    backoff_initial_s: float = 0.5  # API errors: wait this, doubling up to backoff_max_s
    backoff_max_s: float = 30.0

    @property
    def host(self) -> str:
        assert self.target is not None
        return self.target.rpartition(":")[0].strip("[]")

    @property
    def target_port(self) -> int:
        assert self.target is not None
        return int(self.target.rpartition(":")[2])

    def __post_init__(self) -> None:
        if not isinstance(self.mode, DiscoveryMode):
            raise ConfigError(f"--service-discovery must be dns or k8s, got {self.mode!r}")
        if self.mode is DiscoveryMode.DNS:
            self._check_target()
        elif not self.selector or not all(
                _SELECTOR_TERM.fullmatch(t.strip()) for t in _split_selector(self.selector)):
            raise ConfigError("--service-discovery k8s needs --selector, a label selector "
                              f"such as app=radixserve, got {self.selector!r}")
        if self.namespace is not None and not _NAMESPACE.fullmatch(self.namespace):
            raise ConfigError(f"--namespace must be a Kubernetes namespace name, got "
                              f"{self.namespace!r}")
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"--discovery-port must be in [1, 65535], got {self.port}")
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise ConfigError(f"--discovery-interval must be > 0, got {self.interval_s}")
        if self.watch_timeout_s < 1 or not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ConfigError("watch_timeout_s >= 1 and 0 < backoff_initial_s <= backoff_max_s")
        names = [g for g, _ in self.group_weights]
        if len(set(names)) != len(names):
            raise ConfigError(f"--group-weight: a group given twice in {names}")
        for group, share in self.group_weights:
            check_group_name(group, "--group-weight")
            check_share(share, "--group-weight")
            if group == STABLE_GROUP:
                raise ConfigError(f"--group-weight: the {STABLE_GROUP!r} group takes the "
                                  "share the other groups leave")
        if sum(s for _, s in self.group_weights) > 1.0 + 1e-9:
            raise ConfigError(f"--group-weight: shares add up to more than 1: "
                              f"{dict(self.group_weights)}")

    def _check_target(self) -> None:
        host, colon, port = (self.target or "").rpartition(":")
        if not colon or not host.strip("[]") or not port.isdigit() \
                or not 1 <= int(port) <= 65535:
            raise ConfigError("--service-discovery dns needs --discovery-target HOST:PORT, "
                              f"got {self.target!r}")


def _split_selector(selector: str) -> list[str]:
    """Split on the commas outside `in (...)` sets."""
    terms, depth, start = [], 0, 0
    for i, ch in enumerate(selector):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            terms.append(selector[start:i])
            start = i + 1
    terms.append(selector[start:])
    return terms


def add_discovery_args(p: argparse.ArgumentParser) -> None:
    d = DiscoveryConfig(DiscoveryMode.DNS, target="x:1")
    g = p.add_argument_group("service discovery (workers that come and go)")
    g.add_argument("--service-discovery", choices=[m.value for m in DiscoveryMode],
                   default=None, help="find workers by re-resolving a DNS name (dns) or by "
                   "watching Kubernetes pods (k8s); --worker URLs stay as given")
    g.add_argument("--discovery-target", default=None, metavar="HOST:PORT",
                   help="dns: the name to resolve (e.g. a headless Service) and the port")
    g.add_argument("--discovery-interval", type=float, default=d.interval_s, metavar="S",
                   help="dns: seconds between resolutions")
    g.add_argument("--selector", default=None, metavar="LABELS",
                   help="k8s: label selector of the replica pods, e.g. app=radixserve")
    g.add_argument("--namespace", default=None,
                   help="k8s: the pods' namespace (default: the router's own)")
    g.add_argument("--discovery-port", type=int, default=d.port, metavar="PORT",
                   help="k8s: the replicas' port (the router's own is --port)")
    g.add_argument("--group-label", default=d.group_label, metavar="KEY",
                   help="k8s: pod label naming the pod's canary group")
    g.add_argument("--group-weight", action="append", default=None, metavar="GROUP=SHARE",
                   help="share of sessions in [0, 1] of a group discovered pods may name "
                        "(repeatable)")


def discovery_from_args(args: argparse.Namespace) -> DiscoveryConfig | None:
    """None without --service-discovery; raises ConfigError for a bad setting."""
    if args.service_discovery is None:
        for flag in ("discovery_target", "selector", "namespace", "group_weight"):
            if getattr(args, flag):
                raise ConfigError(f"--{flag.replace('_', '-')} needs --service-discovery")
        return None
    weights = []
    for spec in args.group_weight or ():
        group, eq, share = spec.partition("=")
        try:
            weights.append((group, float(share) if eq else math.nan))
        except ValueError:
            weights.append((group, math.nan))
    return DiscoveryConfig(
        DiscoveryMode(args.service_discovery), target=args.discovery_target,
        interval_s=args.discovery_interval, selector=args.selector, namespace=args.namespace,
        port=args.discovery_port, group_label=args.group_label, group_weights=tuple(weights))

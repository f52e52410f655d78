"""Applying what discovery found to the router: add, drain, regroup and remove workers.

Owns: the set of workers that discovery added (never the `--worker` ones, which stay as
given), and the rule from a desired state to Router calls. Does not know: where the desired
state comes from (dns.py re-resolves a name, k8s.py watches pods).

Level-triggered: `apply(desired)` takes the whole desired set each time, so a missed or
repeated change converges at the next call. For each discovered URL:
  - routable and unknown: `Router.add_worker` (the precise index subscribes to its
    /kv_events), put in its canary group;
  - known, not routable (pod terminating or not Ready): draining, no new requests; the
    requests already sent to it finish (they hold the Worker);
  - known and gone from the desired set: `Router.remove_worker` (the approximate index
    forgets it, the precise index unsubscribes); its group and the group's share stay.
A URL never routable is never added (a pod still loading gets no requests).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import NamedTuple

from router.config import STABLE_GROUP
from router.core import Router
from router.fleet.canary import SplitUpdateError

log = logging.getLogger(__name__)


class Target(NamedTuple):
    """One discovered replica as discovery sees it now."""

    url: str
    routable: bool = True  # False: terminating or not Ready (drain if known)
    group: str | None = None  # canary group (a pod label); None: stable


class Membership:
    def __init__(self, router: Router, group_weights: tuple[tuple[str, float], ...] = ()
                 ) -> None:
        self.router = router
        self.group_weights = dict(group_weights)
        self._static = frozenset(w.url for w in router.pool.all())
        self._managed: set[str] = set()
        self._warned_groups: set[str] = set()
        self.num_added = 0
        self.num_removed = 0

    @property
    def managed(self) -> frozenset[str]:
        """The workers discovery added and has not removed."""
        return frozenset(self._managed)

    async def apply(self, desired: Mapping[str, Target]) -> None:
        for url in sorted(self._managed - desired.keys()):
            await self._remove(url)
        for url, target in desired.items():
            if url in self._static:
                continue  # a --worker: configured, not discovered
            worker = self.router.pool.get(url)
            if worker is None:
                if not target.routable:
                    continue
                worker = self.router.add_worker(url)
                self._managed.add(url)
                self.num_added += 1
                log.info("discovered worker %s (group %s)", url, target.group or STABLE_GROUP)
            if url not in self._managed:
                continue  # added by an admin (POST /workers): theirs to manage
            if worker.draining == target.routable:
                log.info("worker %s %s", url, "routable" if target.routable else "draining")
            worker.draining = not target.routable
            self._set_group(url, target.group or STABLE_GROUP)

    async def _remove(self, url: str) -> None:
        self._managed.discard(url)
        if self.router.pool.get(url) is None:
            return  # an admin removed it first
        await self.router.remove_worker(url)
        self.num_removed += 1
        log.info("worker %s is gone", url)

    def _set_group(self, url: str, group: str) -> None:
        split = self.router.split
        if split.group_of(url) == group:
            return
        worker = self.router.pool.get(url)
        assert worker is not None
        known = group == STABLE_GROUP or group in split.shares()
        share = None if known else self.group_weights.get(group)
        if not known and share is None:
            if group not in self._warned_groups:
                self._warned_groups.add(group)
                log.warning("pods name group %r, which has no share: give it one with "
                            "--group-weight %s=SHARE; its pods serve the stable group", group,
                            group)
            group = STABLE_GROUP
            if split.group_of(url) == group:
                return
        try:
            split.update(worker, group, share)
        except SplitUpdateError as e:
            log.warning("worker %s stays in group %s: %s", url, split.group_of(url), e)

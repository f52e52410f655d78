"""Prometheus view of the router, read from the live worker records at scrape time.

Owns: metric names and labels. Does not know: how the numbers are kept (workers.py,
routing.py). A collector (rather than labelled metric objects) means a removed worker simply
stops appearing, with no stale series to delete.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from router.breaker import STATE_VALUE, state_of
from router.core import Router
from router.fleet.sessions import SessionOutcome

PREFIX = "radixserve_router:"


class RouterCollector(Collector):
    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        labels = ["worker"]
        routed = CounterMetricFamily(PREFIX + "requests_routed", "Requests sent to a worker "
                                     "(each retry counts on the worker it went to)", labels=labels)
        errors = CounterMetricFamily(PREFIX + "worker_errors", "Connection failures, 5xx "
                                     "answers and streams broken mid-way", labels=labels)
        in_flight = GaugeMetricFamily(PREFIX + "requests_in_flight",
                                      "Requests being proxied to a worker", labels=labels)
        healthy = GaugeMetricFamily(PREFIX + "worker_healthy",
                                    "1 if the worker gets requests", labels=labels)
        draining = GaugeMetricFamily(PREFIX + "worker_draining", "1 while discovery drains "
                                     "the worker (pod terminating or not Ready)", labels=labels)
        hit_rate = GaugeMetricFamily(PREFIX + "estimated_hit_rate", "Prefix blocks the "
                                     "router believed the worker held / blocks routed to it",
                                     labels=labels)
        entries = GaugeMetricFamily(PREFIX + "prefix_index_entries",
                                    "Approximate index entries per worker", labels=labels)
        kv_live = GaugeMetricFamily(PREFIX + "kv_events_live",
                                    "1 while the worker's /kv_events stream is followed",
                                    labels=labels)
        state = GaugeMetricFamily(PREFIX + "worker_state", "The worker's breaker: 0 closed, "
                                  "1 half_open, 2 open, 3 down (health probes failing)",
                                  labels=labels)
        precise = self.router.precise
        for w in self.router.pool.all():
            state.add_metric([w.url], STATE_VALUE[state_of(w)])
            routed.add_metric([w.url], w.num_routed)
            errors.add_metric([w.url], w.num_errors)
            in_flight.add_metric([w.url], w.in_flight)
            healthy.add_metric([w.url], 1.0 if w.healthy and not w.suspect else 0.0)
            draining.add_metric([w.url], 1.0 if w.draining else 0.0)
            hit_rate.add_metric([w.url], w.est_hit_rate)
            entries.add_metric([w.url], self.router.index.num_entries(w.url))
            if precise is not None:
                kv_live.add_metric([w.url], 1.0 if precise.is_live(w.url) else 0.0)
        yield from (routed, errors, in_flight, healthy, draining, hit_rate, entries, state)
        if precise is not None:
            yield kv_live
        yield from self._groups()
        yield from self._sessions()
        yield from self._keys()

    def _keys(self) -> Iterator[Metric]:
        """Fleet-wide key limits (key_limits.py): by key name, never the key."""
        limits = self.router.limits
        if limits is None:
            return
        in_flight = GaugeMetricFamily(PREFIX + "key_requests_in_flight", "Requests of the key "
                                      "this router holds a concurrency slot for",
                                      labels=["key_name"])
        for name, count in limits.in_flight().items():
            in_flight.add_metric([name], count)
        refused = CounterMetricFamily(PREFIX + "key_requests_refused", "Requests this router "
                                      "refused with 429 for their key's limits")
        refused.add_metric([], limits.num_refused)
        yield from (in_flight, refused)
        if limits.redis is not None:
            up = GaugeMetricFamily(PREFIX + "key_limits_redis_up", "1 while the shared Redis "
                                   "answered its last call (--redis-url)")
            up.add_metric([], 1.0 if limits.redis.up else 0.0)
            fallbacks = CounterMetricFamily(PREFIX + "key_limits_redis_fallbacks", "Requests "
                                            "limited by this router's share: Redis was down")
            fallbacks.add_metric([], limits.redis.num_fallbacks)
            yield from (up, fallbacks)

    def _sessions(self) -> Iterator[Metric]:
        counts = self.router.sessions.counts
        hits = CounterMetricFamily(PREFIX + "session_hits", "Requests of a session sent to "
                                   "the replica that served it last")
        hits.add_metric([], counts[SessionOutcome.HIT])
        spills = CounterMetricFamily(PREFIX + "session_spills", "Requests of a session sent "
                                     "elsewhere because its replica was over the load bound")
        spills.add_metric([], counts[SessionOutcome.SPILL])
        routed = CounterMetricFamily(PREFIX + "session_requests", "Requests carrying a "
                                     "session id, by how they were placed", labels=["outcome"])
        for outcome in SessionOutcome:
            routed.add_metric([outcome.value], counts[outcome])
        yield from (hits, spills, routed)
        resumed = CounterMetricFamily(PREFIX + "stream_resumes", "Streams continued on another "
                                      "replica after theirs failed mid-way")
        resumed.add_metric([], self.router.stream_counts["resumed"])
        failed = CounterMetricFamily(PREFIX + "stream_failures", "Streams ended with an error "
                                     "event (not resumable, or every resume failed)")
        failed.add_metric([], self.router.stream_counts["failed"])
        yield from (resumed, failed)

    def _groups(self) -> Iterator[Metric]:
        """Canary groups (canary.py): every group, the stable one included."""
        labels = ["group"]
        routed = CounterMetricFamily(PREFIX + "group_requests_routed", "Requests sent to a "
                                     "worker of the group (each retry counts)", labels=labels)
        errors = CounterMetricFamily(PREFIX + "group_worker_errors", "worker_errors of the "
                                     "group's workers while in it", labels=labels)
        fallbacks = CounterMetricFamily(PREFIX + "group_fallbacks", "Requests of sessions "
                                        "assigned to the group that another group served "
                                        "(none of its workers routable)", labels=labels)
        weight = GaugeMetricFamily(PREFIX + "group_weight", "Share of sessions assigned to "
                                   "the group", labels=labels)
        workers = GaugeMetricFamily(PREFIX + "group_workers", "Workers in the group",
                                    labels=labels)
        for v in self.router.split.views(self.router.pool.all()):
            routed.add_metric([v.name], v.routed)
            errors.add_metric([v.name], v.errors)
            fallbacks.add_metric([v.name], v.fallbacks)
            weight.add_metric([v.name], v.share)
            workers.add_metric([v.name], len(v.workers))
        yield from (routed, errors, fallbacks, weight, workers)


def make_registry(router: Router) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RouterCollector(router))
    return registry

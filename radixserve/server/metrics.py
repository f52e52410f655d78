"""Prometheus metrics for one server (a per-app registry, never the global one).

Owns: the metric names (vLLM's, with the `radixserve:` prefix), the request-level histograms
and counters observed by the API process, and a collector that renders the engine's latest
stats snapshot at scrape time. Does not know: HTTP routing, the engine's internals.

KV gauges are exported separately on purpose: "usage fell to 0%" must not be read as "the cache
was freed", so free, cached (in the radix tree, mostly evictable) and held (by running requests)
tokens each get their own gauge, and kv_cache_usage_perc counts held tokens only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

PREFIX = "radixserve:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_ENGINE_COUNTERS = {
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens served from the prefix cache.",
    "num_preemptions": "Requests preempted (retracted) under KV pressure.",
    "prompt_tokens": "Prompt tokens admitted.",
    "generation_tokens": "Tokens generated.",
    "num_aborted_requests": "Requests the engine aborted (client gone, cancelled).",
    # Speculative decoding (vLLM's names): drafts verified, their tokens, those accepted.
    "spec_decode_num_drafts": "Speculative drafts verified (one per request and step).",
    "spec_decode_num_draft_tokens": "Speculative draft tokens verified.",
    "spec_decode_num_accepted_tokens": "Speculative draft tokens accepted.",
}
# Metric name -> the engine stats key, where they differ.
_COUNTER_KEYS = {"spec_decode_num_drafts": "spec_num_drafts",
                 "spec_decode_num_draft_tokens": "spec_num_draft_tokens",
                 "spec_decode_num_accepted_tokens": "spec_num_accepted_tokens"}
_ENGINE_GAUGES = {
    "engine_integrity_ok": ("integrity_ok", "1 if the engine's last idle integrity check "
                                            "(pages free + cached + held == total) passed."),
    "num_requests_running": ("num_running", "Requests in the running batch."),
    "num_requests_waiting": ("num_waiting", "Requests waiting to be scheduled."),
    "kv_cache_free_tokens": ("kv_free_tokens", "KV slots on the free list."),
    "kv_cache_cached_tokens": ("kv_cached_tokens", "KV slots owned by the radix tree."),
    "kv_cache_evictable_tokens": ("kv_evictable_tokens",
                                  "Cached KV slots not locked by a request."),
    "kv_cache_held_tokens": ("kv_held_tokens", "KV slots held by running requests only."),
    "kv_cache_total_tokens": ("kv_total_tokens", "KV slots in the pool."),
    "kv_cache_total_bytes": ("kv_cache_bytes", "Bytes of the KV pool's K and V tensors."),
    "spec_decode_mean_acceptance_length": (
        "spec_mean_acceptance_length", "Tokens kept per verified draft (1 + accepted / drafts), "
        "since start; 0 before the first draft."),
    # Tensor parallelism (only with --tensor-parallel-size > 1)
    "tensor_parallel_size": ("tp_size", "Tensor-parallel ranks the model is split over."),
    "tp_collective_seconds": ("tp_collective_seconds", "Seconds rank 0 spent inside "
                              "collectives (step broadcast, all-reduces, logits gather)."),
    "tp_collective_ms_per_step": ("tp_collective_ms_per_step",
                                  "Mean milliseconds of collectives per forward, since start."),
}
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                30.0, 40.0, 50.0, 60.0, 120.0)


class _EngineStatsCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any]],
                 tenant_label: Callable[[str], str]) -> None:
        self._stats = stats
        self._tenant_label = tenant_label

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for name, doc in _ENGINE_COUNTERS.items():
            value = float(stats.get(_COUNTER_KEYS.get(name, name), 0))
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        for name, (key, doc) in _ENGINE_GAUGES.items():
            if key in stats:
                yield GaugeMetricFamily(PREFIX + name, doc, value=float(stats[key]))
        total = stats.get("kv_total_tokens") or 0
        usage = stats.get("kv_held_tokens", 0) / total if total else 0.0
        yield GaugeMetricFamily(PREFIX + "kv_cache_usage_perc",
                                "Fraction of KV slots held by running requests (0..1).",
                                value=usage)
        tenants = GaugeMetricFamily(
            PREFIX + "tenant_cached_tokens",
            "Unlocked cached KV tokens per tenant (cache namespace: one per API key).",
            labels=["tenant"])
        for salt, n in sorted((stats.get("tenant_cached_tokens") or {}).items()):
            tenants.add_metric([self._tenant_label(salt)], float(n))
        yield tenants
        if "kv_cache_dtype" in stats:
            yield InfoMetricFamily(PREFIX + "kv_cache_dtype",
                                   "How the KV pool stores K/V (--kv-cache-dtype).",
                                   value={"kv_cache_dtype": str(stats["kv_cache_dtype"])})
        yield from _tier_metrics(stats.get("kv_offload"))


# Per tier (label `tier`: local, shared), from the engine's kv_offload stats; name -> (field,
# counter?, help).
_TIER_FAMILIES = {
    "kv_offload_hit_tokens": ("hit_tokens_total", True,
                              "Prompt tokens loaded from a KV tier instead of recomputed."),
    "kv_offload_stored_tokens": ("stored_tokens", False,
                                 "Tokens of the KV blocks a tier holds now."),
    "kv_offload_store_bytes": ("stored_bytes_total", True, "KV bytes written to a tier."),
    "kv_offload_load_bytes": ("loaded_bytes_total", True, "KV bytes read from a tier."),
    "kv_offload_load_seconds": ("load_seconds_total", True,
                                "Seconds spent reading KV blocks from a tier."),
    "kv_offload_store_seconds": ("store_seconds_total", True,
                                 "Seconds spent writing KV blocks to a tier (off the step)."),
}


def _tier_metrics(tiers: dict[str, Any] | None) -> Iterator[Metric]:
    if not tiers:
        return
    for name, (key, counter, doc) in _TIER_FAMILIES.items():
        family: CounterMetricFamily | GaugeMetricFamily = (
            CounterMetricFamily(PREFIX + name, doc, labels=["tier"]) if counter
            else GaugeMetricFamily(PREFIX + name, doc, labels=["tier"]))
        for tier, values in sorted(tiers.get("tiers", {}).items()):
            family.add_metric([tier], float(values.get(key, 0)))
        yield family
    errors = CounterMetricFamily(
        PREFIX + "kv_offload_errors", "KV tier faults, by kind: a bad block read (corrupt, "
        "truncated, wrong_key, vanished, io_error) is a miss; a failed write (no_space, "
        "write_error) drops the block.", labels=["kind"])
    for kind, n in sorted(tiers.get("errors", {}).items()):
        errors.add_metric([kind], float(n))
    yield errors
    yield from _tier_choice_metrics(tiers)
    for name, key, doc in (
            ("kv_offload_load_bytes_per_second", "load_bytes_per_s",
             "Measured tier load bandwidth (running average; the fastest tier)."),
            ("kv_offload_prefill_tokens_per_second", "prefill_tokens_per_s",
             "Measured prefill rate the load-or-recompute decision compares against.")):
        if tiers.get(key) is not None:
            yield GaugeMetricFamily(PREFIX + name, doc, value=float(tiers[key]))


def _tier_choice_metrics(tiers: dict[str, Any]) -> Iterator[Metric]:
    """Per-tier load-or-recompute choices and load rates, and the step-wait histogram."""
    choices = CounterMetricFamily(
        PREFIX + "kv_offload_choices", "Load-or-recompute choices per tier: load (cheaper), "
        "probe (loaded to measure the tier again), recompute.", labels=["tier", "choice"])
    rates = GaugeMetricFamily(PREFIX + "kv_offload_tier_load_bytes_per_second",
                              "Measured load bandwidth of each tier.", labels=["tier"])
    for tier, values in sorted(tiers.get("tiers", {}).items()):
        for choice, n in sorted((values.get("choices_total") or {}).items()):
            choices.add_metric([tier, choice], float(n))
        if values.get("load_bytes_per_s") is not None:
            rates.add_metric([tier], float(values["load_bytes_per_s"]))
    yield choices
    yield rates
    wait = tiers.get("step_wait")
    if wait:
        cumulative, buckets = 0, []
        for bound, n in zip([*wait["buckets"], float("inf")], wait["counts"], strict=True):
            cumulative += n
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)),
                            float(cumulative)))
        yield HistogramMetricFamily(
            PREFIX + "kv_offload_step_wait_seconds", "Time each engine step spent on tier "
            "work (probes, snapshots of written blocks, write results).",
            buckets=buckets, sum_value=float(wait["sum"]))


class ServerMetrics:
    """Everything /metrics renders. `stats` returns the engine's latest snapshot."""

    def __init__(self, stats: Callable[[], dict[str, Any]],
                 tenant_label: Callable[[str], str] = lambda salt: salt[:12] or "shared",
                 ) -> None:
        """`tenant_label` names a cache salt in labels (never the API key itself)."""
        self.registry = CollectorRegistry()
        self.request_success = Counter(
            PREFIX + "request_success", "Finished requests by finish reason.",
            ["finished_reason"], registry=self.registry)
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time to the first token.",
            buckets=_TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between consecutive tokens.",
            buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Request latency, arrival to finish.",
            buckets=_E2E_BUCKETS, registry=self.registry)
        # Per API key, labelled by the key's name from the keys file (never the key).
        self.key_requests = Counter(
            PREFIX + "api_key_requests", "Requests admitted, by API key name.", ["key_name"],
            registry=self.registry)
        self.key_refused = Counter(
            PREFIX + "api_key_requests_refused", "Requests refused by a limit, by API key name "
            "and the limit's code.", ["key_name", "code"], registry=self.registry)
        self.key_prompt_tokens = Counter(
            PREFIX + "api_key_prompt_tokens", "Prompt tokens of admitted requests, by API key "
            "name.", ["key_name"], registry=self.registry)
        self.key_generation_tokens = Counter(
            PREFIX + "api_key_generation_tokens", "Generated tokens, by API key name.",
            ["key_name"], registry=self.registry)
        self.requests_displaced = Counter(
            PREFIX + "requests_displaced", "Waiting requests refused (429 queue_full) after "
            "admission to make room for a more important one, by API key name.", ["key_name"],
            registry=self.registry)
        self.engine_restarts = Counter(
            PREFIX + "engine_restarts", "Times the engine process was restarted after dying.",
            registry=self.registry)
        self.request_timeouts = Counter(
            PREFIX + "request_timeouts", "Requests aborted by --request-timeout or their own "
            "'timeout'.", registry=self.registry)
        self.registry.register(_EngineStatsCollector(stats, tenant_label))

    def render(self) -> bytes:
        return generate_latest(self.registry)

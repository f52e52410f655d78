"""`--metrics-compat vllm`: the inference gateway's model-server gauges, under vLLM's names.

The gauges the Gateway API inference extension's model-server protocol reads (llm-d's
endpoint picker, KServe), under vLLM's exact names.

Owns: the vllm:* names and their mapping to the engine's stats snapshot. Does not know: how
the stats are kept (the engine), the radixserve:* metrics (metrics.py), which stay as they
are; these are extra series with the same live values, read at scrape time.

    vllm:num_requests_waiting   = radixserve:num_requests_waiting
    vllm:num_requests_running   = radixserve:num_requests_running
    vllm:kv_cache_usage_perc    = radixserve:kv_cache_usage_perc (0..1: slots held by running
                                  requests, as vLLM counts used blocks; cached but evictable
                                  blocks are free to it too)
    vllm:gpu_cache_usage_perc   the same, under the name vLLM used before 0.10
vLLM's LoRA info gauge (vllm:lora_requests_info) applies only to a server with adapters;
radixserve serves none, so it is not exported. Labels as vLLM's: model_name, engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_GAUGES = {
    "num_requests_waiting": ("num_waiting", "Number of requests waiting to be processed."),
    "num_requests_running": ("num_running", "Number of requests in model execution batches."),
}


class VllmCompatCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any]], model_name: Callable[[], str]
                 ) -> None:
        self._stats = stats
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        labels = ["model_name", "engine"]
        values = [self._model_name(), "0"]
        for name, (key, doc) in _GAUGES.items():
            g = GaugeMetricFamily(f"vllm:{name}", doc, labels=labels)
            g.add_metric(values, float(stats.get(key, 0)))
            yield g
        total = stats.get("kv_total_tokens") or 0
        usage = stats.get("kv_held_tokens", 0) / total if total else 0.0
        for name in ("kv_cache_usage_perc", "gpu_cache_usage_perc"):
            g = GaugeMetricFamily(f"vllm:{name}", "KV-cache usage. 1 means 100 percent usage.",
                                  labels=labels)
            g.add_metric(values, usage)
            yield g

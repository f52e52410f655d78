"""EngineCounters: the scheduler's monotonic counters, read by stats() into the engine's stats.

Owns: the counter fields; their names are the stats keys the engine process sends over IPC
(the server's /metrics and stats log read them by these names: do not rename). Does not
know: requests, Prometheus.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class EngineCounters:
    prefix_cache_queries: int = 0  # prompt tokens looked up in the cache (first admissions)
    prefix_cache_hits: int = 0  # of those, tokens served from the cache
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    computed_tokens: int = 0  # tokens forwarded (prefill chunks and decodes)
    num_aborted_requests: int = 0

    def as_stats(self) -> dict[str, int]:
        return asdict(self)

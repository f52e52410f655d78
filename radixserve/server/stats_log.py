"""The periodic stats log line (vLLM style) and the start-up capacity lines.

Owns: throughput over the last interval from the engine's cumulative counters, and the
prefix-cache hit rate over a sliding window of recent intervals. Does not know: HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("radixserve.server")

HIT_RATE_WINDOW = 12  # intervals (one minute at the default 5 s)


def log_capacity(info: dict[str, Any]) -> None:
    kv_tokens = int(info.get("kv_cache_tokens", 0))
    max_len = int(info.get("max_model_len", 0)) or 1
    logger.info("KV cache size: %d tokens", kv_tokens)
    logger.info("Maximum concurrency for %d tokens per request: %.2fx", max_len,
                kv_tokens / max_len)


class StatsLogger:
    def __init__(self, stats: Callable[[], dict[str, Any]], interval: float) -> None:
        self._stats = stats
        self._interval = interval
        self._prev: dict[str, Any] = {}
        self._prev_time = time.monotonic()
        self._window: deque[tuple[int, int]] = deque(maxlen=HIT_RATE_WINDOW)
        self._tier_hits: dict[str, int] = {}  # hit tokens per tier at the last line

    def line(self) -> str | None:
        """The log line for the interval just ended; None when the engine was idle throughout."""
        stats, now = dict(self._stats()), time.monotonic()
        elapsed = max(now - self._prev_time, 1e-9)

        def delta(name: str) -> int:
            return int(stats.get(name, 0)) - int(self._prev.get(name, 0))

        prompt, gen = delta("prompt_tokens"), delta("generation_tokens")
        queries, hits = delta("prefix_cache_queries"), delta("prefix_cache_hits")
        self._prev, self._prev_time = stats, now
        running, waiting = stats.get("num_running", 0), stats.get("num_waiting", 0)
        if not (prompt or gen or running or waiting):
            return None
        self._window.append((queries, hits))
        total_q = sum(q for q, _ in self._window)
        hit_rate = 100.0 * sum(h for _, h in self._window) / total_q if total_q else 0.0
        kv_total = stats.get("kv_total_tokens") or 1
        usage = 100.0 * stats.get("kv_held_tokens", 0) / kv_total
        cached = 100.0 * stats.get("kv_cached_tokens", 0) / kv_total
        return (f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {gen / elapsed:.1f} tokens/s, "
                f"Running: {running} reqs, Waiting: {waiting} reqs, "
                f"KV cache usage: {usage:.1f}% held, {cached:.1f}% cached, "
                f"Prefix cache hit rate: {hit_rate:.1f}%{self._tiers(stats)}")

    def _tiers(self, stats: dict[str, Any]) -> str:
        """", KV tiers: local 1234 tok (+96 hit), shared ..." (tokens held, tokens loaded over
        the interval); empty without tiers."""
        tiers = (stats.get("kv_offload") or {}).get("tiers") or {}
        parts = []
        for name, t in sorted(tiers.items()):
            hits = int(t.get("hit_tokens_total", 0))
            parts.append(f"{name} {int(t.get('stored_tokens', 0))} tok "
                         f"(+{hits - self._tier_hits.get(name, 0)} hit)")
            self._tier_hits[name] = hits
        return f", KV tiers: {', '.join(parts)}" if parts else ""

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            text = self.line()
            if text is not None:
                logger.info(text)

"""A multi-tenant trace under cache pressure, for bench.router and bench.router_agreement.

Owns: the trace's shape. Many tenants, each with a long system prefix of its own, requests
drawn with Zipf-skewed popularity (a few hot tenants, a long tail), each a tenant's prefix
plus a unique suffix. The prefixes together overflow the replicas' caches, so replicas evict
(LRU) and an index that only remembers what it routed (approximate) goes stale, while one fed
by the replicas' own events (precise) does not. Does not know: routers or replicas.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class TraceConfig:
    tenants: int = 96
    requests: int = 768
    prefix_len: int = 2048  # characters = tokens for the fake replicas' byte tokenizer
    suffix_len: int = 64
    zipf_s: float = 1.1  # popularity of the k-th tenant ~ 1 / k^s


def _text(rng: random.Random, n: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz "
    return "".join(rng.choice(letters) for _ in range(n))


def pressure_trace(cfg: TraceConfig, rng: random.Random) -> list[str]:
    """`cfg.requests` prompts in arrival order."""
    prefixes = [f"tenant {t:04d}: " + _text(rng, cfg.prefix_len) for t in range(cfg.tenants)]
    weights = [1.0 / (k + 1) ** cfg.zipf_s for k in range(cfg.tenants)]
    tenants = rng.choices(range(cfg.tenants), weights=weights, k=cfg.requests)
    return [prefixes[t] + _text(rng, cfg.suffix_len) for t in tenants]


def prefix_tokens(cfg: TraceConfig) -> int:
    """All tenants' prefixes together: compare with replicas x cache size."""
    return cfg.tenants * (cfg.prefix_len + len("tenant 0000: "))

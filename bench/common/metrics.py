"""Serving metrics from per-request timestamps: pure functions, no I/O.

Owns: the record of one measured request (`RequestResult`), the field's definitions of TTFT,
TPOT, ITL and E2E, their summary statistics, throughput, the prefix-cache hit rate (from
`usage.prompt_tokens_details.cached_tokens` and from Prometheus counter deltas), and the
terminal table. Does not know: HTTP, workloads, how timestamps were taken.

Definitions (sglang.bench_serving / `vllm bench serve`):
    TTFT = first streamed token chunk - send
    TPOT = (E2E - TTFT) / (output tokens - 1), per request, only when output tokens > 1
    ITL  = every gap between consecutive streamed token chunks, pooled over requests
    E2E  = last byte of the response - send
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import numpy as np

# Prefixes of the Prometheus counter pairs we cross-check the client-side hit rate with.
# Counters are in tokens: queries += prompt tokens, hits += cached prompt tokens.
CACHE_COUNTER_PREFIXES = ("radixserve:", "vllm:")


@dataclass
class RequestResult:
    """One request as the client saw it. Times are seconds on the client's monotonic clock."""

    ok: bool
    send_time: float
    prompt_len: int  # the server's usage.prompt_tokens when it reports one, else the workload's
    expected_output_len: int  # max_tokens sent
    output_len: int = 0  # usage.completion_tokens when reported, else the number of chunks
    cached_tokens: int | None = None  # None: the server reported no prompt_tokens_details
    chunk_times: list[float] = field(default_factory=list)  # arrival of each token chunk
    end_time: float = 0.0
    error: str = ""
    text: str = ""
    usage_reported: bool = False

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.send_time if self.chunk_times else None

    @property
    def e2e(self) -> float:
        return self.end_time - self.send_time

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t[:-1], t[1:], strict=True)]

    @property
    def tpot(self) -> float | None:
        ttft = self.ttft
        if ttft is None or self.output_len < 2:
            return None
        return (self.e2e - ttft) / (self.output_len - 1)


class LatencyStats(NamedTuple):
    """Seconds. All zero when n == 0 (nothing measured), so the JSON stays numeric."""

    n: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float


def latency_stats(values: Sequence[float]) -> LatencyStats:
    """Linear-interpolated percentiles (numpy's default), as both anchors report them."""
    if len(values) == 0:
        return LatencyStats(0, 0.0, 0.0, 0.0, 0.0, 0.0)
    arr = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return LatencyStats(len(arr), float(arr.mean()), float(p50), float(p90), float(p99),
                        float(arr.max()))


def hit_rate(cached_tokens: Iterable[int], prompt_tokens: Iterable[int]) -> float | None:
    """Σ cached / Σ prompt; None when there were no prompt tokens to hit."""
    cached, prompt = sum(cached_tokens), sum(prompt_tokens)
    return cached / prompt if prompt > 0 else None


def cumulative_hit_rate(results: Sequence[RequestResult]) -> list[float]:
    """Hit rate after each completed request, in completion order (for the over-the-run plot)."""
    done = sorted((r for r in results if r.ok and r.cached_tokens is not None),
                  key=lambda r: r.end_time)
    out: list[float] = []
    cached = prompt = 0
    for r in done:
        assert r.cached_tokens is not None
        cached += r.cached_tokens
        prompt += r.prompt_len
        out.append(cached / prompt if prompt else 0.0)
    return out


_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum every sample of each metric name over its labels (enough for our counters)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        totals[m.group(1)] = totals.get(m.group(1), 0.0) + value
    return totals


class CounterHitRate(NamedTuple):
    prefix: str  # which server's counters: "radixserve:" or "vllm:"
    hits: float
    queries: float

    @property
    def rate(self) -> float | None:
        return self.hits / self.queries if self.queries > 0 else None


def counter_hit_rate(before: Mapping[str, float], after: Mapping[str, float]
                     ) -> CounterHitRate | None:
    """The hit rate over the run from /metrics deltas; None when the server exports neither."""
    for prefix in CACHE_COUNTER_PREFIXES:
        hits_key = f"{prefix}prefix_cache_hits_total"
        queries_key = f"{prefix}prefix_cache_queries_total"
        if hits_key in after and queries_key in after:
            return CounterHitRate(prefix, after[hits_key] - before.get(hits_key, 0.0),
                                  after[queries_key] - before.get(queries_key, 0.0))
    return None


@dataclass(frozen=True)
class BenchSummary:
    completed: int
    failed: int
    duration_s: float
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_throughput: float  # (prompt + output) tokens / s
    total_prompt_tokens: int
    total_output_tokens: int
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2e: LatencyStats
    hit_rate: float | None  # client side, from usage; None when the server reports no details
    server_hit_rate: float | None  # from /metrics deltas; None when not exported
    short_outputs: int  # completed requests with fewer tokens than max_tokens asked

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for name in ("ttft", "tpot", "itl", "e2e"):
            d[name] = getattr(self, name)._asdict()
        return d


def summarize(results: Sequence[RequestResult], duration_s: float,
              server: CounterHitRate | None = None) -> BenchSummary:
    assert duration_s > 0, "a run takes time"
    ok = [r for r in results if r.ok]
    prompt_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    with_details = [r for r in ok if r.cached_tokens is not None]
    client_rate = (hit_rate((r.cached_tokens or 0 for r in with_details),
                            (r.prompt_len for r in with_details)) if with_details else None)
    return BenchSummary(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        request_throughput=len(ok) / duration_s,
        output_throughput=output_tokens / duration_s,
        total_throughput=(prompt_tokens + output_tokens) / duration_s,
        total_prompt_tokens=prompt_tokens,
        total_output_tokens=output_tokens,
        ttft=latency_stats([t for r in ok if (t := r.ttft) is not None]),
        tpot=latency_stats([t for r in ok if (t := r.tpot) is not None]),
        itl=latency_stats([g for r in ok for g in r.itls]),
        e2e=latency_stats([r.e2e for r in ok]),
        hit_rate=client_rate,
        server_hit_rate=server.rate if server is not None else None,
        short_outputs=sum(r.output_len < r.expected_output_len for r in ok),
    )


def _fmt_rate(x: float | None) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.1f}%"


def format_summary(s: BenchSummary, title: str = "") -> str:
    """The terminal table: one figure per line, latencies in ms."""
    rows: list[tuple[str, str]] = [
        ("Completed / failed", f"{s.completed} / {s.failed}"),
        ("Duration (s)", f"{s.duration_s:.2f}"),
        ("Request throughput (req/s)", f"{s.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{s.output_throughput:.1f}"),
        ("Total token throughput (tok/s)", f"{s.total_throughput:.1f}"),
        ("Prompt / output tokens", f"{s.total_prompt_tokens} / {s.total_output_tokens}"),
        ("Prefix-cache hit rate (usage)", _fmt_rate(s.hit_rate)),
        ("Prefix-cache hit rate (/metrics)", _fmt_rate(s.server_hit_rate)),
    ]
    for name, st in (("TTFT", s.ttft), ("TPOT", s.tpot), ("ITL", s.itl), ("E2E", s.e2e)):
        rows.append((f"{name} mean/p50/p90/p99/max (ms)",
                     " / ".join(f"{1000 * v:.1f}" for v in st[1:])))
    width = max(len(k) for k, _ in rows) + 2
    bar = "=" * (width + 40)
    lines = [bar, title.center(len(bar)) if title else "", bar]
    lines += [f"{k:<{width}}{v}" for k, v in rows]
    lines.append(bar)
    return "\n".join(line for line in lines if line)

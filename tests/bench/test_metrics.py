"""bench.common.metrics from known timestamps: percentiles, TTFT, TPOT, ITL, throughput, hit rates."""

from __future__ import annotations

import math

import pytest

from bench.common.metrics import (
    RequestResult,
    counter_hit_rate,
    cumulative_hit_rate,
    format_summary,
    hit_rate,
    latency_stats,
    parse_prometheus,
    summarize,
)


def _req(send: float, chunks: list[float], end: float, out: int | None = None,
         prompt: int = 100, cached: int | None = None, ok: bool = True,
         expected: int | None = None) -> RequestResult:
    n = len(chunks) if out is None else out
    return RequestResult(ok=ok, send_time=send, prompt_len=prompt,
                         expected_output_len=n if expected is None else expected, output_len=n,
                         cached_tokens=cached, chunk_times=chunks, end_time=end)


def test_latency_stats_linear_percentiles() -> None:
    st = latency_stats([float(x) for x in range(1, 101)])  # 1..100
    assert st.n == 100
    assert st.mean == pytest.approx(50.5)
    assert st.p50 == pytest.approx(50.5)
    assert st.p90 == pytest.approx(90.1)
    assert st.p99 == pytest.approx(99.01)
    assert st.max == 100.0


def test_latency_stats_small_and_empty() -> None:
    assert latency_stats([3.0]) == (1, 3.0, 3.0, 3.0, 3.0, 3.0)
    assert latency_stats([1.0, 3.0]).p50 == pytest.approx(2.0)
    assert latency_stats([]) == (0, 0.0, 0.0, 0.0, 0.0, 0.0)


def test_request_ttft_itl_tpot_e2e() -> None:
    r = _req(send=10.0, chunks=[10.5, 10.6, 10.8, 11.1], end=11.2)
    assert r.ttft == pytest.approx(0.5)
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])
    assert r.e2e == pytest.approx(1.2)
    # (E2E - TTFT) / (n - 1) = 0.7 / 3
    assert r.tpot == pytest.approx(0.7 / 3)


def test_tpot_uses_reported_tokens_not_chunks() -> None:
    # Two chunks that carried 5 tokens (a server that batches tokens per SSE event).
    r = _req(send=0.0, chunks=[1.0, 2.0], end=2.0, out=5)
    assert r.tpot == pytest.approx(1.0 / 4)
    assert r.itls == pytest.approx([1.0])


def test_undefined_metrics_are_none() -> None:
    assert _req(0.0, [0.3], 0.3).tpot is None  # one token: no TPOT
    assert _req(0.0, [], 0.3, out=0).ttft is None


def test_hit_rate_sums_tokens_not_ratios() -> None:
    assert hit_rate([90, 0], [100, 900]) == pytest.approx(0.09)
    assert hit_rate([], []) is None


def test_summarize_known_run() -> None:
    results = [
        _req(0.0, [0.2, 0.3, 0.4], 0.4, prompt=100, cached=50),
        _req(0.0, [0.4, 0.6, 0.8], 0.8, prompt=100, cached=100),
        _req(0.1, [], 0.2, ok=False, out=0),
    ]
    s = summarize(results, duration_s=2.0)
    assert (s.completed, s.failed) == (2, 1)
    assert s.request_throughput == pytest.approx(1.0)
    assert s.total_output_tokens == 6 and s.total_prompt_tokens == 200
    assert s.output_throughput == pytest.approx(3.0)
    assert s.total_throughput == pytest.approx(103.0)
    assert s.ttft.mean == pytest.approx(0.3) and s.ttft.max == pytest.approx(0.4)
    assert sorted([s.itl.p50, s.itl.max]) == pytest.approx([0.15, 0.2])
    assert s.tpot.mean == pytest.approx((0.1 + 0.2) / 2)
    assert s.e2e.max == pytest.approx(0.8)
    assert s.hit_rate == pytest.approx(0.75)
    assert s.server_hit_rate is None and s.short_outputs == 0
    assert "Completed / failed" in format_summary(s, "t") and "75.0%" in format_summary(s)


def test_summarize_flags_short_outputs_and_missing_details() -> None:
    s = summarize([_req(0.0, [0.1, 0.2], 0.2, expected=8)], duration_s=1.0)
    assert s.short_outputs == 1
    assert s.hit_rate is None  # no prompt_tokens_details: unknown, not 0


PROM = """# HELP radixserve:prefix_cache_hits_total cached tokens
# TYPE radixserve:prefix_cache_hits_total counter
radixserve:prefix_cache_hits_total{model_name="m"} 1500.0
radixserve:prefix_cache_queries_total{model_name="m"} 2000
radixserve:request_success_total{finished_reason="stop"} 3
radixserve:request_success_total{finished_reason="length"} 4
garbage line
"""


def test_parse_prometheus_sums_labels() -> None:
    m = parse_prometheus(PROM)
    assert m["radixserve:prefix_cache_hits_total"] == 1500.0
    assert m["radixserve:request_success_total"] == 7.0
    assert "garbage" not in m


def test_counter_hit_rate_from_deltas() -> None:
    before = {"radixserve:prefix_cache_hits_total": 500.0,
              "radixserve:prefix_cache_queries_total": 1000.0}
    c = counter_hit_rate(before, parse_prometheus(PROM))
    assert c is not None and c.prefix == "radixserve:"
    assert c.rate == pytest.approx(1000 / 1000)
    vllm = {"vllm:prefix_cache_hits_total": 30.0, "vllm:prefix_cache_queries_total": 120.0}
    c2 = counter_hit_rate({}, vllm)
    assert c2 is not None and c2.rate == pytest.approx(0.25)
    assert counter_hit_rate({}, {"other": 1.0}) is None
    s = summarize([_req(0.0, [0.1], 0.1)], 1.0, c2)
    assert s.server_hit_rate == pytest.approx(0.25)


def test_cumulative_hit_rate_in_completion_order() -> None:
    results = [
        _req(0.0, [0.1], end=3.0, prompt=100, cached=100),
        _req(0.0, [0.1], end=1.0, prompt=100, cached=0),
        _req(0.0, [0.1], end=2.0, prompt=200, cached=100),
    ]
    assert cumulative_hit_rate(results) == pytest.approx([0.0, 100 / 300, 200 / 400])
    assert not math.isnan(summarize(results, 1.0).hit_rate or 0.0)

"""PNG plots of benchmark results (matplotlib, headless Agg backend).

Owns: the pictures: TTFT and ITL distributions, hit rate over a run, throughput and TTFT p99
against request rate, and a side-by-side bar chart of systems. Does not know: HTTP, servers;
it draws what bench.common.metrics computed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # NOTE: before pyplot is imported; no display on servers or in CI

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from bench.common.metrics import (  # noqa: E402
    BenchSummary,
    RequestResult,
    cumulative_hit_rate,
    latency_stats,
)


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latencies(results: Sequence[RequestResult], path: Path) -> Path:
    """Histograms of TTFT (one per request) and ITL (every gap), in ms."""
    ok = [r for r in results if r.ok]
    ttfts = [1000 * t for r in ok if (t := r.ttft) is not None]
    itls = [1000 * g for r in ok for g in r.itls]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, values, name in ((axes[0], ttfts, "TTFT"), (axes[1], itls, "ITL")):
        if values:
            ax.hist(values, bins=min(50, max(5, len(values) // 4)), color="tab:blue", alpha=0.8)
            st = latency_stats(values)  # the same percentiles as the table
            for q, v, style in (("p50", st.p50, "--"), ("p99", st.p99, ":")):
                ax.axvline(v, color="k", linestyle=style, label=f"{q} {v:.0f} ms")
            ax.legend()
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("count")
        ax.set_title(f"{name} distribution (n={len(values)})")
    return _save(fig, path)


def plot_hit_rate(results: Sequence[RequestResult], path: Path) -> Path:
    """Cumulative prefix-cache hit rate after each completed request."""
    rates = cumulative_hit_rate(results)
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot(range(1, len(rates) + 1), [100 * r for r in rates], marker=".")
    ax.set_ylim(0, 100)
    ax.set_xlabel("requests completed")
    ax.set_ylabel("cumulative hit rate (%)")
    ax.set_title("prefix-cache hit rate over the run" if rates
                 else "no cached_tokens reported by the server")
    return _save(fig, path)


def plot_run(results: Sequence[RequestResult], stem: Path) -> list[Path]:
    return [plot_latencies(results, stem.with_name(stem.name + "_latency.png")),
            plot_hit_rate(results, stem.with_name(stem.name + "_hitrate.png"))]


def plot_sweep(rates: Sequence[float], summaries: Sequence[BenchSummary], path: Path) -> Path:
    """Output throughput and TTFT p99 against the offered request rate."""
    fig, ax1 = plt.subplots(figsize=(6.5, 4))
    xs = list(range(len(rates)))
    ax1.plot(xs, [s.output_throughput for s in summaries], marker="o", color="tab:blue")
    ax1.set_ylabel("output tok/s", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.plot(xs, [1000 * s.ttft.p99 for s in summaries], marker="s", color="tab:red")
    ax2.set_ylabel("TTFT p99 (ms)", color="tab:red")
    ax1.set_xticks(xs, [str(r) for r in rates])  # categorical: inf has no place on an axis
    ax1.set_xlabel("request rate (req/s)")
    ax1.set_title("throughput and TTFT p99 vs request rate")
    return _save(fig, path)


def plot_compare(names: Sequence[str], figures: Sequence[Mapping[str, float | None]],
                 path: Path) -> Path:
    """Side by side (bench.compare's median figures): output tok/s and TTFT p50/p99 in ms."""
    def get(f: Mapping[str, float | None], key: str) -> float:
        return f.get(key) or 0.0

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    xs = list(range(len(names)))
    ax1.bar(xs, [get(f, "output_tok_s") for f in figures], color="tab:blue")
    ax1.set_ylabel("output tok/s (higher is better)")
    ax1.set_title("output throughput")
    width = 0.4
    ax2.bar([x - width / 2 for x in xs], [get(f, "ttft_p50_ms") for f in figures], width,
            label="p50")
    ax2.bar([x + width / 2 for x in xs], [get(f, "ttft_p99_ms") for f in figures], width,
            label="p99")
    positive = [v for f in figures for k in ("ttft_p50_ms", "ttft_p99_ms") if (v := get(f, k)) > 0]
    if positive and max(positive) > 20 * min(positive):  # peers differ by orders of magnitude
        ax2.set_yscale("log")
    ax2.set_ylabel("TTFT ms (lower is better)")
    ax2.set_title("time to first token")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.set_xticks(xs, list(names), rotation=20, ha="right")
    return _save(fig, path)

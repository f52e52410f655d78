"""bench.compare's report: median figures per system, the ratio table, the per-run lines.

Owns: the table's columns (Figure: how to read one from a summary, which direction is
better), the per-figure median over runs, the table with every figure as a ratio to the
reference system, RunCost (what one run cost the machine), and the JSON record per system.
Does not know: how systems are started or runs ordered (bench.compare), how figures are
computed from requests (bench.common.metrics).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.common.client import BenchRun
from bench.common.metrics import BenchSummary
from bench.common.server_process import SystemSpec


class Figure:
    """A column of the table: how to read it from a summary, and which direction is better."""

    def __init__(self, label: str, get: Callable[[BenchSummary], float | None],
                 higher_is_better: bool) -> None:
        self.label, self.get, self.higher_is_better = label, get, higher_is_better


FIGURES = {
    "output_tok_s": Figure("out tok/s", lambda s: s.output_throughput, True),
    "total_tok_s": Figure("total tok/s", lambda s: s.total_throughput, True),
    "req_s": Figure("req/s", lambda s: s.request_throughput, True),
    "ttft_p50_ms": Figure("TTFT p50 ms", lambda s: 1000 * s.ttft.p50, False),
    "ttft_p99_ms": Figure("TTFT p99 ms", lambda s: 1000 * s.ttft.p99, False),
    "tpot_p50_ms": Figure("TPOT p50 ms", lambda s: 1000 * s.tpot.p50, False),
    "itl_p50_ms": Figure("ITL p50 ms", lambda s: 1000 * s.itl.p50, False),
    "e2e_p50_ms": Figure("E2E p50 ms", lambda s: 1000 * s.e2e.p50, False),
    "hit_rate_pct": Figure("hit %", lambda s: None if s.hit_rate is None else 100 * s.hit_rate,
                           True),
}

Row = dict[str, float | None] | str  # a system's median figures, or why it did not run


@dataclass(frozen=True)
class RunCost:
    """What one run cost the machine: CPU seconds of the server's processes (None where
    /proc is missing) and the 1-minute load average at its end."""

    cpu_s: float | None
    load_avg: float


Results = dict[str, tuple[list[BenchRun], list[RunCost]] | str]  # per system; str: an error


def median_figures(summaries: list[BenchSummary]) -> dict[str, float | None]:
    """Per-figure median over runs (each figure separately, as repeated benchmarks report)."""
    out: dict[str, float | None] = {}
    for key, fig in FIGURES.items():
        values = [v for s in summaries if (v := fig.get(s)) is not None]
        out[key] = statistics.median(values) if values else None
    out["failed"] = float(sum(s.failed for s in summaries))
    return out


def _cell(value: float | None, ref: float | None) -> str:
    if value is None:
        return "n/a"
    text = f"{value:.1f}"
    if ref:  # a ratio to the reference system; none against zero or a missing figure
        text += f" ({value / ref:.2f}x)"
    return text


def format_table(rows: dict[str, Row], reference: str) -> str:
    """Systems down, figures across; every figure also as a ratio to the reference system."""
    ref_row = rows.get(reference)
    ref = ref_row if isinstance(ref_row, dict) else {}
    header = ["system", *(f.label for f in FIGURES.values()), "failed"]
    table = [header]
    for name, row in rows.items():
        if isinstance(row, str):
            table.append([name, f"did not run: {row}"])
            continue
        failed = row["failed"]
        table.append([name, *(_cell(row[k], ref.get(k)) for k in FIGURES),
                      str(int(failed if failed is not None else 0))])
    widths = [max(len(r[i]) for r in table if i < len(r) and len(r) == len(header))
              for i in range(len(header))]
    lines = []
    for r in table:
        if len(r) != len(header):
            lines.append(f"{r[0]:<{widths[0]}}  {r[1]}")
        else:
            lines.append("  ".join(c.rjust(w) if i else c.ljust(w)
                                   for i, (c, w) in enumerate(zip(r, widths, strict=True))))
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


@dataclass
class Report:
    """A compare's results, read: the table's rows, the JSON record per system, the notes
    the runs raised, and one line per system that ran (per-run throughput, CPU, load)."""

    rows: dict[str, Row] = field(default_factory=dict)
    record: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: set[str] = field(default_factory=set)
    lines: list[str] = field(default_factory=list)


def _run_line(name: str, runs: list[BenchRun], costs: list[RunCost]) -> str:
    cpu = [c.cpu_s for c in costs if c.cpu_s is not None]
    return (f"{name}: out tok/s per run "
            f"{[round(r.summary.output_throughput, 1) for r in runs]}; server CPU s per run "
            f"{[round(c, 1) for c in cpu]}"
            f"{f' (median {statistics.median(cpu):.1f})' if cpu else ''}; load avg at the "
            f"end of each run {[round(c.load_avg, 1) for c in costs]}")


def build_report(systems: Sequence[SystemSpec], results: Results) -> Report:
    """Every system's row and record, in the systems' order."""
    report = Report()
    for spec in systems:
        res = results[spec.name]
        if isinstance(res, str):
            report.rows[spec.name] = res
            report.record[spec.name] = {"error": res}
            continue
        runs, costs = res
        figures = median_figures([r.summary for r in runs])
        report.rows[spec.name] = figures
        report.record[spec.name] = {"figures": figures, "argv": spec.argv,
                                    "runs": [r.to_dict() for r in runs],
                                    "cost": [vars(c) for c in costs]}
        report.lines.append(_run_line(spec.name, runs, costs))
        report.notes.update(f"{spec.name}: {n}" for r in runs for n in r.notes)
    return report
